"""Paged attention: the per-step metadata, the KV store, and the backends behind one interface.

Each layer's K/V cache is [num_blocks, block_size, num_kv_heads, head_dim]; token slot s lives at
block s // block_size, offset s % block_size. A step first writes its new K/V into the cache, then
attends over the cache (or, for prefill without cached prefix on flash-attn, over the new K/V).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn


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


@triton.jit
def _store_kvcache_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr,
                          slot_mapping_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot == -1:
        return
    offsets = tl.arange(0, BLOCK_D)
    mask = offsets < D
    key = tl.load(key_ptr + token * key_stride + offsets, mask=mask)
    value = tl.load(value_ptr + token * value_stride + offsets, mask=mask)
    tl.store(k_cache_ptr + slot * D + offsets, key, mask=mask)
    tl.store(v_cache_ptr + slot * D + offsets, value, mask=mask)


def store_kvcache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """One program per token copies its K and V ([num_kv_heads * head_dim] each) into its slot."""
    num_tokens, num_kv_heads, head_dim = key.shape
    d = num_kv_heads * head_dim
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and key.stride(1) == head_dim
    assert value.stride(1) == head_dim and k_cache.is_contiguous() and v_cache.is_contiguous()
    _store_kvcache_kernel[(num_tokens,)](key, key.stride(0), value, value.stride(0), k_cache, v_cache,
                                         slot_mapping, d, triton.next_power_of_2(d))


def store_kvcache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor):
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *key.shape[1:])[slots] = key[valid]
    v_cache.view(-1, *value.shape[1:])[slots] = value[valid]


def torch_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Reference: per sequence, gather its keys through the block table; causal softmax; GQA by repeat."""
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
        blocks = meta.block_tables[i, :(num_keys + block_size - 1) // block_size].long()
        keys = k_cache[blocks].flatten(0, 1)[:num_keys].repeat_interleave(group, dim=1)  # [keys, heads, dim]
        values = v_cache[blocks].flatten(0, 1)[:num_keys].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys.float()) * scale
        # Query j sits at position num_keys - num_queries + j and sees keys up to that position.
        query_pos = torch.arange(num_keys - (end - start), num_keys, device=q.device)
        mask = torch.arange(num_keys, device=q.device)[None, :] > query_pos[:, None]
        probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values.float()).to(q.dtype)
    return out


def flash_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    if not meta.is_prefill:
        return flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                                       block_table=meta.block_tables, softmax_scale=scale, causal=True).squeeze(1)
    block_table = None
    if meta.prefix_cached:  # read the whole context, cached prefix included, from the paged cache
        k, v, block_table = k_cache, v_cache, meta.block_tables
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
                                  max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                                  softmax_scale=scale, causal=True, block_table=block_table)


def triton_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    from nanovllm.layers.triton_attention import paged_decode_attention, paged_prefill_attention

    if not meta.is_prefill:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
    return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                                   meta.max_seqlen_q, scale)


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
        # Set by the ModelRunner to this layer's views of the KV pool.
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        if self.k_cache.numel() == 0:
            # Memory-profiling run before the pool exists: attention's workspace is negligible next
            # to the activations measured, so its output is not computed.
            return torch.zeros_like(q)
        self.store(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.attend(q, k, v, self.k_cache, self.v_cache, meta, self.scale)

