"""The paged KV cache [num_blocks, block_size, KVH, D] (slot s: block s // block_size, offset
s % block_size), its stores, and fp8: a head x stored as x / s, s = amax(|x|) / 448, scales
[num_blocks, KVH, block_size] float32, V laid out [num_blocks, KVH, D, block_size] (tokens
contiguous: the tensor cores read 8-bit P @ V so). An fp8 cache holds no NaN (pool zeroed, NaN
stored as 0): the kernels read stale slots past a context, weighted 0, and 0 * NaN is not 0."""

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
FP8_MIN_AMAX = tl.constexpr(1e-12)  # an all-zero head still gets a positive scale


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """A token's K and V bytes in every layer's cache, fp8 scales included."""
    scale_bytes = 4 if dtype == torch.float8_e4m3fn else 0
    return 2 * num_layers * num_kv_heads * (head_dim * dtype.itemsize + scale_bytes)


@triton.jit
def store_fp8_scale(amax, scale_ptr, slot, head, NUM_KV_HEADS: tl.constexpr, PAGE: tl.constexpr,
                    mask=None):
    """The fp8 scale of heads of largest |element| amax, stored where head < NUM_KV_HEADS, mask."""
    scale = tl.maximum(amax, FP8_MIN_AMAX) / FP8_MAX
    offs = (slot // PAGE) * (NUM_KV_HEADS * PAGE) + head * PAGE + slot % PAGE
    stored = head < NUM_KV_HEADS
    if mask is not None:  # not `&`: the interpreter cannot and a scalar with a vector mask
        stored = tl.where(stored, mask, False)
    tl.store(scale_ptr + offs, scale, mask=stored)
    return scale


@triton.jit
def fp8_v_offset(slot, head, d, NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr):
    return ((slot // PAGE) * NUM_KV_HEADS + head) * (D * PAGE) + d * PAGE + slot % PAGE


@triton.jit
def to_fp8(x):
    return tl.where(x == x, x, 0.0).to(tl.float8e4nv)


@triton.jit
def _quantize_fp8(x, scale_ptr, slot, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  HEAD_DIM: tl.constexpr, PAGE: tl.constexpr):
    heads = tl.reshape(x.to(tl.float32), (BLOCK_D // HEAD_DIM, HEAD_DIM))
    scale = store_fp8_scale(tl.max(tl.abs(heads), 1), scale_ptr, slot,
                            tl.arange(0, BLOCK_D // HEAD_DIM), D // HEAD_DIM, PAGE)
    return to_fp8(tl.reshape(heads / scale[:, None], (BLOCK_D,)))


@triton.jit
def _store_kvcache_kernel(key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr,
                          k_scale_ptr, v_scale_ptr, slot_mapping_ptr, D: tl.constexpr,
                          BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                          FP8: tl.constexpr):
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
        value_offsets = fp8_v_offset(slot, offsets // HEAD_DIM, offsets % HEAD_DIM,
                                     D // HEAD_DIM, HEAD_DIM, PAGE)
    else:
        value_offsets = slot * D + offsets
    tl.store(k_cache_ptr + slot * D + offsets, key, mask=mask)
    tl.store(v_cache_ptr + value_offsets, value, mask=mask)


def v_token_major(v_cache: torch.Tensor) -> torch.Tensor:
    """A layer's V cache as a [num_blocks, block_size, num_kv_heads, head_dim] view."""
    return v_cache.permute(0, 3, 1, 2) if v_cache.dtype == torch.float8_e4m3fn else v_cache


def fp8_v_layout(v: torch.Tensor) -> torch.Tensor:
    return v.permute(0, 2, 3, 1).contiguous()


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                   v_scale: torch.Tensor | None, num_kv_heads: int, head_dim: int) -> bool:
    """Asserts what the Triton KV stores assume of a layer's cache; returns whether it is fp8."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    assert k_cache.shape == v_token_major(v_cache).shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert fp8 == (k_scale is not None), "an fp8 cache comes with its scales"
    if fp8:
        assert k_scale.is_contiguous() and v_scale.is_contiguous()
        assert head_dim & (head_dim - 1) == 0
        assert k_scale.shape == v_scale.shape == (k_cache.size(0), num_kv_heads, k_cache.size(1))
    return fp8


def store_kvcache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
    """key, value [T, KVH, D] into their slots (-1: nowhere), a program per token."""
    num_tokens, num_kv_heads, head_dim = key.shape
    d = num_kv_heads * head_dim
    assert key.stride(-1) == value.stride(-1) == 1 and key.stride(1) == value.stride(1) == head_dim
    fp8 = check_kv_cache(k_cache, v_cache, k_scale, v_scale, num_kv_heads, head_dim)
    if not fp8:
        k_scale, v_scale = k_cache, v_cache
    _store_kvcache_kernel[(num_tokens,)](key, key.stride(0), value, value.stride(0), k_cache,
                                         v_cache, k_scale, v_scale, slot_mapping, d,
                                         triton.next_power_of_2(d), head_dim, k_cache.size(1), fp8)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (x / scale in fp8, NaN as 0; float32 scale [...])."""
    x = x.float()
    scale = x.abs().amax(-1).clamp(min=FP8_MIN_AMAX.value) / FP8_MAX.value
    return (x / scale[..., None]).nan_to_num(nan=0.0).to(torch.float8_e4m3fn), scale


def quantize_cache_fp8(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Whole K, V caches -> (k_cache, k_scale, v_cache, v_scale) as the fp8 store writes them."""
    (k, k_scale), (v, v_scale) = quantize_fp8(k_cache), quantize_fp8(v_cache)
    k_scale, v_scale = (x.transpose(1, 2).contiguous() for x in (k_scale, v_scale))
    return k, k_scale, fp8_v_layout(v), v_scale


def store_kvcache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
    """key, value [T, KVH, D] into their slots (-1: nowhere)."""
    if bool((slot_mapping < 0).any()):
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    blocks, offsets = slots // k_cache.size(1), slots % k_cache.size(1)
    for x, cache, scales in ((key, k_cache, k_scale), (value, v_token_major(v_cache), v_scale)):
        if scales is not None:
            x, token_scales = quantize_fp8(x)
            scales[blocks, :, offsets] = token_scales
        if scales is None and cache.is_contiguous():
            cache.flatten(0, 1).index_copy_(0, slots, x.to(cache.dtype))
        else:
            cache[blocks, offsets] = x
