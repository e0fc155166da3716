"""Paged attention: the per-step metadata and the backends behind one interface (the KV cache's layout
and stores: kv_cache.py).

A step first writes its new K/V into the cache (the Attention layer's store, kv_cache.py, or on CUDA the
model's fused q/k norm + RoPE kernel, qk_norm_rope.py, or in a Triton decode of a few rows the decode kernel,
from the qkv projection: Attention.decode_from_qkv), then attends over the cache (or, for prefill
without a cached prefix, over the new K/V; for prefill over an fp8 prefix with enough new tokens, over a
16-bit copy of the contexts: dequantizing_pays).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.kernels.attention.kv_cache import store_kvcache_torch, store_kvcache_triton, v_token_major
from nanovllm.kernels.attention.split_softmax import SplitSoftmax
from nanovllm.kernels.gemm.skinny import SKINNY_MAX_ROWS
from nanovllm.kernels.gemm.split_k import SplitKSum
from nanovllm.kernels.qk_norm_rope import NormRopeInputs

# Prefill over an fp8 prefix dequantizes it when there are at least this many queries per context token
# (dequantizing_pays).
DEQUANT_MIN_QUERIES = 128
SeqGroup = tuple[int, int, int, int]  # (first, end, max_seqlen_q, max_seqlen_k) of sequences first..end-1


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step; built by the ModelRunner, passed down the forward."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each computed token; -1 = write nothing
    context_lens: torch.Tensor  # [num_seqs] int32 keys each sequence attends to (cached + this step)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor | None = None  # [num_seqs + 1] int32, prefill only
    cu_seqlens_k: torch.Tensor | None = None  # [num_seqs + 1] int32, prefill only
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    prefix_cached: bool = False  # some sequence attends to KV computed in an earlier step
    # Decode on the Triton backend: [num_seqs] int32, the rows longest context first, the order in which the
    # decode kernel takes them up (a ragged batch then does not end on a few long rows).
    decode_order: torch.Tensor | None = None
    # Prefill over an fp8 cache's prefix (Triton backend, triton_prefill): [2, capacity, kv_heads, head_dim]
    # in the model dtype, and the runs of sequences whose contexts it holds at once (workspace_groups).
    dequant_workspace: torch.Tensor | None = None
    dequant_groups: list[SeqGroup] | None = None


def dequantizing_pays(cu_seqlens_q: list[int], cu_seqlens_k: list[int]) -> bool:
    """Whether a prefill step over an fp8 prefix should go through the dequantization workspace
    (triton_prefill.dequantized_prefill_attention). Dequantizing costs a pass over every context token;
    the 16-bit kernel then saves time per (query, key) pair. So the measure is the step's queries per
    context token, sum_b n_q_b * ctx_b / sum_b ctx_b, against DEQUANT_MIN_QUERIES. H200, Qwen3-0.6B heads,
    ~1,000-2,000-token contexts (BENCHMARKS.md, ninth session, call 3), dequantizing + the 16-bit kernel
    against the fp8 kernel: 0.48x its time at 512 queries a sequence, 0.70x at 128, 0.99x at 64, 1.88x
    at 16. Since the fp8 kernel's 64-row tiles multiply q k^T in fp8 (twelfth session, call 3): 0.79x at
    512, 1.05x at 128, 1.46x at 64. The threshold stays: at 128 the two are within 5%, and this path
    keeps q in 16 bits."""
    pairs = sum((cu_seqlens_q[b + 1] - cu_seqlens_q[b]) * (cu_seqlens_k[b + 1] - cu_seqlens_k[b])
                for b in range(len(cu_seqlens_k) - 1))
    return pairs >= DEQUANT_MIN_QUERIES * cu_seqlens_k[-1]


def workspace_groups(cu_seqlens_q: list[int], cu_seqlens_k: list[int], capacity: int) -> list[SeqGroup]:
    """Split a prefill batch into runs of consecutive sequences whose contexts fit `capacity` tokens
    together: (first, end, max_seqlen_q, max_seqlen_k) per run of sequences first..end-1. A context
    longer than capacity is an error (the workspace holds max_model_len tokens)."""
    groups, first = [], 0
    num_seqs = len(cu_seqlens_k) - 1
    for end in range(1, num_seqs + 1):
        if cu_seqlens_k[end] - cu_seqlens_k[end - 1] > capacity:
            raise ValueError(f"context of {cu_seqlens_k[end] - cu_seqlens_k[end - 1]} tokens exceeds the "
                             f"dequantization workspace of {capacity}")
        if end == num_seqs or cu_seqlens_k[end + 1] - cu_seqlens_k[first] > capacity:
            groups.append((first, end, max(cu_seqlens_q[b + 1] - cu_seqlens_q[b] for b in range(first, end)),
                           max(cu_seqlens_k[b + 1] - cu_seqlens_k[b] for b in range(first, end))))
            first = end
    return groups


def _gather(cache, scales, blocks, num_keys) -> torch.Tensor:
    """The first num_keys tokens of the cache blocks `blocks`, float32 (dequantized if fp8): [keys, kv_heads, dim]."""
    x = cache[blocks].flatten(0, 1)[:num_keys].float()
    if scales is not None:
        x *= scales[blocks].transpose(1, 2).flatten(0, 1)[:num_keys, :, None]
    return x


def torch_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    k_scale=None, v_scale=None) -> torch.Tensor:
    """Reference: per sequence, gather its keys through the block table (prefill without a cached prefix:
    its new k, v, as the other backends); causal softmax; GQA by repeat."""
    num_seqs = meta.context_lens.numel()
    if meta.is_prefill:
        query_starts = meta.cu_seqlens_q.tolist()
    else:
        query_starts = list(range(num_seqs + 1))
    block_size = k_cache.size(1)
    group = q.size(1) // k_cache.size(2)
    out = torch.empty_like(q)
    for i, num_keys in enumerate(meta.context_lens.tolist()):
        start, end = query_starts[i], query_starts[i + 1]
        if meta.is_prefill and not meta.prefix_cached:
            keys, values = k[start:end].float(), v[start:end].float()
        else:
            blocks = meta.block_tables[i, :(num_keys + block_size - 1) // block_size].long()
            keys = _gather(k_cache, k_scale, blocks, num_keys)
            values = _gather(v_token_major(v_cache), v_scale, blocks, num_keys)
        keys, values = (x.repeat_interleave(group, dim=1) for x in (keys, values))  # [keys, heads, dim]
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
        # Query j sits at position num_keys - num_queries + j and sees keys up to that position.
        query_pos = torch.arange(num_keys - (end - start), num_keys, device=q.device)
        mask = torch.arange(num_keys, device=q.device)[None, :] > query_pos[:, None]
        probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


def flash_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    k_scale=None, v_scale=None) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    assert k_scale is None, "flash-attn cannot read an fp8 cache (Config rejects it)"
    if not meta.is_prefill:
        return flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                                       block_table=meta.block_tables, softmax_scale=scale, causal=True).squeeze(1)
    block_table = None
    if meta.prefix_cached:  # read the whole context, cached prefix included, from the paged cache
        k, v, block_table = k_cache, v_cache, meta.block_tables
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
                                  max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                                  softmax_scale=scale, causal=True, block_table=block_table)


def triton_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                     k_scale=None, v_scale=None, v_staged: bool = False) -> torch.Tensor:
    from nanovllm.kernels.attention.decode import paged_decode_attention
    from nanovllm.kernels.attention.prefill import (
        dequantized_prefill_attention,
        paged_prefill_attention,
        varlen_prefill_attention,
    )

    if not meta.is_prefill:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                      k_scale=k_scale, v_scale=v_scale, order=meta.decode_order,
                                      staged_v=(v, meta.slot_mapping) if v_staged else None)
    if not meta.prefix_cached:  # over the new K/V, as flash-attn; an fp8 cache's rounding then touches decode only
        return varlen_prefill_attention(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, scale)
    if meta.dequant_groups:  # fp8 prefix: dequantized, so the faster 16-bit kernel attends
        return dequantized_prefill_attention(q, k_cache, v_cache, k_scale, v_scale, meta.block_tables,
                                             meta.cu_seqlens_q, meta.cu_seqlens_k, meta.dequant_groups, scale,
                                             meta.dequant_workspace)
    return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                                   meta.max_seqlen_q, scale, k_scale=k_scale, v_scale=v_scale)


BACKENDS: dict[str, Callable] = {"torch": torch_attention, "flash_attn": flash_attention, "triton": triton_attention}


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, backend: str):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.attend = BACKENDS[backend]
        self.store = store_kvcache_torch if backend == "torch" else store_kvcache_triton
        # Set by the ModelRunner to this layer's views of the KV pool (the scales only for an fp8 cache).
        self.k_cache = self.v_cache = torch.tensor([])
        self.k_scale = self.v_scale = None

    def kv_cache_views(self) -> dict[str, torch.Tensor | None]:
        """This layer's cache as the keyword arguments of a kernel that stores the new K/V itself
        (qk_norm_rope; then call forward with kv_stored=True). Empty before the pool exists (the
        memory-profiling run): then nothing is to be stored."""
        if self.k_cache.numel() == 0:
            return {}
        return dict(k_cache=self.k_cache, v_cache=self.v_cache, k_scale=self.k_scale, v_scale=self.v_scale)

    def decodes_from_qkv(self, qkv: torch.Tensor | SplitKSum, meta: AttentionMetadata) -> bool:
        """Whether decode_from_qkv serves this step: a decode step of the Triton backend of at most
        SKINNY_MAX_ROWS rows (where a kernel fewer a layer pays: BENCHMARKS.md, nineteenth session), once the
        pool exists."""
        return (self.attend is triton_attention and not meta.is_prefill and qkv.shape[0] <= SKINNY_MAX_ROWS
                and meta.slot_mapping is not None and self.k_cache.numel() > 0)

    def decode_from_qkv(self, inputs: NormRopeInputs, meta: AttentionMetadata) -> torch.Tensor | SplitSoftmax:
        """Decode attention from the qkv projection, as o_proj's input [num_seqs, num_heads * head_dim]: the
        decode kernel computes q as qk_norm_rope would and stores the new K/V itself
        (triton_decode.paged_decode_attention's from_qkv). Where its splits would need a merge kernel, their
        partials instead (a SplitSoftmax), which o_proj's skinny GEMM merges as it loads them."""
        from nanovllm.kernels.attention.decode import paged_decode_attention

        out = paged_decode_attention(None, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens,
                                     self.scale, k_scale=self.k_scale, v_scale=self.v_scale,
                                     order=meta.decode_order, from_qkv=inputs, defer_merge=True)
        return out if isinstance(out, SplitSoftmax) else out.flatten(1, -1)

    def stages_v(self, meta: AttentionMetadata) -> bool:
        """Whether this decode step's new V goes to the fp8 cache through the decode kernel (qk_norm_rope's stage_v)."""
        return (self.attend is triton_attention and not meta.is_prefill and self.v_scale is not None
                and self.k_cache.numel() > 0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv_stored: bool = False, v_staged: bool = False) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim], stored into
        the cache at meta.slot_mapping first unless `kv_stored` (already written there, see kv_cache_views)."""
        if self.k_cache.numel() == 0:
            # Memory-profiling run before the pool exists: attention's workspace is negligible next
            # to the activations measured, so its output is not computed.
            return torch.zeros_like(q)
        if not kv_stored:
            self.store(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        extra = {"v_staged": True} if v_staged else {}
        return self.attend(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.k_scale, self.v_scale, **extra)

