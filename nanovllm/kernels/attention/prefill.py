"""Triton causal prefill attention over varlen batches: over a paged cache, over the step's own
K/V, or over an fp8 prefix dequantized into a workspace."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.common import (
    LOG2E,
    NEG_INF,
    check_args,
    dot_precision,
    fp8_compute_dtype,
    load_kv,
    paged_strides,
    quantize_rows,
    scale_ptrs,
    softmax_step,
)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, cu_seqlens_q_ptr,
    context_lens_ptr, out_ptr, first_seq, sm_scale_log2, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, stride_sb,
    stride_sh, stride_bt, G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
    FP8_COMPUTE: tl.constexpr, PAGED: tl.constexpr,
):
    """Grid (query tiles, H, sequences): BLOCK_M queries of one head of sequence first_seq + b.
    Not PAGED: context_lens_ptr holds cu_seqlens_k over plain K/V from first_seq's keys on."""
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

    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pos = ctx - n_q + i  # the last key each query sees
    d = tl.arange(0, D)
    tok_offs = (q_start + i).to(tl.int64)[:, None]
    q = tl.load(q_ptr + tok_offs * stride_qt + head * stride_qh + d[None, :],
                mask=(i < n_q)[:, None], other=0.0)
    q_scale = None
    if FP8 and BLOCK_M >= 64:  # wgmma tiles: q rounded to e4m3 for an fp8 q k^T
        q, q_scale = quantize_rows(q)
    elif FP8:
        q = q.to(FP8_COMPUTE)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    acc_unit = 1.0
    # Keys < full_end are visible to every row of the tile; [full_end, kv_end) are masked.
    first = ctx - n_q + tile * BLOCK_M
    full_end = (first + 1) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(first + BLOCK_M, ctx)
    for s in range(0, full_end, BLOCK_N):
        k, v, k_scale, v_scale = load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table, s,
                                          ctx, kv_head, stride_kb, stride_kt, stride_kh, stride_vb,
                                          stride_vt, stride_vh, stride_vd, stride_sb, stride_sh, D,
                                          PAGE, BLOCK_N, FP8, PAGED)
        m_i, l_i, acc, acc_unit = softmax_step(q, q_scale, k, v, k_scale, v_scale, m_i, l_i, acc,
                                                acc_unit, None, sm_scale_log2, DOT_PRECISION, FP8,
                                                FP8_COMPUTE)
    for s in range(full_end, kv_end, BLOCK_N):
        k, v, k_scale, v_scale = load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table, s,
                                          ctx, kv_head, stride_kb, stride_kt, stride_kh, stride_vb,
                                          stride_vt, stride_vh, stride_vd, stride_sb, stride_sh, D,
                                          PAGE, BLOCK_N, FP8, PAGED)
        causal = (s + tl.arange(0, BLOCK_N))[None, :] <= pos[:, None]
        m_i, l_i, acc, acc_unit = softmax_step(q, q_scale, k, v, k_scale, v_scale, m_i, l_i, acc,
                                                acc_unit, causal, sm_scale_log2, DOT_PRECISION, FP8,
                                                FP8_COMPUTE)

    out = acc * (acc_unit / l_i)[:, None]
    tl.store(out_ptr + tok_offs * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(i < n_q)[:, None])


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                            max_seqlen_q, scale, *, k_scale=None, v_scale=None, out=None, **config):
    """Causal attention of q [T, H, D], sequence b's rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] at
    the last of its context_lens[b] positions, over the paged cache: [T, H, D]."""
    precision = check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, out)
    strides = paged_strides(k_cache, v_cache, k_scale, block_tables)
    return _launch_prefill(q, k_cache, v_cache, *scale_ptrs(k_cache, v_cache, k_scale, v_scale),
                           block_tables, cu_seqlens_q, context_lens, strides, max_seqlen_q, scale,
                           out, precision, page=k_cache.shape[1], kvh=k_cache.shape[2],
                           fp8=k_cache.dtype == torch.float8_e4m3fn, **config)


def varlen_prefill_attention(q, k, v, cu_seqlens_q, max_seqlen_q, scale, *, cu_seqlens_k=None,
                             seqs=None, out=None, **config):
    """Causal attention of a varlen batch over plain K/V [*, KVH, D] (default: the queries' own
    rows), for sequences seqs = (first, end), whose keys start at row cu_seqlens_k[first]."""
    assert k.shape == v.shape and q.shape[1] % k.shape[1] == 0 and q.shape[2] == k.shape[2]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k.dtype == q.dtype
    assert out is None or (out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1)
    if cu_seqlens_k is None:
        assert k.shape[0] == q.shape[0], "without cu_seqlens_k the keys are the queries' own rows"
        cu_seqlens_k = cu_seqlens_q
    strides = (0, k.stride(0), k.stride(1), 0, v.stride(0), v.stride(1), 1, 0, 0, 0)
    return _launch_prefill(q, k, v, k, v, cu_seqlens_q, cu_seqlens_q, cu_seqlens_k, strides,
                           max_seqlen_q, scale, out, dot_precision(q), page=0, kvh=k.shape[1],
                           fp8=False, paged=False, seqs=seqs, **config)


def _launch_prefill(q, k, v, k_scale, v_scale, block_tables, cu_seqlens_q, context_lens,
                    kv_strides, max_seqlen_q, scale, out, precision, *, page, kvh, fp8, paged=True,
                    seqs=None, block_m=None, block_n=None, num_warps=None, num_stages=None):
    """_prefill_kernel over K/V of the given 10 strides (paged_strides), for sequences seqs."""
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
        FP8=fp8, FP8_COMPUTE=fp8_compute_dtype(q), PAGED=paged,
        num_warps=num_warps, num_stages=num_stages or default_stages,
    )
    return out


@triton.jit
def _dequantize_kernel(
    k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, cu_seqlens_k_ptr, k_out_ptr,
    v_out_ptr, first_seq, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_vd, stride_sb, stride_sh, stride_bt, stride_ot, stride_oh,
    D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (token tiles, KVH, sequences): a tile of one kv head, dequantized into k_out, v_out."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = first_seq + tl.program_id(2)
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    ctx = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    start = tile * BLOCK_N
    if start >= ctx:
        return
    k, v, k_scale, v_scale = load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr,
                                      block_tables_ptr + seq.to(tl.int64) * stride_bt, start, ctx,
                                      kv_head, stride_kb, stride_kt, stride_kh, stride_vb,
                                      stride_vt, stride_vh, stride_vd, stride_sb, stride_sh, D,
                                      PAGE, BLOCK_N, True, True)
    tok = start + tl.arange(0, BLOCK_N)
    rows = (k_start - tl.load(cu_seqlens_k_ptr + first_seq) + tok).to(tl.int64)
    offs = rows[:, None] * stride_ot + kv_head * stride_oh + tl.arange(0, D)[None, :]
    mask = (tok < ctx)[:, None]
    tl.store(k_out_ptr + offs,
             (k.to(tl.float32) * k_scale[:, None]).to(k_out_ptr.dtype.element_ty), mask=mask)
    tl.store(v_out_ptr + offs,
             (v.to(tl.float32) * v_scale[:, None]).to(v_out_ptr.dtype.element_ty), mask=mask)


def dequantized_prefill_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables,
                                  cu_seqlens_q, cu_seqlens_k, groups, scale, workspace, *,
                                  out=None, **config):
    """paged_prefill_attention over an fp8 cache, each group of sequences' contexts dequantized
    into workspace [2, capacity, KVH, D] for the 16-bit kernel."""
    check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, out)
    out = torch.empty_like(q) if out is None else out
    for first, end, max_seqlen_q, max_seqlen_k in groups:
        dequantize_paged_kv(k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_k,
                            (first, end), max_seqlen_k, workspace)
        varlen_prefill_attention(q, workspace[0], workspace[1], cu_seqlens_q, max_seqlen_q, scale,
                                 cu_seqlens_k=cu_seqlens_k, seqs=(first, end), out=out, **config)
    return out


def dequantize_paged_kv(k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_k, seqs,
                        max_seqlen_k, workspace, block_n=64, num_warps=4):
    """The contexts of sequences seqs = (first, end), dequantized into workspace."""
    _, page, kvh, D = k_cache.shape
    first, end = seqs
    k_out, v_out = workspace
    _dequantize_kernel[(triton.cdiv(max_seqlen_k, block_n), kvh, end - first)](
        k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_k, k_out, v_out, first,
        *paged_strides(k_cache, v_cache, k_scale, block_tables), k_out.stride(0), k_out.stride(1),
        D=D, PAGE=page, BLOCK_N=block_n, num_warps=num_warps)


def _prefill_tile(head_dim: int, max_seqlen_q: int, fp8: bool, paged: bool) -> tuple[int, int, int]:
    """Default (block_m, block_n, num_stages) of the prefill kernel (docs/kernels.md)."""
    small = fp8 or not paged
    block_m = min(64 if small else 128, max(16, triton.next_power_of_2(max_seqlen_q)))
    wide = paged and (not fp8 or block_m == 64) and head_dim <= 128
    return block_m, 128 if wide else 64, 3 if small else 2
