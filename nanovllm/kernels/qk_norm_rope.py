"""Per-head q/k RMSNorm (Qwen3's q_norm, k_norm) and neox RoPE fused in one Triton kernel, which
can also store the new K/V into the paged cache. It rounds as the torch ops do but for the order of
a head's sum of squares; the cache gets exactly what the KV store (kv_cache.py) would write."""

import dataclasses

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.kv_cache import (
    check_kv_cache,
    fp8_v_offset,
    store_fp8_scale,
    to_fp8,
)
from nanovllm.kernels.device import pdl_enabled
from nanovllm.kernels.gemm.split_k import SplitKSum, load_split_sum, split_operand
from nanovllm.kernels.norm import weighted_as_torch


@triton.jit
def _store_heads(x1, x2, cache_ptr, scale_ptr, slot, first_head, HEADS: tl.constexpr,
                 NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                 FP8: tl.constexpr, IS_V: tl.constexpr):
    """KV heads first_head.. of a token, as halves x1, x2 [HEADS, D // 2], into slot `slot`."""
    half = tl.arange(0, D // 2)[None, :]
    heads = first_head + tl.arange(0, HEADS)
    if FP8:
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x1), 1), tl.max(tl.abs(x2), 1))
        scale = store_fp8_scale(amax, scale_ptr, slot, heads, NUM_KV_HEADS, PAGE)[:, None]
        x1, x2 = to_fp8(x1 / scale), to_fp8(x2 / scale)
    heads = heads[:, None]
    if FP8 and IS_V:
        first, second = (fp8_v_offset(slot, heads, half, NUM_KV_HEADS, D, PAGE),
                         fp8_v_offset(slot, heads, half + D // 2, NUM_KV_HEADS, D, PAGE))
    else:
        first = (slot * NUM_KV_HEADS + heads) * D + half
        second = first + D // 2
    tl.store(cache_ptr + first, x1)
    tl.store(cache_ptr + second, x2)


@triton.jit
def _load_halves(qkv_ptr, src, mask, split_stride, SPLITS: tl.constexpr, D: tl.constexpr,
                 dtype: tl.constexpr):
    return (load_split_sum(qkv_ptr, src, mask, split_stride, SPLITS, dtype),
            load_split_sum(qkv_ptr, src + D // 2, mask, split_stride, SPLITS, dtype))


@triton.jit
def _float_halves(ptr, D: tl.constexpr):
    half = tl.arange(0, D // 2)[None, :]
    return tl.load(ptr + half).to(tl.float32), tl.load(ptr + D // 2 + half).to(tl.float32)


@triton.jit
def rope_factors(cos_sin_row, w_ptr, HAS_NORM: tl.constexpr, D: tl.constexpr):
    """(w1, w2, cos, sin) float32 halves [1, D // 2]: the norm weight's (HAS_NORM) and cos/sin."""
    cos, sin = _float_halves(cos_sin_row, D)
    w1, w2 = cos, sin
    if HAS_NORM:
        w1, w2 = _float_halves(w_ptr, D)
    return w1, w2, cos, sin


@triton.jit
def normed_rotated(x1, x2, w1, w2, cos, sin, eps, HAS_NORM: tl.constexpr, D: tl.constexpr,
                   dtype: tl.constexpr):
    """Halves x1, x2 [rows, D // 2] normed and rotated as torch rounds them (without FMA)."""
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        mean_sq = tl.sum(x1 * x1 + x2 * x2, axis=1)[:, None] / D
        inv_rms = tl.math.rsqrt(mean_sq + eps)
        x1 = weighted_as_torch(x1, inv_rms, w1, dtype).to(dtype).to(tl.float32)
        x2 = weighted_as_torch(x2, inv_rms, w2, dtype).to(dtype).to(tl.float32)
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)


@triton.jit
def decode_q_storing_kv(qkv_ptr, stride_qkv, qkv_split_stride, token, kv_head, q_factors,
                        k_factors, eps, store, slot, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                        v_scale_ptr, G: tl.constexpr, G_PAD: tl.constexpr,
                        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, D: tl.constexpr,
                        PAGE: tl.constexpr, QKV_SPLITS: tl.constexpr, HAS_NORM: tl.constexpr,
                        FP8: tl.constexpr, dtype: tl.constexpr):
    """The G query heads [G_PAD, D] of a token's kv head, as _qk_norm_rope_kernel computes them;
    if `store`, its k and v stored at `slot` (the caller barriers before it reads the cache)."""
    g = tl.arange(0, G_PAD)[:, None]
    half = tl.arange(0, D // 2)[None, :]
    src = token * stride_qkv + (kv_head * G + g) * D + half
    k_src = token * stride_qkv + (NUM_HEADS + kv_head) * D + half
    stored = tl.where(half < D // 2, store, False)  # store, as a tensor mask
    x1, x2 = _load_halves(qkv_ptr, src, g < G, qkv_split_stride, QKV_SPLITS, D, dtype)
    k1, k2 = _load_halves(qkv_ptr, k_src, stored, qkv_split_stride, QKV_SPLITS, D, dtype)
    v1, v2 = _load_halves(qkv_ptr, k_src + NUM_KV_HEADS * D, stored, qkv_split_stride, QKV_SPLITS,
                          D, dtype)
    y1, y2 = normed_rotated(x1, x2, *q_factors, eps, HAS_NORM, D, dtype)
    q = tl.reshape(tl.permute(tl.join(y1, y2), (0, 2, 1)), (G_PAD, D))  # the halves side by side
    if store:
        k1, k2 = normed_rotated(k1, k2, *k_factors, eps, HAS_NORM, D, dtype)
        _store_heads(k1, k2, k_cache_ptr, k_scale_ptr, slot, kv_head, 1, NUM_KV_HEADS, D, PAGE,
                     FP8, IS_V=False)
        _store_heads(v1, v2, v_cache_ptr, v_scale_ptr, slot, kv_head, 1, NUM_KV_HEADS, D, PAGE,
                     FP8, IS_V=True)
    return q


@triton.jit(do_not_specialize=["num_tokens"])  # one compilation for every prefill size
def _store_v_fp8_tiles_kernel(qkv_ptr, stride_qkv, slot_mapping_ptr, v_cache_ptr, v_scale_ptr,
                              num_tokens, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                              D: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr,
                              PDL: tl.constexpr):
    """Grid (token tiles, NUM_KV_HEADS): _store_heads's fp8 V, a warp's lanes on consecutive
    tokens of one dim, so that consecutive slots (prefill) take one sector, not 32."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    tokens = tl.program_id(0) * TILE + tl.arange(0, TILE)
    head = tl.program_id(1)
    d = tl.arange(0, D)
    present = tokens < num_tokens
    slot = tl.load(slot_mapping_ptr + tokens, mask=present, other=-1)
    stored = slot != -1
    v = tl.load(qkv_ptr + tokens.to(tl.int64)[:, None] * stride_qkv
                + (NUM_HEADS + NUM_KV_HEADS + head) * D + d,
                mask=present[:, None], other=0.0).to(tl.float32)
    scale = store_fp8_scale(tl.max(tl.abs(v), 1), v_scale_ptr, slot, head, NUM_KV_HEADS, PAGE,
                            stored)
    tl.store(v_cache_ptr + fp8_v_offset(slot[:, None], head, d[None, :], NUM_KV_HEADS, D, PAGE),
             to_fp8(v / scale[:, None]), mask=stored[:, None])


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, stride_qkv, qkv_split_stride, positions_ptr, cos_sin_ptr,
                         stride_cs, q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr, eps,
                         slot_mapping_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, D: tl.constexpr,
                         HEADS: tl.constexpr, QKV_SPLITS: tl.constexpr, HAS_NORM: tl.constexpr,
                         STORE: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr,
                         PDL: tl.constexpr):
    """Grid (T, heads // HEADS): HEADS heads of one kind (q, k, or v when stored or summed) of a
    token, in qkv's order. With QKV_SPLITS, the v heads are also written to v_ptr."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS
    heads = head + tl.arange(0, HEADS)[:, None]
    half = tl.arange(0, D // 2)[None, :]
    is_q = head < NUM_HEADS
    w_ptr = q_weight_ptr
    if HAS_NORM:
        if not is_q:
            w_ptr = k_weight_ptr
    factors = rope_factors(cos_sin_ptr + tl.load(positions_ptr + token) * stride_cs, w_ptr,
                           HAS_NORM, D)
    if PDL:
        tl.extra.cuda.gdc_wait()
    src = token * stride_qkv + heads * D + half
    dtype = q_ptr.dtype.element_ty
    x1, x2 = _load_halves(qkv_ptr, src, None, qkv_split_stride, QKV_SPLITS, D, dtype)
    if STORE:
        slot = tl.load(slot_mapping_ptr + token)
    if head >= NUM_HEADS + NUM_KV_HEADS:  # v heads: stored unchanged
        v_head = head - NUM_HEADS - NUM_KV_HEADS
        if QKV_SPLITS > 0:
            dst = v_ptr + (token * NUM_KV_HEADS + heads - NUM_HEADS - NUM_KV_HEADS) * D + half
            tl.store(dst, x1)
            tl.store(dst + D // 2, x2)
        if STORE:
            if slot != -1:
                _store_heads(x1, x2, v_cache_ptr, v_scale_ptr, slot, v_head, HEADS, NUM_KV_HEADS,
                             D, PAGE, FP8, IS_V=True)
        return
    y1, y2 = normed_rotated(x1, x2, *factors, eps, HAS_NORM, D, dtype)
    if is_q:
        dst = q_ptr + (token * NUM_HEADS + heads) * D + half
    else:
        dst = k_ptr + (token * NUM_KV_HEADS + heads - NUM_HEADS) * D + half
    tl.store(dst, y1)
    tl.store(dst + D // 2, y2)
    if STORE:
        if not is_q and slot != -1:
            _store_heads(y1, y2, k_cache_ptr, k_scale_ptr, slot, head - NUM_HEADS, HEADS,
                         NUM_KV_HEADS, D, PAGE, FP8, IS_V=False)


@dataclasses.dataclass(frozen=True, slots=True)
class NormRopeInputs:
    """qk_norm_rope's inputs of a decode step, for paged_decode_attention's from_qkv."""
    qkv: torch.Tensor | SplitKSum
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_heads: int
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 1e-6


# From this many tokens a program takes several heads (_heads_per_program).
MANY_TOKENS = 64
# Tokens per program of a prefill's fp8 V store (qk_norm_rope's v_store_tile).
V_STORE_TILE = 64


def qk_norm_rope(qkv: torch.Tensor | SplitKSum, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, slot_mapping: torch.Tensor | None = None,
                 k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 heads_per_program: int | None = None,
                 v_store_tile: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [T, num_heads, D], k, v [T, num_kv_heads, D]) of the qkv projection [T, (num_heads +
    2 num_kv_heads) D]: q, k normed (q_weight, k_weight; None: RoPE only) and rotated at positions;
    v a view of qkv (new for a SplitKSum). Given a cache, k and v are also stored at slot_mapping
    (int64 [T], -1: nowhere); v_store_tile > 0: an fp8 V by tiles of tokens (prefill)."""
    num_tokens = qkv.shape[0]
    data, splits, split_stride = split_operand(qkv)
    _check_inputs(qkv, data, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim,
                  q_weight, k_weight)
    store, fp8 = k_cache is not None, False
    if store:
        fp8 = check_kv_cache(k_cache, v_cache, k_scale, v_scale, num_kv_heads, head_dim)
        assert fp8 or k_cache.dtype == qkv.dtype, "a cache of another dtype than the model's is fp8"
        assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    new = dict(dtype=qkv.dtype, device=data.device)
    q = torch.empty(num_tokens, num_heads, head_dim, **new)
    k = torch.empty(num_tokens, num_kv_heads, head_dim, **new)
    if splits:
        v = torch.empty(num_tokens, num_kv_heads, head_dim, **new)
    else:
        v = qkv[:, -num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    heads = heads_per_program or _heads_per_program(num_tokens, num_heads, num_kv_heads)
    assert num_heads % heads == 0 and num_kv_heads % heads == 0 and heads & (heads - 1) == 0
    v_tiles = store and fp8 and v_store_tile > 0 and not splits
    v_programs = splits or (store and not v_tiles)
    grid = (num_tokens, (num_heads + num_kv_heads + (num_kv_heads if v_programs else 0)) // heads)
    pdl = pdl_enabled(data.device)
    _qk_norm_rope_kernel[grid](
        data, data.stride(-2), split_stride, positions, cos_sin_cache, cos_sin_cache.stride(0),
        q, k, v, q_weight, k_weight, eps, slot_mapping, k_cache, v_cache, k_scale, v_scale,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, D=head_dim, HEADS=heads,
        QKV_SPLITS=splits, HAS_NORM=q_weight is not None, STORE=store,
        PAGE=k_cache.size(1) if store else 1, FP8=fp8, PDL=pdl, launch_pdl=pdl,
        num_warps=1,  # the sums of squares need no cross-warp step
        enable_fp_fusion=False)  # x1 * cos - x2 * sin rounds each product as torch does
    if v_tiles:
        _store_v_by_tiles(data, slot_mapping, v_cache, v_scale, num_heads, num_kv_heads, head_dim,
                          k_cache.size(1), v_store_tile, pdl)
    return q, k, v


def _check_inputs(qkv, data, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim,
                  q_weight, k_weight) -> None:
    assert head_dim & (head_dim - 1) == 0, f"head_dim={head_dim} is not a power of two"
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and data.stride(-1) == 1
    assert cos_sin_cache.shape[1] == head_dim and cos_sin_cache.stride(1) == 1
    assert cos_sin_cache.dtype == torch.float32 and positions.shape == (qkv.shape[0],)
    assert (q_weight is None) == (k_weight is None)
    if q_weight is not None:
        assert q_weight.dtype == k_weight.dtype == qkv.dtype, "weight * x rounds to qkv's dtype"
        assert q_weight.is_contiguous() and k_weight.is_contiguous()


def _store_v_by_tiles(data, slot_mapping, v_cache, v_scale, num_heads, num_kv_heads, head_dim,
                      page, tile, pdl):
    """_store_v_fp8_tiles_kernel over qkv's rows `data`, tiles of `tile` tokens."""
    assert tile & (tile - 1) == 0, f"v_store_tile={tile} is not a power of two"
    num_tokens = data.shape[-2]
    _store_v_fp8_tiles_kernel[(triton.cdiv(num_tokens, tile), num_kv_heads)](
        data, data.stride(-2), slot_mapping, v_cache, v_scale, num_tokens, NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads, D=head_dim, PAGE=page, TILE=tile, PDL=pdl, launch_pdl=pdl,
        num_warps=4)


def _heads_per_program(num_tokens: int, num_heads: int, num_kv_heads: int) -> int:
    """1 below MANY_TOKENS, else the largest power of two <= 8 dividing both head counts."""
    if num_tokens < MANY_TOKENS:
        return 1
    heads = 8
    while num_heads % heads or num_kv_heads % heads:
        heads //= 2
    return heads
