"""Paged attention: the per-step metadata and the attention backends behind one interface."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.attention.kv_cache import (
    store_kvcache_torch,
    store_kvcache_triton,
    v_token_major,
)
from nanovllm.kernels.attention.split_softmax import SplitSoftmax
from nanovllm.kernels.gemm.skinny import SKINNY_MAX_ROWS
from nanovllm.kernels.gemm.split_k import SplitKSum
from nanovllm.kernels.qk_norm_rope import NormRopeInputs

DEQUANT_MIN_QUERIES = 128
SeqGroup = tuple[int, int, int, int]  # first, end, max_seqlen_q, max_seqlen_k of seqs first..end-1


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slots; -1: write nothing
    context_lens: torch.Tensor  # [num_seqs] int32 keys each sequence attends to
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor | None = None  # [num_seqs + 1] int32, prefill
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    prefix_cached: bool = False  # some sequence attends to KV computed in an earlier step
    decode_order: torch.Tensor | None = None  # [num_seqs] int32, Triton decode: longest first
    # Triton prefill over an fp8 prefix: [2, capacity, kv_heads, head_dim], and workspace_groups
    dequant_workspace: torch.Tensor | None = None
    dequant_groups: list[SeqGroup] | None = None
    padded: "PaddedBatch | None" = None  # the torch backend's, built by its first layer
    # Decode rows of one sequence at consecutive positions (a verify step): every row's K/V is
    # stored before any row attends, so no kernel may store and attend at once.
    rows_share_sequences: bool = False


def dequantizing_pays(cu_seqlens_q: list[int], cu_seqlens_k: list[int]) -> bool:
    """Whether prefill over an fp8 prefix dequantizes it: from DEQUANT_MIN_QUERIES queries a key."""
    pairs = sum((cu_seqlens_q[b + 1] - cu_seqlens_q[b]) * (cu_seqlens_k[b + 1] - cu_seqlens_k[b])
                for b in range(len(cu_seqlens_k) - 1))
    return pairs >= DEQUANT_MIN_QUERIES * cu_seqlens_k[-1]


def workspace_groups(cu_seqlens_q: list[int], cu_seqlens_k: list[int],
                     capacity: int) -> list[SeqGroup]:
    """The runs of consecutive sequences whose contexts fit `capacity` tokens together."""
    groups, first = [], 0
    num_seqs = len(cu_seqlens_k) - 1
    for end in range(1, num_seqs + 1):
        if cu_seqlens_k[end] - cu_seqlens_k[end - 1] > capacity:
            raise ValueError(f"context of {cu_seqlens_k[end] - cu_seqlens_k[end - 1]} tokens "
                             f"exceeds the dequantization workspace of {capacity}")
        if end == num_seqs or cu_seqlens_k[end + 1] - cu_seqlens_k[first] > capacity:
            seqs = range(first, end)
            groups.append((first, end, max(cu_seqlens_q[b + 1] - cu_seqlens_q[b] for b in seqs),
                           max(cu_seqlens_k[b + 1] - cu_seqlens_k[b] for b in seqs)))
            first = end
    return groups


@dataclass(slots=True)
class PaddedBatch:
    """A step as [B, Lq] queries over [B, T] keys, padding repeating a sequence's last row."""

    query_index: torch.Tensor | None  # [B, Lq] rows of q; None in decode (row b)
    key_index: torch.Tensor  # [B * T] cache slots, or rows of k in a prefill without a prefix
    mask: torch.Tensor  # [B, 1, Lq, T] bool: where a query sees a key
    out_index: torch.Tensor | None  # [num_tokens] rows of the flattened [B * Lq] output


def padded_batch(meta: AttentionMetadata, block_size: int) -> PaddedBatch:
    """The torch backend's indices for the step, built by its first layer and kept in `meta`."""
    if meta.padded is not None:
        return meta.padded
    key_lens = meta.context_lens.long()
    num_seqs, device = key_lens.numel(), key_lens.device
    query_lens = meta.cu_seqlens_q.long().diff() if meta.is_prefill else torch.ones_like(key_lens)
    max_q, max_k = int(query_lens.max()), int(key_lens.max())
    keys = torch.arange(max_k, device=device)
    key_pos = torch.minimum(keys[None, :], (key_lens - 1).clamp(min=0)[:, None])
    if meta.is_prefill and not meta.prefix_cached:
        key_index = meta.cu_seqlens_k[:-1].long()[:, None] + key_pos
    else:
        blocks = meta.block_tables.long().gather(1, key_pos // block_size)
        key_index = blocks * block_size + key_pos % block_size
    queries = torch.arange(max_q, device=device)
    query_pos = (key_lens - query_lens)[:, None] + queries[None, :]  # positions in the sequence
    mask = keys[None, None, :] <= query_pos.clamp(min=0)[:, :, None]
    query_index = out_index = None
    if meta.is_prefill:
        first = meta.cu_seqlens_q[:-1].long()[:, None]
        query_index = first + torch.minimum(queries[None, :], query_lens[:, None] - 1)
        rows = torch.arange(num_seqs, device=device)[:, None] * max_q + queries[None, :]
        out_index = rows.masked_select(queries[None, :] < query_lens[:, None])
    meta.padded = PaddedBatch(query_index, key_index.flatten(), mask.unsqueeze(1), out_index)
    return meta.padded


def _gather(cache, scales, slots, block_size) -> torch.Tensor:
    """[len(slots), KVH, D] float32 rows of a paged cache (dequantized by its scales)."""
    if scales is None and cache.is_contiguous():
        return cache.flatten(0, 1).index_select(0, slots).float()
    blocks, offsets = slots // block_size, slots % block_size
    x = cache[blocks, offsets].float()
    if scales is not None:
        x *= scales[blocks, :, offsets][..., None]
    return x


def torch_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    k_scale=None, v_scale=None) -> torch.Tensor:
    """Reference: every sequence at once, keys gathered through the block tables and padded."""
    block_size = k_cache.size(1)
    batch = padded_batch(meta, block_size)
    num_seqs, max_k = batch.mask.size(0), batch.mask.size(-1)
    if meta.is_prefill and not meta.prefix_cached:
        keys, values = (x.index_select(0, batch.key_index).float() for x in (k, v))
    else:
        keys = _gather(k_cache, k_scale, batch.key_index, block_size)
        values = _gather(v_token_major(v_cache), v_scale, batch.key_index, block_size)
    keys, values = (x.view(num_seqs, max_k, *x.shape[1:]).transpose(1, 2) for x in (keys, values))
    queries = q[batch.query_index] if meta.is_prefill else q.unsqueeze(1)  # [B, Lq, H, D]
    out = F.scaled_dot_product_attention(queries.float().transpose(1, 2), keys, values,
                                         attn_mask=batch.mask, scale=scale, enable_gqa=True)
    out = out.transpose(1, 2).to(q.dtype)
    if not meta.is_prefill:
        return out.squeeze(1)
    return out.flatten(0, 1).index_select(0, batch.out_index)


def flash_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    k_scale=None, v_scale=None) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    assert k_scale is None, "flash-attn cannot read an fp8 cache (Config rejects it)"
    if not meta.is_prefill:
        out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                      cache_seqlens=meta.context_lens,
                                      block_table=meta.block_tables, softmax_scale=scale,
                                      causal=True)
        return out.squeeze(1)
    block_table = None
    if meta.prefix_cached:
        k, v, block_table = k_cache, v_cache, meta.block_tables
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q=meta.cu_seqlens_q,
                                  cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_seqlen_q,
                                  max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale, causal=True,
                                  block_table=block_table)


def triton_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                     k_scale=None, v_scale=None) -> torch.Tensor:
    from nanovllm.kernels.attention.decode import paged_decode_attention
    from nanovllm.kernels.attention.prefill import (
        dequantized_prefill_attention,
        paged_prefill_attention,
        varlen_prefill_attention,
    )

    if not meta.is_prefill:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                      scale, k_scale=k_scale, v_scale=v_scale,
                                      order=meta.decode_order)
    if not meta.prefix_cached:  # as flash-attn: an fp8 cache's rounding touches decode only
        return varlen_prefill_attention(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, scale)
    if meta.dequant_groups:
        return dequantized_prefill_attention(q, k_cache, v_cache, k_scale, v_scale,
                                             meta.block_tables, meta.cu_seqlens_q,
                                             meta.cu_seqlens_k, meta.dequant_groups, scale,
                                             meta.dequant_workspace)
    return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                   meta.context_lens, meta.max_seqlen_q, scale, k_scale=k_scale,
                                   v_scale=v_scale)


BACKENDS: dict[str, Callable] = {
    "torch": torch_attention, "flash_attn": flash_attention, "triton": triton_attention}


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 backend: str):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.attend = BACKENDS[backend]
        self.store = store_kvcache_torch if backend == "torch" else store_kvcache_triton
        # The ModelRunner sets this layer's views of the KV pool (the scales: fp8 only).
        self.k_cache = self.v_cache = torch.tensor([])
        self.k_scale = self.v_scale = None

    def kv_cache_views(self) -> dict[str, torch.Tensor | None]:
        """The cache as keyword arguments of a kernel that stores the new K/V (then forward with
        kv_stored=True); {} before the pool exists."""
        if self.k_cache.numel() == 0:
            return {}
        return dict(k_cache=self.k_cache, v_cache=self.v_cache, k_scale=self.k_scale,
                    v_scale=self.v_scale)

    def decodes_from_qkv(self, qkv: torch.Tensor | SplitKSum, meta: AttentionMetadata) -> bool:
        # Its output feeds the skinny GEMM, which takes 16-bit rows only.
        return (self.attend is triton_attention and not meta.is_prefill
                and not meta.rows_share_sequences and qkv.dtype in (torch.bfloat16, torch.float16)
                and qkv.shape[0] <= SKINNY_MAX_ROWS and meta.slot_mapping is not None
                and self.k_cache.numel() > 0)

    def decode_from_qkv(self, inputs: NormRopeInputs,
                        meta: AttentionMetadata) -> torch.Tensor | SplitSoftmax:
        """Decode attention from the qkv projection: o_proj's input, or its SplitSoftmax."""
        from nanovllm.kernels.attention.decode import paged_decode_attention

        out = paged_decode_attention(None, self.k_cache, self.v_cache, meta.block_tables,
                                     meta.context_lens, self.scale, k_scale=self.k_scale,
                                     v_scale=self.v_scale, order=meta.decode_order,
                                     from_qkv=inputs, defer_merge=True)
        return out if isinstance(out, SplitSoftmax) else out.flatten(1, -1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv_stored: bool = False) -> torch.Tensor:
        """q [T, heads, head_dim], k, v [T, kv_heads, head_dim], stored first unless kv_stored."""
        if self.k_cache.numel() == 0:  # the memory-profiling run, before the pool exists
            return torch.zeros_like(q)
        if not kv_stored:
            self.store(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale,
                       self.v_scale)
        return self.attend(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.k_scale,
                           self.v_scale)

