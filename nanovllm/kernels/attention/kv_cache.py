"""The paged KV cache: its layout, the stores that write a step's new K/V into it, and fp8 quantization.

Each layer's K/V cache is [num_blocks, block_size, num_kv_heads, head_dim]; token slot s lives at
block s // block_size, offset s % block_size.

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

import torch
import triton
import triton.language as tl

# Constexprs, so the store kernel may read them; `.value` in torch code.
FP8_MAX = tl.constexpr(448.0)  # largest finite float8_e4m3fn
FP8_MIN_AMAX = tl.constexpr(1e-12)  # an all-zero head still gets a positive scale


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """What one token takes in the caches: its K and V heads in every layer, and with an fp8 cache their
    float32 scales."""
    scale_bytes = 4 if dtype == torch.float8_e4m3fn else 0
    return 2 * num_layers * num_kv_heads * (head_dim * dtype.itemsize + scale_bytes)


@triton.jit
def store_fp8_scale(amax, scale_ptr, slot, head, NUM_KV_HEADS: tl.constexpr, PAGE: tl.constexpr, mask=None):
    """The fp8 scale of head(s) `head` of the token(s) in cache slot(s) `slot`, whose largest |element| is
    amax (float32), as quantize_fp8 computes it; stored at scale_ptr[slot // PAGE, head, slot % PAGE]
    but for heads >= NUM_KV_HEADS (padding to a power of two) and where `mask` (if given) is False."""
    scale = tl.maximum(amax, FP8_MIN_AMAX) / FP8_MAX
    offs = (slot // PAGE) * (NUM_KV_HEADS * PAGE) + head * PAGE + slot % PAGE
    stored = head < NUM_KV_HEADS
    if mask is not None:  # a where, not `&`: the interpreter cannot store with a scalar & vector mask
        stored = tl.where(stored, mask, False)
    tl.store(scale_ptr + offs, scale, mask=stored)
    return scale


@triton.jit
def fp8_v_offset(slot, head, d, NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr):
    """Where element d of kv head `head` of cache slot `slot` lies in an fp8 V cache [num_blocks,
    NUM_KV_HEADS, D, PAGE] (tokens contiguous: a token's elements are PAGE apart)."""
    return ((slot // PAGE) * NUM_KV_HEADS + head) * (D * PAGE) + d * PAGE + slot % PAGE


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
        value_offsets = fp8_v_offset(slot, offsets // HEAD_DIM, offsets % HEAD_DIM, D // HEAD_DIM, HEAD_DIM, PAGE)
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
