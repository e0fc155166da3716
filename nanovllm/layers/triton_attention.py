"""Triton paged attention: decode (split-K, GQA-grouped) and varlen causal prefill.

Paged KV cache: k_cache, v_cache are [num_blocks, block_size, num_kv_heads, head_dim] (head_dim
contiguous). Token t of sequence b lives in block block_tables[b, t // block_size], slot
t % block_size. The softmax runs in the log2 domain (exp2, with scale * log2(e) folded into the
logits) and accumulates in float32.

fp8 KV cache: k_cache, v_cache are float8_e4m3fn, v_cache laid out [num_blocks, num_kv_heads, head_dim,
block_size] (tokens contiguous, attention.py says why; the kernels take V's strides apart from K's), and
k_scale, v_scale [num_blocks, num_kv_heads, block_size] float32 hold each token's per-head scale
(cached value = x / scale, see attention.quantize_fp8), so the scales a tile needs for one kv head are
contiguous. The scales are applied where they cost least: key j's logits are multiplied by k_scale[j]
(q . (s k) = s (q . k)) and the probabilities by v_scale[j] before the PV product, so the fp8 tiles
only need converting. They are converted to float16, not bfloat16: e4m3 -> f16 is one instruction per
pair on sm_89+, e4m3 -> bf16 several, and fp16 holds every e4m3 value exactly. A bf16 q is converted
to fp16 too (exact in fp16's range: |q| < 65504, which normed queries are far below). A constexpr FP8
flag leaves the 16-bit path untouched.

Prefill tiles of 64 query rows and more (wgmma) over an fp8 cache instead round q to e4m3, with a scale
per token and head as the cache has for K (_quantize_rows), and multiply q k^T in fp8 on the tiles as
loaded: only V is converted. With 128-key tiles and the output accumulated in place (_softmax_step),
a 64-query chunk over 960 cached tokens went from 120 to 81 us on the H200, 1.14x flash-attn's time
on the bf16 cache (BENCHMARKS.md, twelfth session). The price is q's rounding, of the order of K's, and
the fp8 MMA's sums, which keep fewer bits than float32: for N(0, 1) q, K, V the output moves by up to
0.036 (tests/test_triton_attention.py), and on Qwen3-0.6B shapes the error against flash-attn on the
bf16 cache went from 2.4e-2 to 3.1e-2 in that chunk. Smaller tiles use mma.sync, which would convert
fp8 operands to fp16 anyway: they keep q in fp16. Decode keeps it too (its tiles are 16 rows).
"""

import torch
import triton
import triton.language as tl

from nanovllm.layers.attention import FP8_MAX, FP8_MIN_AMAX, v_token_major
from nanovllm.utils.device import num_sms, pdl_enabled

LOG2E = 1.4426950408889634
# Finite "minus infinity" for the running max: exp2(m_old - m_new) stays NaN-free for rows that
# have seen no key yet (padding rows, empty splits). A constexpr: kernels may read no other globals.
NEG_INF = tl.constexpr(-1.0e30)
# Tokens of one 16-byte load of an fp8 V (tokens contiguous): its loads are masked by runs of this many.
FP8_V_RUN = tl.constexpr(16)


@triton.jit
def _load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, start, limit, kv_head,
             stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, stride_sb, stride_sh,
             D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, PAGED: tl.constexpr):
    """K and V tiles [BLOCK_N, D] of tokens start..start+BLOCK_N of one kv head, and their scales
    [BLOCK_N] (with FP8, 0 for tokens >= limit; else ones, which _softmax_step does not read).
    K's head_dim is contiguous; V's strides are its own (an fp8 V has contiguous tokens, stride_vt 1).
    Not PAGED: k_ptr, v_ptr point at the sequence's first token of plain [tokens, KVH, D] K/V (the block
    strides and table are not read).

    Tokens >= limit read 0, but in an fp8 V: its loads are masked by runs of FP8_V_RUN tokens, as a mask
    that varied along V's contiguous token axis would split them into single bytes. The tokens past limit
    in the last run read whatever their slot holds, from their page or block 0, never out of bounds: a
    finite value (an fp8 cache holds no NaN, attention.py), which their masked logit and zero scale take
    out of the result."""
    tok = start + tl.arange(0, BLOCK_N)
    mask = tok < limit
    if not PAGED:
        blk = 0
        offset = tok
    elif BLOCK_N <= PAGE:  # start is BLOCK_N-aligned, so the tile lies in one page: one block id
        blk = tl.load(block_table_ptr + start // PAGE).to(tl.int64)
        # Spelled as an aligned base + arange so the compiler sees the scale loads are contiguous.
        offset = tl.multiple_of(start % PAGE, BLOCK_N) + tl.arange(0, BLOCK_N)
    else:  # a block id per token
        blk = tl.load(block_table_ptr + tok // PAGE, mask=mask, other=0).to(tl.int64)
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
def _softmax_step(q, q_scale, k, v, k_scale, v_scale, m_i, l_i, acc, acc_unit, mask, sm_scale_log2,
                  DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, FP8_COMPUTE: tl.constexpr):
    """One online-softmax update of (m_i [M], l_i [M], acc [M, D], acc_unit) with a key/value tile.

    q: [M, D], k, v: [N, D], mask: [M, N] (True = attend) or None; it must exclude keys past the
    context (with FP8 their K/V are stale values, _load_kv). m_i is in scaled log2 units. The output
    sum is acc * acc_unit (a scalar, 1 but with an fp8 q).

    With FP8, k and v are fp8 with scales k_scale, v_scale [N] (0 past the context), and q either
    - in FP8_COMPUTE (q_scale None: decode): k and v are converted to it; or
    - fp8 itself with row scales q_scale [M] (_quantize_rows: prefill). q k^T is then an fp8 MMA of
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
        # sum_j p_j (s_j v_j) = s_max sum_j (p_j s_j / s_max) v_j: dividing by the tile's largest scale
        # keeps the fp16 weights in [0, 1] (tiny scales would otherwise underflow fp16). s_max > 0:
        # every tile holds a token of the context.
        v_max = tl.max(v_scale, 0)
        p = (p * (v_scale / v_max)[None, :]).to(FP8_COMPUTE)
        if q_scale is None:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION) * v_max
        else:  # acc in units of s_max, so that the MMA accumulates in place: a separate product takes
            # [M, D] more registers, which the 64 x 128 prefill tile spilled (decode's mma.sync kept it
            # apart in 128 registers, in place in 140: 3 programs an SM instead of 4)
            acc = tl.dot(p, v, acc * (alpha * (acc_unit / v_max))[:, None], input_precision=DOT_PRECISION)
            acc_unit = v_max
    return m_new, l_i, acc, acc_unit


@triton.jit
def _quantize_rows(x):
    """x [M, D] -> (x / s as float8_e4m3fn, s [M] float32), s = amax(|x|) / 448 per row, as
    attention.quantize_fp8 scales a head (the divisions rounded as torch's, so the tests can round q
    exactly as the kernel does)."""
    x = x.to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), FP8_MIN_AMAX), FP8_MAX)
    return tl.math.div_rn(x, scale[:, None]).to(tl.float8e4nv), scale


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, context_lens_ptr, order_ptr, out_ptr, acc_ptr,
    m_ptr, l_ptr, sm_scale_log2, stride_qb, stride_qh, stride_ob, stride_oh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_vd, stride_sb, stride_sh, stride_bt,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, FP8_COMPUTE: tl.constexpr,
    ORDERED: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (KVH, B, NUM_SPLITS): the G query heads of kv head program_id(0) over one split of the context,
    of sequence order[program_id(1)] if ORDERED, else program_id(1). The kv head varies fastest, so the
    GPU takes up a sequence's kv heads together and reads each block's K and V (a token's K heads are
    contiguous) within a short time, not in eight passes over the batch: 2-6% faster than a (B, KVH)
    grid from batch 128, likely by DRAM locality (H200, BENCHMARKS.md, twelfth session, call 5)."""
    if PDL:  # launched while the KV store runs; read nothing before it has finished
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    if ORDERED:
        seq = tl.load(order_ptr + seq)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N  # whole tiles per split
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = kv_head * G + g  # [G_PAD]
    head_mask = (g < G)[:, None]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=head_mask, other=0.0)  # [G_PAD, D]
    if FP8:
        q = q.to(FP8_COMPUTE)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([G_PAD], NEG_INF, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    acc_unit = 1.0
    # One pipelined loop, the last (partial) tile included: run apart, unpipelined, an fp8 partial tile
    # made the kernel 1.2x slower over ragged contexts (BENCHMARKS.md, eighth session).
    for s in range(start, end, BLOCK_N):
        k, v, k_scale, v_scale = _load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table, s, end, kv_head,
                                          stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                                          stride_sb, stride_sh, D, PAGE, BLOCK_N, FP8, True)
        kv_mask = (s + tl.arange(0, BLOCK_N) < end)[None, :]
        m_i, l_i, acc, acc_unit = _softmax_step(q, None, k, v, k_scale, v_scale, m_i, l_i, acc, acc_unit, kv_mask,
                                                sm_scale_log2, DOT_PRECISION, FP8, FP8_COMPUTE)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # context_len 0 -> zeros
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_mask)
    else:  # partials: m, l [B, H, NUM_SPLITS], acc [B, H, NUM_SPLITS, D], float32, contiguous
        row = (seq * tl.num_programs(0) * G + heads) * NUM_SPLITS + split  # [G_PAD]
        tl.store(m_ptr + row, m_i, mask=g < G)
        tl.store(l_ptr + row, l_i, mask=g < G)
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=head_mask)


@triton.jit
def _decode_reduce_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, stride_ob, stride_oh,
                          D: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr):
    """Grid (B, H): merge the NUM_SPLITS partial softmaxes of one (sequence, head)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    row = (seq * tl.num_programs(1) + head) * NUM_SPLITS + s  # [NUM_SPLITS]
    m = tl.load(m_ptr + row)
    w = tl.exp2(m - tl.max(m, 0))  # [NUM_SPLITS]
    denom = tl.sum(w * tl.load(l_ptr + row), 0)
    acc = tl.load(acc_ptr + row[:, None] * D + tl.arange(0, D)[None, :])  # [NUM_SPLITS, D]
    out = tl.sum(w[:, None] * acc, 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + tl.arange(0, D), out.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, out_ptr,
    first_seq, sm_scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_vd, stride_sb, stride_sh, stride_bt,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, FP8_COMPUTE: tl.constexpr, PAGED: tl.constexpr,
):
    """Grid (query tiles, H, sequences): BLOCK_M queries of one head of sequence first_seq + program_id(2),
    causal. Not PAGED: context_lens_ptr holds cu_seqlens_k, and the keys of sequence b are rows
    cu_seqlens_k[b] - cu_seqlens_k[first_seq] onwards of plain K/V (varlen_prefill_attention)."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = first_seq + tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    n_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= n_q:
        return
    if PAGED:
        ctx = tl.load(context_lens_ptr + seq)
    else:
        k_start = tl.load(context_lens_ptr + seq)
        ctx = tl.load(context_lens_ptr + seq + 1) - k_start
        k_start = (k_start - tl.load(context_lens_ptr + first_seq)).to(tl.int64)
        k_ptr += k_start * stride_kt
        v_ptr += k_start * stride_vt
    kv_head = head // G

    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
    pos = ctx - n_q + i  # absolute position = last key it may attend to
    d = tl.arange(0, D)
    tok_offs = (q_start + i).to(tl.int64)[:, None]
    q = tl.load(q_ptr + tok_offs * stride_qt + head * stride_qh + d[None, :],
                mask=(i < n_q)[:, None], other=0.0)  # [BLOCK_M, D]
    q_scale = None
    if FP8 and BLOCK_M >= 64:  # wgmma tiles: q k^T in fp8 (module docstring)
        q, q_scale = _quantize_rows(q)
    elif FP8:  # Triton's mma.sync would convert fp8 operands to fp16 anyway
        q = q.to(FP8_COMPUTE)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    acc_unit = 1.0
    # Keys < full_end are visible to every row of the tile; [full_end, kv_end) needs the causal mask.
    first = ctx - n_q + tile * BLOCK_M
    full_end = (first + 1) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(first + BLOCK_M, ctx)
    for s in range(0, full_end, BLOCK_N):
        k, v, k_scale, v_scale = _load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table, s, ctx, kv_head,
                                          stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                                          stride_sb, stride_sh, D, PAGE, BLOCK_N, FP8, PAGED)
        m_i, l_i, acc, acc_unit = _softmax_step(q, q_scale, k, v, k_scale, v_scale, m_i, l_i, acc, acc_unit, None,
                                                sm_scale_log2, DOT_PRECISION, FP8, FP8_COMPUTE)
    for s in range(full_end, kv_end, BLOCK_N):
        k, v, k_scale, v_scale = _load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table, s, ctx, kv_head,
                                          stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                                          stride_sb, stride_sh, D, PAGE, BLOCK_N, FP8, PAGED)
        # Keys past the context lie past every query's position (rows past n_q are not stored).
        causal = (s + tl.arange(0, BLOCK_N))[None, :] <= pos[:, None]
        m_i, l_i, acc, acc_unit = _softmax_step(q, q_scale, k, v, k_scale, v_scale, m_i, l_i, acc, acc_unit, causal,
                                                sm_scale_log2, DOT_PRECISION, FP8, FP8_COMPUTE)

    out = acc * (acc_unit / l_i)[:, None]
    tl.store(out_ptr + tok_offs * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(i < n_q)[:, None])


def _check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, out) -> str:
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
    return _dot_precision(q)


def _dot_precision(q: torch.Tensor) -> str:
    """tl.dot's input precision: exact fp32 dots for float32 inputs (tests); 16-bit inputs ignore it."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _fp8_compute_dtype(q: torch.Tensor):
    """What the fp8 tiles (and q) are converted to: float16 for a 16-bit q, float32 for a float32 q (tests)."""
    return tl.float32 if q.dtype == torch.float32 else tl.float16


def _scale_ptrs(k_cache, v_cache, k_scale, v_scale) -> tuple:
    """The k_scale, v_scale kernel arguments; without fp8, unused placeholders."""
    return (k_cache, v_cache) if k_scale is None else (k_scale, v_scale)


def _paged_strides(k_cache, v_cache, k_scale, block_tables) -> tuple[int, ...]:
    """The 10 stride arguments of a paged cache (_load_kv): K's block, token, head; V's block, token, head,
    dim (v_token_major); the [num_blocks, KVH, block_size] scales' block, head (0 without fp8); the block
    table's row."""
    scale_strides = (0, 0) if k_scale is None else k_scale.stride()[:2]
    return (*k_cache.stride()[:3], *v_token_major(v_cache).stride(), *scale_strides, block_tables.stride(0))


def _decode_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Power-of-two split count: up to ~4 programs per SM, keeping >= 128 keys per split."""
    splits, target = 1, 4 * num_sms(device)
    while batch * num_kv_heads * splits * 2 <= target and splits * 256 <= max_context and splits < 64:
        splits *= 2
    return splits


def _decode_tile(head_dim: int, fp8: bool) -> tuple[int, int, int]:
    """Default (block_n, num_warps, num_stages) of the decode kernel.

    fp8: H200 sweeps of 2026-11-30 (H=16, KVH=8, D=128, 256-token pages), 128/4/2 was the best tile at
    every large shape, before and after V went token-contiguous: B=256 ctx=1024 3.05 TB/s (72% of copy
    bandwidth; 128/4/3 and 128/4/4 the same), B=32 ctx=2048 2.38 at 2 splits, B=8 ctx=4096 1.71 at 8
    splits. The bf16 cache keeps 64/4/3.
    """
    if fp8:  # a tile may span pages (then each token looks up its block id)
        return 128, 4, 2
    return min(64, max(16, 8192 // head_dim)), 4, 3


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, *, k_scale=None, v_scale=None,
                           order=None, out=None, num_splits=None, block_n=None, num_warps=None, num_stages=None):
    """Single-token attention of each sequence over its paged KV cache.

    q: [B, H, D], the query at position context_lens[b] - 1 (its K/V already in the cache).
    k_cache, v_cache: [num_blocks, block_size, KVH, D] (an fp8 v_cache [num_blocks, KVH, D, block_size]);
    block_tables: int32 [B, max_blocks]; context_lens: int32 [B] (0 = padding row: output zeros, no KV
    read). Returns [B, H, D] in q.dtype.
    k_scale, v_scale: [num_blocks, KVH, block_size] float32, given iff the cache is float8_e4m3fn.
    order: optional int32 [B], a permutation of the rows: the order in which the GPU takes them up. Longest
    context first (AttentionMetadata.decode_order), a ragged batch does not end on a few long rows.
    out: optional [B, H, D] destination. num_splits (a power of two), block_n, num_warps and
    num_stages override the launch heuristics (_decode_num_splits, _decode_tile).
    """
    B, H, D = q.shape
    _, page, kvh, _ = k_cache.shape
    precision = _check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, out)
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    G = H // kvh
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    default_n, default_warps, default_stages = _decode_tile(D, fp8)
    block_n, num_warps, num_stages = block_n or default_n, num_warps or default_warps, num_stages or default_stages
    if num_splits is None:
        num_splits = _decode_num_splits(B, kvh, block_tables.shape[1] * page, q.device)
    assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    if num_splits > 1:  # per-split running max, sum and unnormalized output
        part_max = torch.empty(B, H, num_splits, device=q.device, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(B, H, num_splits, D, device=q.device, dtype=torch.float32)
    else:
        part_max = part_sum = part_acc = out  # unused
    strides = _paged_strides(k_cache, v_cache, k_scale, block_tables)
    pdl = pdl_enabled(q.device)
    _decode_kernel[(kvh, B, num_splits)](
        q, k_cache, v_cache, *_scale_ptrs(k_cache, v_cache, k_scale, v_scale), block_tables, context_lens,
        context_lens if order is None else order, out, part_acc, part_max, part_sum, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *strides,
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, PAGE=page, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, DOT_PRECISION=precision, FP8=fp8, FP8_COMPUTE=_fp8_compute_dtype(q),
        ORDERED=order is not None, PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(B, H)](part_acc, part_max, part_sum, out, out.stride(0), out.stride(1),
                                      D=D, NUM_SPLITS=num_splits, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q,
                            scale, *, k_scale=None, v_scale=None, out=None, **config):
    """Causal attention of a varlen batch of query chunks over their paged KV cache.

    q: [T, H, D]; sequence b's queries are q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] (int32 [B+1]) and sit at
    the last n_q_b positions of its context_lens[b] (int32 [B]) keys, all already in the cache; query i
    attends to keys at positions <= context_lens[b] - n_q_b + i. Covers plain, chunked and prefix-cached
    prefill. k_cache, v_cache: [num_blocks, block_size, KVH, D] (an fp8 v_cache [num_blocks, KVH, D,
    block_size]); block_tables: int32 [B, max_blocks].
    k_scale, v_scale: [num_blocks, KVH, block_size] float32, given iff the cache is float8_e4m3fn.
    max_seqlen_q: max n_q_b (a host int). out: optional [T, H, D] destination. config: block_m, block_n,
    num_warps and num_stages override the defaults. Returns [T, H, D] in q.dtype.
    """
    precision = _check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, out)
    strides = _paged_strides(k_cache, v_cache, k_scale, block_tables)
    return _launch_prefill(q, k_cache, v_cache, *_scale_ptrs(k_cache, v_cache, k_scale, v_scale), block_tables,
                           cu_seqlens_q, context_lens, strides, max_seqlen_q, scale, out, precision,
                           page=k_cache.shape[1], kvh=k_cache.shape[2], fp8=k_cache.dtype == torch.float8_e4m3fn,
                           **config)


def varlen_prefill_attention(q, k, v, cu_seqlens_q, max_seqlen_q, scale, *, cu_seqlens_k=None, seqs=None,
                             out=None, **config):
    """Causal attention of a varlen batch over plain (not paged) K/V: without cu_seqlens_k, prefill without
    a cached prefix over the step's own K/V, whatever the cache holds (an fp8 cache is then not read: its
    rounding touches decode only, as with flash-attn); with it, over dequantized contexts
    (dequantized_prefill_attention).

    q: [T, H, D]; sequence b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b+1] (int32 [B+1]) and sit at
    the last positions of its keys: k, v [*, KVH, D] rows cu_seqlens_k[b]:cu_seqlens_k[b+1] (default
    cu_seqlens_q), counted from cu_seqlens_k[first] when seqs = (first, end) limits the call to sequences
    first..end-1 (default all). head_dim contiguous; other strides free, e.g. views of the qkv projection.
    max_seqlen_q: the longest query run (a host int). out and config as for paged_prefill_attention.
    """
    assert k.shape == v.shape and q.shape[1] % k.shape[1] == 0 and q.shape[2] == k.shape[2]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k.dtype == q.dtype
    assert out is None or (out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1)
    if cu_seqlens_k is None:
        assert k.shape[0] == q.shape[0], "without cu_seqlens_k the keys are the queries' own rows"
        cu_seqlens_k = cu_seqlens_q
    strides = (0, k.stride(0), k.stride(1), 0, v.stride(0), v.stride(1), 1, 0, 0, 0)  # no blocks, scales, table
    return _launch_prefill(q, k, v, k, v, cu_seqlens_q, cu_seqlens_q, cu_seqlens_k, strides, max_seqlen_q, scale,
                           out, _dot_precision(q), page=0, kvh=k.shape[1], fp8=False, paged=False, seqs=seqs,
                           **config)


def _launch_prefill(q, k, v, k_scale, v_scale, block_tables, cu_seqlens_q, context_lens, kv_strides, max_seqlen_q,
                    scale, out, precision, *, page, kvh, fp8, paged=True, seqs=None, block_m=None, block_n=None,
                    num_warps=None, num_stages=None):
    """_prefill_kernel over K/V whose 10 strides (_paged_strides) the caller worked out, for sequences
    seqs = (first, end) (default all); the tile defaults of _prefill_tile."""
    T, H, D = q.shape
    out = torch.empty_like(q) if out is None else out
    first, end = seqs or (0, cu_seqlens_q.shape[0] - 1)
    if T == 0 or end == first:
        return out
    default_m, default_n, default_stages = _prefill_tile(D, max_seqlen_q, fp8, paged)
    block_m, block_n = block_m or default_m, block_n or default_n
    num_warps = num_warps or (8 if block_m * D >= 128 * 128 else 4)
    grid = (triton.cdiv(max_seqlen_q, block_m), H, end - first)
    _prefill_kernel[grid](
        q, k, v, k_scale, v_scale, block_tables, cu_seqlens_q, context_lens, out, first,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *kv_strides,
        G=H // kvh, D=D, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=precision,
        FP8=fp8, FP8_COMPUTE=_fp8_compute_dtype(q), PAGED=paged,
        num_warps=num_warps, num_stages=num_stages or default_stages,
    )
    return out


@triton.jit
def _dequantize_kernel(
    k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, cu_seqlens_k_ptr, k_out_ptr, v_out_ptr, first_seq,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, stride_sb, stride_sh, stride_bt,
    stride_ot, stride_oh, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (token tiles, KVH, sequences): BLOCK_N context tokens of one kv head of sequence
    first_seq + program_id(2), read from the paged fp8 cache, times their scales, into rows
    cu_seqlens_k[seq] - cu_seqlens_k[first_seq] onwards of k_out, v_out [*, KVH, D]."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = first_seq + tl.program_id(2)
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    ctx = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    start = tile * BLOCK_N
    if start >= ctx:
        return
    k, v, k_scale, v_scale = _load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr,
                                      block_tables_ptr + seq.to(tl.int64) * stride_bt, start, ctx, kv_head,
                                      stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                                      stride_sb, stride_sh, D, PAGE, BLOCK_N, True, True)
    tok = start + tl.arange(0, BLOCK_N)
    rows = (k_start - tl.load(cu_seqlens_k_ptr + first_seq) + tok).to(tl.int64)
    offs = rows[:, None] * stride_ot + kv_head * stride_oh + tl.arange(0, D)[None, :]
    mask = (tok < ctx)[:, None]
    tl.store(k_out_ptr + offs, (k.to(tl.float32) * k_scale[:, None]).to(k_out_ptr.dtype.element_ty), mask=mask)
    tl.store(v_out_ptr + offs, (v.to(tl.float32) * v_scale[:, None]).to(v_out_ptr.dtype.element_ty), mask=mask)


def dequantized_prefill_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_q, cu_seqlens_k,
                                  groups, scale, workspace, *, out=None, **config):
    """paged_prefill_attention over an fp8 cache, by way of a workspace: each group of sequences' contexts
    is dequantized into workspace [2, capacity, KVH, D] (q's dtype), then attended to with the 16-bit
    kernel (varlen_prefill_attention). The fp8 kernel converts every V tile in registers and stores it
    back to shared memory for wgmma; from ~128 queries a sequence, the extra pass over the contexts costs
    less than that (attention.dequantizing_pays).

    groups: (first, end, max_seqlen_q, max_seqlen_k) per run of sequences first..end-1 whose contexts fit
    the workspace together (attention.workspace_groups). Other arguments as for paged_prefill_attention,
    with cu_seqlens_k int32 [B+1] the running sum of context_lens; config goes to the 16-bit kernel.
    """
    _check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, out)
    out = torch.empty_like(q) if out is None else out
    for first, end, max_seqlen_q, max_seqlen_k in groups:
        dequantize_paged_kv(k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_k, (first, end), max_seqlen_k,
                            workspace)
        varlen_prefill_attention(q, workspace[0], workspace[1], cu_seqlens_q, max_seqlen_q, scale,
                                 cu_seqlens_k=cu_seqlens_k, seqs=(first, end), out=out, **config)
    return out


def dequantize_paged_kv(k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_k, seqs, max_seqlen_k, workspace,
                        block_n=64, num_warps=4):
    """The contexts of sequences seqs = (first, end) from an fp8 paged cache, times their scales, into
    workspace [2, capacity, KVH, D] (K, V; sequence b's from row cu_seqlens_k[b] - cu_seqlens_k[first])."""
    _, page, kvh, D = k_cache.shape
    first, end = seqs
    k_out, v_out = workspace
    _dequantize_kernel[(triton.cdiv(max_seqlen_k, block_n), kvh, end - first)](
        k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_k, k_out, v_out, first,
        *_paged_strides(k_cache, v_cache, k_scale, block_tables), k_out.stride(0), k_out.stride(1), D=D, PAGE=page,
        BLOCK_N=block_n, num_warps=num_warps)


def _prefill_tile(head_dim: int, max_seqlen_q: int, fp8: bool, paged: bool) -> tuple[int, int, int]:
    """Default (block_m, block_n, num_stages) of the prefill kernel (num_warps follows block_m: 8 from
    128 x 128 elements a tile).

    H200 sweeps of 2026-11-30 (H=16, KVH=8, D=128; BENCHMARKS.md, seventh to ninth and twelfth sessions):
    - over plain 16-bit K/V (varlen_prefill_attention), 64/64/4/3: 0.67-0.76x flash-attn's time, against
      0.80-0.92x with 128/128/8/2;
    - over a paged 16-bit cache, 128/128/8/2 (1 x 4,096: 0.82x flash-attn, 64/64/4/3 0.91x);
    - over a paged fp8 cache, 64-row tiles (q k^T in fp8) take 128 keys: 1.06-1.14x flash-attn's time
      on bf16 with a cached prefix (32 x 64 queries over 960 tokens: 81 us, 100 with 64 keys). Fewer
      queries take 16- or 32-row mma.sync tiles of 64 keys (64 x 16 queries: 0.92x flash-attn).
    """
    small = fp8 or not paged
    block_m = min(64 if small else 128, max(16, triton.next_power_of_2(max_seqlen_q)))
    block_n = 64 if small or head_dim > 128 else 128
    if fp8 and paged and block_m == 64 and head_dim <= 128:
        block_n = 128
    return block_m, block_n, 3 if small else 2
