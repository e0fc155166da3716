"""Triton paged attention: the cache layouts, the fp8 scheme, and what the kernels share.

Paged KV cache: k_cache, v_cache are [num_blocks, block_size, num_kv_heads, head_dim] (head_dim
contiguous). Token t of sequence b lives in block block_tables[b, t // block_size], slot
t % block_size. The softmax runs in the log2 domain (exp2, with scale * log2(e) folded into the
logits) and accumulates in float32.

fp8 KV cache: k_cache, v_cache are float8_e4m3fn, v_cache laid out [num_blocks, num_kv_heads, head_dim,
block_size] (tokens contiguous, kv_cache.py says why; the kernels take V's strides apart from K's), and
k_scale, v_scale [num_blocks, num_kv_heads, block_size] float32 hold each token's per-head scale
(cached value = x / scale, see kv_cache.quantize_fp8), so the scales a tile needs for one kv head are
contiguous. The scales are applied where they cost least: key j's logits are multiplied by k_scale[j]
(q . (s k) = s (q . k)) and the probabilities by v_scale[j] before the PV product, so the fp8 tiles
only need converting. They are converted to float16, not bfloat16: e4m3 -> f16 is one instruction per
pair on sm_89+, e4m3 -> bf16 several, and fp16 holds every e4m3 value exactly. A bf16 q is converted
to fp16 too (exact in fp16's range: |q| < 65504, which normed queries are far below); prefill's
64-row tiles round q to fp8 instead (triton_prefill.py). A constexpr FP8 flag leaves the 16-bit path
untouched.

The decode kernel is in triton_decode.py, the prefill kernels in triton_prefill.py; this module holds
what they share: the tile loads (load_kv), the online-softmax step (softmax_step) and the argument checks.
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.kv_cache import FP8_MAX, FP8_MIN_AMAX, v_token_major

LOG2E = 1.4426950408889634
# Finite "minus infinity" for the running max: exp2(m_old - m_new) stays NaN-free for rows that
# have seen no key yet (padding rows, empty splits). A constexpr: kernels may read no other globals.
NEG_INF = tl.constexpr(-1.0e30)
# Tokens of one 16-byte load of an fp8 V (tokens contiguous): its loads are masked by runs of this many.
FP8_V_RUN = tl.constexpr(16)


@triton.jit
def tile_blocks(block_table_ptr, start, tok, mask, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cache blocks (int64) of tokens `tok` (mask: which to look up; None: all) of the tile of BLOCK_N
    tokens from `start`, which is BLOCK_N-aligned: with BLOCK_N <= PAGE the tile lies in one page, whose
    one block id serves every token; else each token's."""
    if BLOCK_N <= PAGE:
        blk = tl.load(block_table_ptr + start // PAGE)
    elif mask is None:
        blk = tl.load(block_table_ptr + tok // PAGE)
    else:
        blk = tl.load(block_table_ptr + tok // PAGE, mask=mask, other=0)
    return blk.to(tl.int64)


@triton.jit
def load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, start, limit, kv_head,
             stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, stride_sb, stride_sh,
             D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, PAGED: tl.constexpr):
    """K and V tiles [BLOCK_N, D] of tokens start..start+BLOCK_N of one kv head, and their scales
    [BLOCK_N] (with FP8, 0 for tokens >= limit; else ones, which softmax_step does not read).
    K's head_dim is contiguous; V's strides are its own (an fp8 V has contiguous tokens, stride_vt 1).
    Not PAGED: k_ptr, v_ptr point at the sequence's first token of plain [tokens, KVH, D] K/V (the block
    strides and table are not read).

    Tokens >= limit read 0, but in an fp8 V: its loads are masked by runs of FP8_V_RUN tokens, as a mask
    that varied along V's contiguous token axis would split them into single bytes. The tokens past limit
    in the last run read whatever their slot holds, from their page or block 0, never out of bounds: a
    finite value (an fp8 cache holds no NaN, kv_cache.py), which their masked logit and zero scale take
    out of the result."""
    tok = start + tl.arange(0, BLOCK_N)
    mask = tok < limit
    if not PAGED:
        blk = 0
        offset = tok
    else:
        blk = tile_blocks(block_table_ptr, start, tok, mask, PAGE, BLOCK_N)
        if BLOCK_N <= PAGE:
            # Spelled as an aligned base + arange so the compiler sees the scale loads are contiguous.
            offset = tl.multiple_of(start % PAGE, BLOCK_N) + tl.arange(0, BLOCK_N)
        else:
            offset = tok % PAGE
    d = tl.arange(0, D)[None, :]
    k_rows = blk * stride_kb + offset * stride_kt + kv_head * stride_kh  # [BLOCK_N] int64
    v_rows = blk * stride_vb + offset * stride_vt + kv_head * stride_vh
    # The masks are constant along the contiguous axis (head_dim; an fp8 V's run of tokens): they cost nothing.
    k = tl.load(k_ptr + k_rows[:, None] + d, mask=mask[:, None], other=0.0)
    v_mask = mask
    if FP8:
        v_mask = (tok // FP8_V_RUN) * FP8_V_RUN < limit
    v = tl.load(v_ptr + v_rows[:, None] + d * stride_vd, mask=v_mask[:, None], other=0.0)
    if FP8:  # scales [num_blocks, KVH, PAGE]
        scale_offs = blk * stride_sb + kv_head * stride_sh + offset
        k_scale = tl.load(k_scale_ptr + scale_offs, mask=mask, other=0.0)
        v_scale = tl.load(v_scale_ptr + scale_offs, mask=mask, other=0.0)
    else:  # Triton 3.6 cannot return None in a tuple; unused, so compiled away
        k_scale = tl.full([BLOCK_N], 1.0, tl.float32)
        v_scale = k_scale
    return k, v, k_scale, v_scale


@triton.jit
def v_scaled_weights(p, v_scale, KEYS_AXIS: tl.constexpr, FP8_COMPUTE: tl.constexpr):
    """The softmax weights p (keys along KEYS_AXIS) of an fp8 V tile with scales v_scale [keys], as the
    P V product takes them: (p_j s_j / s_max in FP8_COMPUTE, s_max), since sum_j p_j (s_j v_j) =
    s_max sum_j (p_j s_j / s_max) v_j. Dividing by the tile's largest scale keeps the fp16 weights in
    [0, 1] (tiny scales would otherwise underflow fp16). s_max > 0: every tile holds a token of the
    context."""
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
    """One online-softmax update of (m_i [M], l_i [M], acc [M, D], acc_unit) with a key/value tile.

    q: [M, D], k, v: [N, D], mask: [M, N] (True = attend) or None; it must exclude keys past the
    context (with FP8 their K/V are stale values, load_kv). m_i is in scaled log2 units. The output
    sum is acc * acc_unit (a scalar, 1 but with an fp8 q).

    With FP8, k and v are fp8 with scales k_scale, v_scale [N] (0 past the context), and q either
    - in FP8_COMPUTE (q_scale None: prefill's tiles of fewer than 64 rows; decode transposes this step,
      triton_decode._keys_major_step): k and v are converted to it; or
    - fp8 itself with row scales q_scale [M] (quantize_rows: prefill). q k^T is then an fp8 MMA of
      the tiles as loaded; only v is converted.
    """
    if FP8 and q_scale is None:
        k = k.to(FP8_COMPUTE)
    if FP8:  # converted here: in the dot below, Triton allotted more registers (decode: 168, not 128)
        v = v.to(FP8_COMPUTE)
    if q_scale is None:
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    else:  # fp8 operands; q's row scales are folded into the softmax scale below
        qk = tl.dot(q, tl.trans(k))
    if FP8:
        qk = qk * k_scale[None, :]
    if mask is not None:
        qk = tl.where(mask, qk, float("-inf"))
    if q_scale is None:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * sm_scale_log2)
        p = tl.exp2(qk * sm_scale_log2 - m_new[:, None])  # one FMA per logit
    else:
        row_scale = q_scale * sm_scale_log2  # > 0, so max(qk * row_scale) = max(qk) * row_scale
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
        else:  # acc in units of s_max, so that the MMA accumulates in place: a separate product takes
            # [M, D] more registers, which the 64 x 128 prefill tile spilled (decode's mma.sync kept it
            # apart in 128 registers, in place in 140: 3 programs an SM instead of 4)
            acc = tl.dot(p, v, acc * (alpha * (acc_unit / v_max))[:, None], input_precision=DOT_PRECISION)
            acc_unit = v_max
    return m_new, l_i, acc, acc_unit


@triton.jit
def quantize_rows(x):
    """x [M, D] -> (x / s as float8_e4m3fn, s [M] float32), s = amax(|x|) / 448 per row, as
    kv_cache.quantize_fp8 scales a head (the divisions rounded as torch's, so the tests can round q
    exactly as the kernel does)."""
    x = x.to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), FP8_MIN_AMAX), FP8_MAX)
    return tl.math.div_rn(x, scale[:, None]).to(tl.float8e4nv), scale


def check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, out) -> str:
    """Validate layouts; return the tl.dot input precision for q's dtype."""
    v = v_token_major(v_cache)  # fp8: tokens contiguous (stride 1), else head_dim
    assert k_cache.shape == v.shape and v.stride(1 if k_cache.dtype == torch.float8_e4m3fn else -1) == 1
    assert (k_cache.dtype == torch.float8_e4m3fn) == (k_scale is not None), "an fp8 cache comes with its scales"
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
    """tl.dot's input precision: exact fp32 dots for float32 inputs (tests); 16-bit inputs ignore it."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def fp8_compute_dtype(q: torch.Tensor):
    """What the fp8 tiles (and q) are converted to: float16 for a 16-bit q, float32 for a float32 q (tests)."""
    return tl.float32 if q.dtype == torch.float32 else tl.float16


def scale_ptrs(k_cache, v_cache, k_scale, v_scale) -> tuple:
    """The k_scale, v_scale kernel arguments; without fp8, unused placeholders."""
    return (k_cache, v_cache) if k_scale is None else (k_scale, v_scale)


def paged_strides(k_cache, v_cache, k_scale, block_tables) -> tuple[int, ...]:
    """The 10 stride arguments of a paged cache (load_kv): K's block, token, head; V's block, token, head,
    dim (v_token_major); the [num_blocks, KVH, block_size] scales' block, head (0 without fp8); the block
    table's row."""
    scale_strides = (0, 0) if k_scale is None else k_scale.stride()[:2]
    return (*k_cache.stride()[:3], *v_token_major(v_cache).stride(), *scale_strides, block_tables.stride(0))
