"""Triton causal prefill attention over varlen batches: over a paged cache (a cached prefix, chunked
prefill), over the step's own K/V, or over an fp8 prefix dequantized into a workspace. The cache
layouts and the fp8 scheme: triton_attention.py.

Over an fp8 cache, tiles of 64 query rows and more (wgmma) do not convert K to fp16: they round q to
e4m3, with a scale per token and head as the cache has for K (quantize_rows), and multiply q k^T in fp8
on the tiles as loaded; only V is converted. With 128-key tiles and the output accumulated in place
(softmax_step),
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
        q, q_scale = quantize_rows(q)
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
        k, v, k_scale, v_scale = load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table, s, ctx, kv_head,
                                          stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                                          stride_sb, stride_sh, D, PAGE, BLOCK_N, FP8, PAGED)
        m_i, l_i, acc, acc_unit = softmax_step(q, q_scale, k, v, k_scale, v_scale, m_i, l_i, acc, acc_unit, None,
                                                sm_scale_log2, DOT_PRECISION, FP8, FP8_COMPUTE)
    for s in range(full_end, kv_end, BLOCK_N):
        k, v, k_scale, v_scale = load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table, s, ctx, kv_head,
                                          stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                                          stride_sb, stride_sh, D, PAGE, BLOCK_N, FP8, PAGED)
        # Keys past the context lie past every query's position (rows past n_q are not stored).
        causal = (s + tl.arange(0, BLOCK_N))[None, :] <= pos[:, None]
        m_i, l_i, acc, acc_unit = softmax_step(q, q_scale, k, v, k_scale, v_scale, m_i, l_i, acc, acc_unit, causal,
                                                sm_scale_log2, DOT_PRECISION, FP8, FP8_COMPUTE)

    out = acc * (acc_unit / l_i)[:, None]
    tl.store(out_ptr + tok_offs * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(i < n_q)[:, None])


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
    precision = check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, out)
    strides = paged_strides(k_cache, v_cache, k_scale, block_tables)
    return _launch_prefill(q, k_cache, v_cache, *scale_ptrs(k_cache, v_cache, k_scale, v_scale), block_tables,
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
                           out, dot_precision(q), page=0, kvh=k.shape[1], fp8=False, paged=False, seqs=seqs,
                           **config)


def _launch_prefill(q, k, v, k_scale, v_scale, block_tables, cu_seqlens_q, context_lens, kv_strides, max_seqlen_q,
                    scale, out, precision, *, page, kvh, fp8, paged=True, seqs=None, block_m=None, block_n=None,
                    num_warps=None, num_stages=None):
    """_prefill_kernel over K/V whose 10 strides (paged_strides) the caller worked out, for sequences
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
        FP8=fp8, FP8_COMPUTE=fp8_compute_dtype(q), PAGED=paged,
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
    k, v, k_scale, v_scale = load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr,
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
    check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, out)
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
        *paged_strides(k_cache, v_cache, k_scale, block_tables), k_out.stride(0), k_out.stride(1), D=D, PAGE=page,
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
    # 128 keys: the paged 16-bit tiles, and the fp8 tiles of 64 rows (q k^T in fp8)
    wide = paged and (not fp8 or block_m == 64) and head_dim <= 128
    return block_m, 128 if wide else 64, 3 if small else 2
