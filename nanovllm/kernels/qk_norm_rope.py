"""Fused per-head q/k RMSNorm (Qwen3's q_norm, k_norm) and neox-style RoPE in one Triton kernel, which
can also write the new K and V into the paged KV cache.

It replaces `rms_norm` on q and k followed by `apply_rope` and the KV store on CUDA, where those are
several small kernels per layer. The op order is the torch code's, so results match it to the last bit
but for the sum of squares, whose reduction order differs (see tests/test_qk_norm_rope.py for the
bounds). The cache gets exactly what the KV store (kv_cache.py) would write of the returned k and of v.
The qkv projection's split-K partials (a SplitKSum) can be given instead of its output: the kernel sums
them as it loads, so the projection needs no reduction kernel.

In a decode step of a few rows the decode kernel does this kernel's work itself (decode_q_storing_kv, given a
NormRopeInputs): one kernel fewer a layer (BENCHMARKS.md, nineteenth session).
"""

import dataclasses

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.kv_cache import check_kv_cache, fp8_v_offset, store_fp8_scale, to_fp8
from nanovllm.kernels.device import pdl_enabled
from nanovllm.kernels.gemm.split_k import SplitKSum, load_split_sum, split_operand
from nanovllm.layers.layernorm import weighted_as_torch


@triton.jit
def _store_heads(x1, x2, cache_ptr, scale_ptr, slot, first_head, HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                 D: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr, IS_V: tl.constexpr, staging_row=None):
    """Writes KV heads first_head.. first_head + HEADS - 1 of one token, as their halves x1, x2 [HEADS, D // 2],
    to cache slot `slot`; into an fp8 cache quantized as the KV store does (a scale per token and head).
    With staging_row (an fp8 V), the scales go to the cache but the heads to row staging_row of cache_ptr,
    a staging tensor [tokens, NUM_KV_HEADS, D] (qk_norm_rope's stage_v)."""
    half = tl.arange(0, D // 2)[None, :]
    heads = first_head + tl.arange(0, HEADS)
    if FP8:
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x1), 1), tl.max(tl.abs(x2), 1))
        scale = store_fp8_scale(amax, scale_ptr, slot, heads, NUM_KV_HEADS, PAGE)[:, None]
        x1, x2 = to_fp8(x1 / scale), to_fp8(x2 / scale)
    heads = heads[:, None]
    if staging_row is not None:
        first = (staging_row * NUM_KV_HEADS + heads) * D + half
        second = first + D // 2
    elif FP8 and IS_V:
        first, second = (fp8_v_offset(slot, heads, half, NUM_KV_HEADS, D, PAGE),
                         fp8_v_offset(slot, heads, half + D // 2, NUM_KV_HEADS, D, PAGE))
    else:
        first = (slot * NUM_KV_HEADS + heads) * D + half
        second = first + D // 2
    tl.store(cache_ptr + first, x1)
    tl.store(cache_ptr + second, x2)


@triton.jit
def _load_halves(qkv_ptr, src, mask, split_stride, SPLITS: tl.constexpr, D: tl.constexpr, dtype: tl.constexpr):
    """The halves [..., D // 2] of the heads whose first halves start at qkv_ptr + src, loaded through
    load_split_sum (SPLITS, split_stride: skinny_gemm.split_operand); 0 where mask (None: all) is False."""
    return (load_split_sum(qkv_ptr, src, mask, split_stride, SPLITS, dtype),
            load_split_sum(qkv_ptr, src + D // 2, mask, split_stride, SPLITS, dtype))


@triton.jit
def _float_halves(ptr, D: tl.constexpr):
    """The D values at ptr as float32 halves [1, D // 2]."""
    half = tl.arange(0, D // 2)[None, :]
    return tl.load(ptr + half).to(tl.float32), tl.load(ptr + D // 2 + half).to(tl.float32)


@triton.jit
def rope_factors(cos_sin_row, w_ptr, HAS_NORM: tl.constexpr, D: tl.constexpr):
    """What normed_rotated multiplies by, as float32 halves [1, D // 2]: the norm weight's at w_ptr (without
    HAS_NORM cos and sin again, unused), then RoPE's cos and sin (the cos_sin_cache row at cos_sin_row). No
    kernel writes them, so a kernel launched under PDL loads them before it waits."""
    cos, sin = _float_halves(cos_sin_row, D)
    w1, w2 = cos, sin
    if HAS_NORM:
        w1, w2 = _float_halves(w_ptr, D)
    return w1, w2, cos, sin


@triton.jit
def normed_rotated(x1, x2, w1, w2, cos, sin, eps, HAS_NORM: tl.constexpr, D: tl.constexpr, dtype: tl.constexpr):
    """Heads given as their halves x1, x2 [rows, D // 2], RMS-normed with the weight's halves w1, w2 (HAS_NORM)
    and rotated by RoPE's cos, sin (rope_factors loads these), with the torch ops' roundings (in a kernel
    launched without FMA contraction): their halves in dtype."""
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        # rms_norm: x * rsqrt(mean(x^2) + eps) in float32, rounded to dtype, then weight * x in dtype
        mean_sq = tl.sum(x1 * x1 + x2 * x2, axis=1)[:, None] / D
        inv_rms = tl.math.rsqrt(mean_sq + eps)
        x1 = weighted_as_torch(x1, inv_rms, w1, dtype).to(dtype).to(tl.float32)
        x2 = weighted_as_torch(x2, inv_rms, w2, dtype).to(dtype).to(tl.float32)
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)


@triton.jit
def decode_q_storing_kv(qkv_ptr, stride_qkv, qkv_split_stride, token, kv_head, q_factors, k_factors, eps, store,
                        slot, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                        G: tl.constexpr, G_PAD: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                        D: tl.constexpr, PAGE: tl.constexpr, QKV_SPLITS: tl.constexpr, HAS_NORM: tl.constexpr,
                        FP8: tl.constexpr, dtype: tl.constexpr):
    """For the decode kernel, what _qk_norm_rope_kernel computes of one token's kv head: its G query heads
    [G_PAD, D] (rows >= G zero), normed and rotated; and, if `store`, its k (normed, rotated) and v written to
    cache slot `slot` as _store_heads writes them. q_factors, k_factors: rope_factors of the token's cos/sin row
    and the q, k norm weights. The caller barriers before it reads the cache."""
    g = tl.arange(0, G_PAD)[:, None]
    half = tl.arange(0, D // 2)[None, :]
    src = token * stride_qkv + (kv_head * G + g) * D + half
    k_src = token * stride_qkv + (NUM_HEADS + kv_head) * D + half  # [1, D // 2]; the v head NUM_KV_HEADS heads on
    stored = tl.where(half < D // 2, store, False)  # store, as a tensor mask
    # The q, k and v heads are loaded together, k and v only where stored: one L2 round trip before the math,
    # where loading k and v inside `if store` took two more on the storing program's path, the kernel's longest.
    x1, x2 = _load_halves(qkv_ptr, src, g < G, qkv_split_stride, QKV_SPLITS, D, dtype)
    k1, k2 = _load_halves(qkv_ptr, k_src, stored, qkv_split_stride, QKV_SPLITS, D, dtype)
    v1, v2 = _load_halves(qkv_ptr, k_src + NUM_KV_HEADS * D, stored, qkv_split_stride, QKV_SPLITS, D, dtype)
    y1, y2 = normed_rotated(x1, x2, *q_factors, eps, HAS_NORM, D, dtype)
    q = tl.reshape(tl.permute(tl.join(y1, y2), (0, 2, 1)), (G_PAD, D))  # the halves side by side
    if store:
        k1, k2 = normed_rotated(k1, k2, *k_factors, eps, HAS_NORM, D, dtype)
        _store_heads(k1, k2, k_cache_ptr, k_scale_ptr, slot, kv_head, 1, NUM_KV_HEADS, D, PAGE, FP8, IS_V=False)
        _store_heads(v1, v2, v_cache_ptr, v_scale_ptr, slot, kv_head, 1, NUM_KV_HEADS, D, PAGE, FP8, IS_V=True)
    return q


@triton.jit(do_not_specialize=["num_tokens"])  # one compilation for every prefill size
def _store_v_fp8_tiles_kernel(qkv_ptr, stride_qkv, slot_mapping_ptr, v_cache_ptr, v_scale_ptr, num_tokens,
                              NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, D: tl.constexpr,
                              PAGE: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr):
    """Grid (cdiv(num_tokens, TILE), NUM_KV_HEADS): kv head program_id(1) of qkv's tokens in one tile, as
    _store_heads writes them into an fp8 V cache, but with a warp's lanes on consecutive tokens of one dim:
    where their slots are consecutive (prefill) a warp writes one sector, not one byte of each of 32."""
    if PDL:  # launched while the q/k norm + RoPE kernel runs; qkv is the projection's, before it
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    tokens = tl.program_id(0) * TILE + tl.arange(0, TILE)
    head = tl.program_id(1)
    d = tl.arange(0, D)
    present = tokens < num_tokens
    slot = tl.load(slot_mapping_ptr + tokens, mask=present, other=-1)  # -1: write nothing
    stored = slot != -1
    v = tl.load(qkv_ptr + tokens.to(tl.int64)[:, None] * stride_qkv + (NUM_HEADS + NUM_KV_HEADS + head) * D + d,
                mask=present[:, None], other=0.0).to(tl.float32)  # [TILE, D]
    scale = store_fp8_scale(tl.max(tl.abs(v), 1), v_scale_ptr, slot, head, NUM_KV_HEADS, PAGE, stored)
    # A token's elements PAGE apart, a dim's consecutive slots adjacent. Triton gives the store's lanes the
    # tokens (axis 0), so a warp writes 32 consecutive slots of one dim.
    tl.store(v_cache_ptr + fp8_v_offset(slot[:, None], head, d[None, :], NUM_KV_HEADS, D, PAGE),
             to_fp8(v / scale[:, None]), mask=stored[:, None])


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, stride_qkv, qkv_split_stride, positions_ptr, cos_sin_ptr, stride_cs, q_ptr, k_ptr,
                         v_ptr, q_weight_ptr, k_weight_ptr, eps, slot_mapping_ptr, k_cache_ptr, v_cache_ptr,
                         k_scale_ptr, v_scale_ptr,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, HEADS: tl.constexpr,
                         QKV_SPLITS: tl.constexpr, HAS_NORM: tl.constexpr, STORE: tl.constexpr, PAGE: tl.constexpr,
                         FP8: tl.constexpr, STAGE_V: tl.constexpr, PDL: tl.constexpr):
    """qkv is loaded through load_split_sum (QKV_SPLITS, qkv_split_stride: skinny_gemm.split_operand); when
    it is a SplitKSum (QKV_SPLITS > 0), the v heads are also written to v_ptr [tokens, NUM_KV_HEADS, D]."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    # HEADS consecutive heads: of the q heads, then the k heads, then (with STORE or QKV_SPLITS) the v heads.
    # HEADS divides NUM_HEADS and NUM_KV_HEADS, so they are all of one kind.
    head = tl.program_id(1) * HEADS
    heads = head + tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
    half = tl.arange(0, D // 2)[None, :]
    is_q = head < NUM_HEADS
    w_ptr = q_weight_ptr  # None without the norm
    if HAS_NORM:
        if not is_q:
            w_ptr = k_weight_ptr
    # The norm weight and cos/sin (positions too: the host's) are loaded before the wait for the qkv projection.
    factors = rope_factors(cos_sin_ptr + tl.load(positions_ptr + token) * stride_cs, w_ptr, HAS_NORM, D)
    if PDL:
        tl.extra.cuda.gdc_wait()
    # The heads lie in this order in a qkv row too, so `heads` indexes all of them.
    src = token * stride_qkv + heads * D + half
    dtype = q_ptr.dtype.element_ty
    x1, x2 = _load_halves(qkv_ptr, src, None, qkv_split_stride, QKV_SPLITS, D, dtype)  # [HEADS, D // 2] each
    if STORE:
        slot = tl.load(slot_mapping_ptr + token)  # -1: write nothing
    if head >= NUM_HEADS + NUM_KV_HEADS:  # v heads: stored unchanged
        v_head = head - NUM_HEADS - NUM_KV_HEADS
        if QKV_SPLITS > 0 and not STAGE_V:
            dst = v_ptr + (token * NUM_KV_HEADS + heads - NUM_HEADS - NUM_KV_HEADS) * D + half
            tl.store(dst, x1)
            tl.store(dst + D // 2, x2)
        if STORE:
            if slot != -1:
                if STAGE_V:
                    _store_heads(x1, x2, v_ptr, v_scale_ptr, slot, v_head, HEADS, NUM_KV_HEADS, D, PAGE, FP8,
                                 IS_V=True, staging_row=token)
                else:
                    _store_heads(x1, x2, v_cache_ptr, v_scale_ptr, slot, v_head, HEADS, NUM_KV_HEADS, D, PAGE,
                                 FP8, IS_V=True)
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
            _store_heads(y1, y2, k_cache_ptr, k_scale_ptr, slot, head - NUM_HEADS, HEADS, NUM_KV_HEADS, D, PAGE,
                         FP8, IS_V=False)


@dataclasses.dataclass(frozen=True, slots=True)
class NormRopeInputs:
    """A decode step's qkv projection and what qk_norm_rope needs to make q, k, v of it, for the decode kernel
    to do that itself (triton_decode.paged_decode_attention's from_qkv): q never goes through memory, and the
    kernel stores each token's new K/V (slot_mapping: int64 [T], -1 nowhere) before it reads the cache."""
    qkv: torch.Tensor | SplitKSum
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_heads: int
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 1e-6


def qk_norm_rope(qkv: torch.Tensor | SplitKSum, positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, q_weight: torch.Tensor | None = None,
                 k_weight: torch.Tensor | None = None, eps: float = 1e-6, slot_mapping: torch.Tensor | None = None,
                 k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 heads_per_program: int | None = None,
                 v_store_tile: int = 0, stage_v: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim], v [T, num_kv_heads, head_dim]) from the
    qkv projection's output [T, (num_heads + 2 * num_kv_heads) * head_dim]: q and k new contiguous tensors,
    each head RMS-normed with q_weight / k_weight (when given; None for RoPE only), then rotated by RoPE at
    `positions` [T]; v a view of qkv's last heads, or, when qkv is a SplitKSum (summed as it is loaded), a
    new tensor.

    With k_cache, v_cache (a layer's paged cache, as Attention.kv_cache_views gives them) it also writes
    each token's k and v (qkv's last num_kv_heads heads, unchanged) to cache slot slot_mapping[token]
    (int64 [T]; -1: nowhere), as Attention's store would: into an fp8 cache quantized, the scales in
    k_scale, v_scale. Without a cache nothing is stored.

    One program per token and heads_per_program heads of one kind (q, k or, when storing or given a
    SplitKSum, v; default: _heads_per_program) reads them once (and the token's cos/sin row) and writes
    the result; no host sync, so it is CUDA-graph capturable.

    v_store_tile (a power of two; 0: off) stores an fp8 cache's V by a kernel of its own, a program per
    tile of that many tokens and kv head: for prefill, whose consecutive tokens have consecutive slots
    (_store_v_fp8_tiles_kernel). Without it each token's V head lands as 128 single bytes PAGE apart.

    stage_v (decode, an fp8 cache): the V scales go to the cache but the quantized V heads do not; v is
    then a new float8 [T, num_kv_heads, head_dim] of them (rows of slot -1 unwritten), for the decode
    kernel to attend to and write into the cache (triton_decode.paged_decode_attention's staged_v).
    """
    num_tokens = qkv.shape[0]
    data, splits, split_stride = split_operand(qkv)
    assert head_dim & (head_dim - 1) == 0, f"head_dim={head_dim} is not a power of two"
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and data.stride(-1) == 1
    assert cos_sin_cache.shape[1] == head_dim and cos_sin_cache.stride(1) == 1
    assert cos_sin_cache.dtype == torch.float32 and positions.shape == (num_tokens,)
    has_norm = q_weight is not None
    assert has_norm == (k_weight is not None)
    if has_norm:
        assert q_weight.dtype == k_weight.dtype == qkv.dtype, "the kernel rounds weight * x to qkv's dtype"
        assert q_weight.is_contiguous() and k_weight.is_contiguous()
    store, fp8 = k_cache is not None, False
    if store:
        fp8 = check_kv_cache(k_cache, v_cache, k_scale, v_scale, num_kv_heads, head_dim)
        assert fp8 or k_cache.dtype == qkv.dtype, "a cache of another dtype than the model's is fp8"
        assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=data.device)
    k = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=data.device)
    stage_v = stage_v and fp8
    if stage_v:
        v = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=k_cache.dtype, device=data.device)
    elif splits:
        v = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=data.device)
    else:
        v = qkv[:, -num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    heads = heads_per_program or _heads_per_program(num_tokens, num_heads, num_kv_heads)
    assert num_heads % heads == 0 and num_kv_heads % heads == 0 and heads & (heads - 1) == 0
    v_tiles = store and fp8 and v_store_tile > 0 and not splits
    v_programs = splits or (store and not v_tiles)
    grid = (num_tokens, (num_heads + num_kv_heads + (num_kv_heads if v_programs else 0)) // heads)
    pdl = pdl_enabled(data.device)
    _qk_norm_rope_kernel[grid](
        data, data.stride(-2), split_stride, positions, cos_sin_cache, cos_sin_cache.stride(0), q, k, v, q_weight,
        k_weight, eps, slot_mapping, k_cache, v_cache, k_scale, v_scale,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, D=head_dim, HEADS=heads, QKV_SPLITS=splits,
        HAS_NORM=has_norm, STORE=store, PAGE=k_cache.size(1) if store else 1, FP8=fp8, STAGE_V=stage_v, PDL=pdl,
        launch_pdl=pdl,
        # One warp per program: the sums of squares need no cross-warp step.
        num_warps=1,
        # No FMA contraction: x1 * cos - x2 * sin rounds each product as torch does.
        enable_fp_fusion=False)
    if v_tiles:
        assert v_store_tile & (v_store_tile - 1) == 0, f"v_store_tile={v_store_tile} is not a power of two"
        _store_v_fp8_tiles_kernel[(triton.cdiv(num_tokens, v_store_tile), num_kv_heads)](
            data, data.stride(-2), slot_mapping, v_cache, v_scale, num_tokens, NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads, D=head_dim, PAGE=k_cache.size(1), TILE=v_store_tile, PDL=pdl, launch_pdl=pdl,
            num_warps=4)
    return q, k, v


# From this many tokens a program takes several heads (_heads_per_program).
MANY_TOKENS = 64
# Tokens per program of a prefill's fp8 V store (qk_norm_rope's v_store_tile).
V_STORE_TILE = 64


def _heads_per_program(num_tokens: int, num_heads: int, num_kv_heads: int) -> int:
    """One head per program for a few tokens, where latency rules; from MANY_TOKENS on, the largest power of
    two up to 8 dividing both head counts: fewer programs, each with more work."""
    if num_tokens < MANY_TOKENS:
        return 1
    heads = 8
    while num_heads % heads or num_kv_heads % heads:
        heads //= 2
    return heads
