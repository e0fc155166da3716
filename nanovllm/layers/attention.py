"""Paged attention: the per-step metadata, the KV store, and the backends behind one interface.

Each layer's K/V cache is [num_blocks, block_size, num_kv_heads, head_dim]; token slot s lives at
block s // block_size, offset s % block_size. A step first writes its new K/V into the cache (the
Attention layer's store, or on CUDA the model's fused q/k norm + RoPE kernel, qk_norm_rope.py), then
attends over the cache (or, for prefill without a cached prefix, over the new K/V; for prefill over an
fp8 prefix with enough new tokens, over a 16-bit copy of the contexts: dequantizing_pays).

With kv_cache_dtype="fp8" the caches are float8_e4m3fn and each layer also has k_scale, v_scale
[num_blocks, num_kv_heads, block_size] float32 (slot s of head h at [s // block_size, h, s % block_size],
so the scales of a block's consecutive tokens of one head are contiguous): a token's head x is stored
as x / s with s = amax(|x|) / 448, so its largest element maps to e4m3's largest finite value and none
saturates, whatever their magnitude. Only the Triton and torch backends read such a cache.

An fp8 cache holds only finite values: the pool starts zeroed, and the stores write an element that
is not a number (possible only from non-finite activations, which poison their own token anyway) as
0. The Triton kernels rely on it: their fp8 V loads are masked only by runs of 16 tokens (a 16-byte
load each, below), so they read the stale slots in the last run past a sequence's context, whose
probability is 0, and 0 * NaN would not be 0.

An fp8 V cache is laid out [num_blocks, num_kv_heads, head_dim, block_size]: tokens contiguous. The
attention kernels' P @ V product reduces over tokens, and the tensor cores read 8-bit operands only
with the reduced dimension contiguous; in the token-major layout the decode kernel fetched V from
shared memory byte by byte. `v_token_major` gives every V cache as [num_blocks, block_size,
num_kv_heads, head_dim] (a view), which is how the torch code reads and writes it.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn

# Constexprs, so the store kernel may read them; `.value` in torch code.
FP8_MAX = tl.constexpr(448.0)  # largest finite float8_e4m3fn
FP8_MIN_AMAX = tl.constexpr(1e-12)  # an all-zero head still gets a positive scale


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


@triton.jit
def store_fp8_scale(amax, scale_ptr, slot, head, NUM_KV_HEADS: tl.constexpr, PAGE: tl.constexpr):
    """The fp8 scale of head(s) `head` of the token in cache slot `slot`, whose largest |element| is
    amax (float32), as quantize_fp8 computes it; stored at scale_ptr[slot // PAGE, head, slot % PAGE]
    but for heads >= NUM_KV_HEADS (padding to a power of two)."""
    scale = tl.maximum(amax, FP8_MIN_AMAX) / FP8_MAX
    offs = (slot // PAGE) * (NUM_KV_HEADS * PAGE) + head * PAGE + slot % PAGE
    tl.store(scale_ptr + offs, scale, mask=head < NUM_KV_HEADS)
    return scale


@triton.jit
def to_fp8(x):
    """x (float32, |x| <= 448 where it is a number) in fp8, NaN written as 0: the cache holds no NaN."""
    return tl.where(x == x, x, 0.0).to(tl.float8e4nv)


@triton.jit
def _quantize_fp8(x, scale_ptr, slot, D: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                  PAGE: tl.constexpr):
    """x: one token's K or V, [BLOCK_D] = heads of HEAD_DIM flattened (D valid). Stores each head's
    scale (store_fp8_scale) and returns x / scale in fp8, as quantize_fp8 computes it."""
    heads = tl.reshape(x.to(tl.float32), (BLOCK_D // HEAD_DIM, HEAD_DIM))
    scale = store_fp8_scale(tl.max(tl.abs(heads), 1), scale_ptr, slot, tl.arange(0, BLOCK_D // HEAD_DIM),
                            D // HEAD_DIM, PAGE)  # [BLOCK_D // HEAD_DIM]
    return to_fp8(tl.reshape(heads / scale[:, None], (BLOCK_D,)))


@triton.jit
def _store_kvcache_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr,
                          k_scale_ptr, v_scale_ptr, slot_mapping_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                          HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot == -1:
        return
    offsets = tl.arange(0, BLOCK_D)
    mask = offsets < D
    key = tl.load(key_ptr + token * key_stride + offsets, mask=mask)
    value = tl.load(value_ptr + token * value_stride + offsets, mask=mask)
    if FP8:
        key = _quantize_fp8(key, k_scale_ptr, slot, D, BLOCK_D, HEAD_DIM, PAGE)
        value = _quantize_fp8(value, v_scale_ptr, slot, D, BLOCK_D, HEAD_DIM, PAGE)
        # [num_blocks, kv_heads, head_dim, PAGE]: element `offsets` (head * HEAD_DIM + d) is PAGE apart
        value_offsets = (slot // PAGE) * (D * PAGE) + offsets * PAGE + slot % PAGE
    else:
        value_offsets = slot * D + offsets
    tl.store(k_cache_ptr + slot * D + offsets, key, mask=mask)
    tl.store(v_cache_ptr + value_offsets, value, mask=mask)


def v_token_major(v_cache: torch.Tensor) -> torch.Tensor:
    """A layer's V cache as [num_blocks, block_size, num_kv_heads, head_dim], a view: an fp8 V cache is
    stored [num_blocks, num_kv_heads, head_dim, block_size] (module docstring)."""
    return v_cache.permute(0, 3, 1, 2) if v_cache.dtype == torch.float8_e4m3fn else v_cache


def fp8_v_layout(v: torch.Tensor) -> torch.Tensor:
    """A token-major [num_blocks, block_size, num_kv_heads, head_dim] V cache in the fp8 V cache's layout,
    [num_blocks, num_kv_heads, head_dim, block_size] (a contiguous copy)."""
    return v.permute(0, 2, 3, 1).contiguous()


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                   v_scale: torch.Tensor | None, num_kv_heads: int, head_dim: int) -> bool:
    """Asserts what the Triton KV stores assume of a layer's cache (see the module docstring); returns
    whether it is fp8."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    assert k_cache.shape == v_token_major(v_cache).shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert fp8 == (k_scale is not None), "an fp8 cache comes with its scales"
    if fp8:
        assert k_scale.is_contiguous() and v_scale.is_contiguous() and head_dim & (head_dim - 1) == 0
        assert k_scale.shape == v_scale.shape == (k_cache.size(0), num_kv_heads, k_cache.size(1))
    return fp8


def store_kvcache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None):
    """One program per token copies its K and V ([num_kv_heads * head_dim] each) into its slot; into an
    fp8 cache quantized, with the scales written to k_scale, v_scale [num_blocks, num_kv_heads, block_size]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    d = num_kv_heads * head_dim
    assert key.stride(-1) == value.stride(-1) == 1 and key.stride(1) == value.stride(1) == head_dim
    fp8 = check_kv_cache(k_cache, v_cache, k_scale, v_scale, num_kv_heads, head_dim)
    if not fp8:
        k_scale, v_scale = k_cache, v_cache  # unused
    _store_kvcache_kernel[(num_tokens,)](key, key.stride(0), value, value.stride(0), k_cache, v_cache, k_scale,
                                         v_scale, slot_mapping, d, triton.next_power_of_2(d), head_dim,
                                         k_cache.size(1), fp8)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (x / scale as float8_e4m3fn, float32 scale [...]), scale = amax(|x|) / 448;
    NaN elements of x / scale are written as 0 (the module docstring says why)."""
    x = x.float()
    scale = x.abs().amax(-1).clamp(min=FP8_MIN_AMAX.value) / FP8_MAX.value
    return (x / scale[..., None]).nan_to_num(nan=0.0).to(torch.float8_e4m3fn), scale


def quantize_cache_fp8(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Whole [num_blocks, block_size, kv_heads, head_dim] K and V caches -> (k_cache, k_scale, v_cache,
    v_scale) in fp8 as the KV store would have written them: scales [num_blocks, kv_heads, block_size]
    float32, V in the fp8 V layout."""
    (k, k_scale), (v, v_scale) = quantize_fp8(k_cache), quantize_fp8(v_cache)
    return k, k_scale.transpose(1, 2).contiguous(), fp8_v_layout(v), v_scale.transpose(1, 2).contiguous()


def store_kvcache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None):
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // k_cache.size(1), slots % k_cache.size(1)
    for x, cache, scales in ((key, k_cache, k_scale), (value, v_token_major(v_cache), v_scale)):
        x = x[valid]  # [tokens, kv_heads, head_dim]
        if scales is not None:  # fp8 cache
            x, token_scales = quantize_fp8(x)
            scales[blocks, :, offsets] = token_scales  # [tokens, kv_heads]
        cache[blocks, offsets] = x


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
                     k_scale=None, v_scale=None) -> torch.Tensor:
    from nanovllm.layers.triton_decode import paged_decode_attention
    from nanovllm.layers.triton_prefill import (
        dequantized_prefill_attention,
        paged_prefill_attention,
        varlen_prefill_attention,
    )

    if not meta.is_prefill:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                      k_scale=k_scale, v_scale=v_scale, order=meta.decode_order)
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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv_stored: bool = False) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim], stored into
        the cache at meta.slot_mapping first unless `kv_stored` (already written there, see kv_cache_views)."""
        if self.k_cache.numel() == 0:
            # Memory-profiling run before the pool exists: attention's workspace is negligible next
            # to the activations measured, so its output is not computed.
            return torch.zeros_like(q)
        if not kv_stored:
            self.store(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return self.attend(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.k_scale, self.v_scale)

