"""What the Triton paged attention kernels share (cache layouts: kv_cache.py). An fp8 key j's
logits are scaled by k_scale[j], its weights by v_scale[j], its tiles converted to fp16 (exact)."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.kv_cache import FP8_MAX, FP8_MIN_AMAX, v_token_major

LOG2E = 1.4426950408889634
# Finite "minus infinity": exp2(m_old - m_new) stays NaN-free in rows that have seen no key yet.
NEG_INF = tl.constexpr(-1.0e30)
FP8_V_RUN = tl.constexpr(16)


@triton.jit
def tile_blocks(block_table_ptr, start, tok, mask, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The int64 cache blocks of tokens `tok` (mask: None = all) of the aligned tile at `start`."""
    if BLOCK_N <= PAGE:
        blk = tl.load(block_table_ptr + start // PAGE)
    elif mask is None:
        blk = tl.load(block_table_ptr + tok // PAGE)
    else:
        blk = tl.load(block_table_ptr + tok // PAGE, mask=mask, other=0)
    return blk.to(tl.int64)


@triton.jit
def load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, start, limit, kv_head,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
            stride_sb, stride_sh, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
            FP8: tl.constexpr, PAGED: tl.constexpr):
    """K, V tiles [BLOCK_N, D] of tokens start.. of one kv head and their scales [BLOCK_N] (0 from
    limit on; ones without FP8). Not PAGED: k_ptr, v_ptr point at plain [tokens, KVH, D] K/V."""
    tok = start + tl.arange(0, BLOCK_N)
    mask = tok < limit
    if not PAGED:
        blk = 0
        offset = tok
    else:
        blk = tile_blocks(block_table_ptr, start, tok, mask, PAGE, BLOCK_N)
        if BLOCK_N <= PAGE:
            offset = tl.multiple_of(start % PAGE, BLOCK_N) + tl.arange(0, BLOCK_N)
        else:
            offset = tok % PAGE
    d = tl.arange(0, D)[None, :]
    k_rows = blk * stride_kb + offset * stride_kt + kv_head * stride_kh
    v_rows = blk * stride_vb + offset * stride_vt + kv_head * stride_vh
    k = tl.load(k_ptr + k_rows[:, None] + d, mask=mask[:, None], other=0.0)
    v_mask = mask
    if FP8:  # by 16-byte runs: the stale slots past limit are finite (kv_cache.py), weigh 0
        v_mask = (tok // FP8_V_RUN) * FP8_V_RUN < limit
    v = tl.load(v_ptr + v_rows[:, None] + d * stride_vd, mask=v_mask[:, None], other=0.0)
    if FP8:
        scale_offs = blk * stride_sb + kv_head * stride_sh + offset
        k_scale = tl.load(k_scale_ptr + scale_offs, mask=mask, other=0.0)
        v_scale = tl.load(v_scale_ptr + scale_offs, mask=mask, other=0.0)
    else:  # a returned tuple cannot hold None; unused, so compiled away
        k_scale = tl.full([BLOCK_N], 1.0, tl.float32)
        v_scale = k_scale
    return k, v, k_scale, v_scale


@triton.jit
def v_scaled_weights(p, v_scale, KEYS_AXIS: tl.constexpr, FP8_COMPUTE: tl.constexpr):
    """(p_j s_j / s_max, s_max) for V scales s: weights in [0, 1], so fp16 cannot underflow."""
    v_max = tl.max(v_scale, 0)
    ratio = v_scale / v_max
    if KEYS_AXIS == 0:
        p = p * ratio[:, None]
    else:
        p = p * ratio[None, :]
    return p.to(FP8_COMPUTE), v_max


@triton.jit
def softmax_step(q, q_scale, k, v, k_scale, v_scale, m_i, l_i, acc, acc_unit, mask, sm_scale_log2,
                 DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, FP8_COMPUTE: tl.constexpr):
    """One online-softmax update of (m_i [M], l_i [M], acc [M, D], acc_unit) by k, v [N, D], mask
    [M, N] or None; output acc * acc_unit. fp8 q: row scales q_scale [M], else q_scale None."""
    if FP8 and q_scale is None:
        k = k.to(FP8_COMPUTE)
    if FP8:
        v = v.to(FP8_COMPUTE)
    if q_scale is None:
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    else:
        qk = tl.dot(q, tl.trans(k))
    if FP8:
        qk = qk * k_scale[None, :]
    if mask is not None:
        qk = tl.where(mask, qk, float("-inf"))
    if q_scale is None:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * sm_scale_log2)
        p = tl.exp2(qk * sm_scale_log2 - m_new[:, None])
    else:
        row_scale = q_scale * sm_scale_log2
        m_new = tl.maximum(m_i, tl.max(qk, 1) * row_scale)
        p = tl.exp2(qk * row_scale[:, None] - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if not FP8:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        p, v_max = v_scaled_weights(p, v_scale, 1, FP8_COMPUTE)
        if q_scale is None:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION) * v_max
        else:  # acc in units of s_max, so that the MMA accumulates in place (fewer registers)
            acc = tl.dot(p, v, acc * (alpha * (acc_unit / v_max))[:, None],
                         input_precision=DOT_PRECISION)
            acc_unit = v_max
    return m_new, l_i, acc, acc_unit


@triton.jit
def quantize_rows(x):
    """x [M, D] -> (x / s in fp8, s [M]): a scale per row, as kv_cache.quantize_fp8's."""
    x = x.to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), FP8_MIN_AMAX), FP8_MAX)
    return tl.math.div_rn(x, scale[:, None]).to(tl.float8e4nv), scale


def check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, out) -> str:
    """Validate layouts; return the tl.dot input precision for q's dtype."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    v = v_token_major(v_cache)
    assert k_cache.shape == v.shape and v.stride(1 if fp8 else -1) == 1
    assert fp8 == (k_scale is not None), "an fp8 cache comes with its scales"
    if k_scale is not None:
        num_blocks, block_size, kvh, _ = k_cache.shape
        assert k_scale.dtype == v_scale.dtype == torch.float32
        assert k_scale.shape == v_scale.shape == (num_blocks, kvh, block_size)
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1 and block_tables.stride(-1) == 1
    assert q.shape[-2] % k_cache.shape[2] == 0 and q.shape[-1] == k_cache.shape[3]
    block_size = k_cache.shape[1]
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert out is None or (out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1)
    return dot_precision(q)


def dot_precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"


def fp8_compute_dtype(q: torch.Tensor):
    return tl.float32 if q.dtype == torch.float32 else tl.float16


def scale_ptrs(k_cache, v_cache, k_scale, v_scale) -> tuple:
    return (k_cache, v_cache) if k_scale is None else (k_scale, v_scale)


def paged_strides(k_cache, v_cache, k_scale, block_tables) -> tuple[int, ...]:
    """The 10 stride arguments of a paged cache, as load_kv takes them."""
    scale_strides = (0, 0) if k_scale is None else k_scale.stride()[:2]
    v_strides = v_token_major(v_cache).stride()
    return (*k_cache.stride()[:3], *v_strides, *scale_strides, block_tables.stride(0))
