"""Triton paged decode attention: one query per sequence, the G query heads of a kv head in one
program (GQA), split-K over long contexts, the splits merged as split_softmax.py says."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.common import (
    LOG2E,
    NEG_INF,
    check_args,
    fp8_compute_dtype,
    load_kv,
    paged_strides,
    scale_ptrs,
    softmax_step,
    tile_blocks,
    v_scaled_weights,
)
from nanovllm.kernels.attention.split_softmax import SplitSoftmax, merge_splits
from nanovllm.kernels.device import arrival_counts, num_sms, pdl_enabled, prefetch_to_l2
from nanovllm.kernels.gemm.split_k import split_operand
from nanovllm.kernels.qk_norm_rope import NormRopeInputs, decode_q_storing_kv, rope_factors


@triton.jit
def _prefetch_runs(ptr, block_table, start, end, stride_b, stride_t, head_offset, cols,
                   RUN: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Prefetch into L2 `cols` of one token of each aligned run of RUN of tokens start..end-1."""
    tok = tl.minimum(start + tl.arange(0, BLOCK_N // RUN) * RUN, end - 1)
    blk = tile_blocks(block_table, start, tok, None, PAGE, BLOCK_N)
    rows = blk * stride_b + (tok % PAGE) * stride_t + head_offset
    prefetch_to_l2(ptr + rows[:, None] + cols[None, :])


@triton.jit
def _prefetch_tile(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table, start, end, kv_head,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                   stride_sb, stride_sh, D: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, FP8: tl.constexpr):
    """Prefetch into L2 the K/V tile (and fp8 scales) of tokens start..end-1 that load_kv reads."""
    LINE: tl.constexpr = 1024 // k_ptr.dtype.element_ty.primitive_bitwidth
    if D >= LINE:
        head_lines = tl.arange(0, D // LINE) * LINE
    else:
        head_lines = tl.arange(0, 1)
    _prefetch_runs(k_ptr, block_table, start, end, stride_kb, stride_kt, kv_head * stride_kh,
                   head_lines, 1, BLOCK_N, PAGE)
    if FP8:
        V_RUN: tl.constexpr = min(PAGE, BLOCK_N, 128)
        S_RUN: tl.constexpr = min(PAGE, BLOCK_N, 32)
        _prefetch_runs(v_ptr, block_table, start, end, stride_vb, stride_vt, kv_head * stride_vh,
                       tl.arange(0, D) * stride_vd, V_RUN, BLOCK_N, PAGE)
        _prefetch_runs(k_scale_ptr, block_table, start, end, stride_sb, 1, kv_head * stride_sh,
                       tl.arange(0, 1), S_RUN, BLOCK_N, PAGE)
        _prefetch_runs(v_scale_ptr, block_table, start, end, stride_sb, 1, kv_head * stride_sh,
                       tl.arange(0, 1), S_RUN, BLOCK_N, PAGE)
    else:
        _prefetch_runs(v_ptr, block_table, start, end, stride_vb, stride_vt, kv_head * stride_vh,
                       head_lines * stride_vd, 1, BLOCK_N, PAGE)


@triton.jit
def _keys_major_step(q, k, v, k_scale, v_scale, m_i, l_i, acc_t, key_mask, sm_scale_log2,
                     DOT_PRECISION: tl.constexpr, FP8_COMPUTE: tl.constexpr):
    """softmax_step transposed, for fp8: logits K q^T [BLOCK_N, G_PAD], acc_t [D, G_PAD]. The MMA's
    16-row side holds keys, its 8-wide side the G heads, and q stays in registers as a B operand."""
    logits = tl.dot(k.to(FP8_COMPUTE), tl.trans(q),
                    input_precision=DOT_PRECISION) * k_scale[:, None]
    logits = tl.where(key_mask[:, None], logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, 0) * sm_scale_log2)
    p = tl.exp2(logits * sm_scale_log2 - m_new[None, :])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 0)
    p, v_max = v_scaled_weights(p, v_scale, 0, FP8_COMPUTE)
    acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v.to(FP8_COMPUTE)), p,
                                            input_precision=DOT_PRECISION) * v_max
    return m_new, l_i, acc_t


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, context_lens_ptr, order_ptr,
    out_ptr, acc_ptr, m_ptr, l_ptr, split_counts_ptr, sm_scale_log2,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_vd, stride_sb, stride_sh, stride_bt,
    qkv_ptr, stride_qkv, qkv_split_stride, positions_ptr, cos_sin_ptr, stride_cs,
    q_weight_ptr, k_weight_ptr, eps, slot_mapping_ptr,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr, FP8_COMPUTE: tl.constexpr, ORDERED: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr, LAST_SPLIT_MERGES: tl.constexpr, MERGE_HEADS: tl.constexpr,
    FROM_QKV: tl.constexpr, QKV_SPLITS: tl.constexpr, HAS_NORM: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
):
    """Grid (NUM_SPLITS, KVH, B), split then kv head fastest (docs/kernels.md): the G query heads
    of a kv head over a split of sequence order[b] (ORDERED) or b. Before gdc_wait only what the
    host wrote or no kernel writes is read. FROM_QKV: q from the qkv projection, and the program
    holding the newest key stores its K/V first. NUM_SPLITS > 1: partials (m, l, acc); with
    LAST_SPLIT_MERGES the last split to arrive merges them and resets its count to 0."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    if ORDERED:
        seq = tl.load(order_ptr + seq)
    ctx = tl.load(context_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if FROM_QKV:
        cos_sin_row = cos_sin_ptr + tl.load(positions_ptr + seq) * stride_cs
        q_factors = rope_factors(cos_sin_row, q_weight_ptr, HAS_NORM, D)
        k_factors = rope_factors(cos_sin_row, k_weight_ptr, HAS_NORM, D)
        slot = tl.load(slot_mapping_ptr + seq)
    if PDL:
        if PREFETCH:
            if start < end:
                _prefetch_tile(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table, start, end,
                               kv_head, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                               stride_vh, stride_vd, stride_sb, stride_sh, D, PAGE, BLOCK_N, FP8)
        tl.extra.cuda.gdc_wait()

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = kv_head * G + g
    head_mask = (g < G)[:, None]
    if FROM_QKV:
        newest = (start <= ctx - 1) & (ctx - 1 < end) & (slot != -1)
        q = decode_q_storing_kv(qkv_ptr, stride_qkv, qkv_split_stride, seq.to(tl.int64), kv_head,
                                q_factors, k_factors, eps, newest, slot, k_ptr, v_ptr, k_scale_ptr,
                                v_scale_ptr, G, G_PAD, G * NUM_KV_HEADS, NUM_KV_HEADS, D, PAGE,
                                QKV_SPLITS, HAS_NORM, FP8, out_ptr.dtype.element_ty)
        tl.debug_barrier()  # the stores before any thread's loads of the cache
    else:
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=head_mask, other=0.0)
    if FP8:
        q = q.to(FP8_COMPUTE)

    m_i = tl.full([G_PAD], NEG_INF, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    acc_t = tl.zeros([D, G_PAD], tl.float32)
    acc_unit = 1.0
    for s in range(start, end, BLOCK_N):
        k, v, k_scale, v_scale = load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table, s,
                                          end, kv_head, stride_kb, stride_kt, stride_kh, stride_vb,
                                          stride_vt, stride_vh, stride_vd, stride_sb, stride_sh, D,
                                          PAGE, BLOCK_N, FP8, True)
        key_mask = s + tl.arange(0, BLOCK_N) < end
        if FP8:
            m_i, l_i, acc_t = _keys_major_step(q, k, v, k_scale, v_scale, m_i, l_i, acc_t,
                                               key_mask, sm_scale_log2, DOT_PRECISION, FP8_COMPUTE)
        else:
            m_i, l_i, acc, acc_unit = softmax_step(q, None, k, v, k_scale, v_scale, m_i, l_i, acc,
                                                    acc_unit, key_mask[None, :], sm_scale_log2,
                                                    DOT_PRECISION, FP8, FP8_COMPUTE)
    if FP8:
        acc = tl.trans(acc_t)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # context_len 0 -> zeros
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_mask)
    else:  # partials: m, l [B, H, NUM_SPLITS], acc [B, H, NUM_SPLITS, D], float32, contiguous
        first_row = (seq * NUM_KV_HEADS * G + heads) * NUM_SPLITS
        tl.store(m_ptr + first_row + split, m_i, mask=g < G)
        tl.store(l_ptr + first_row + split, l_i, mask=g < G)
        tl.store(acc_ptr + (first_row + split)[:, None] * D + d[None, :], acc, mask=head_mask)
        if LAST_SPLIT_MERGES:
            tl.debug_barrier()  # every thread's stores before the count's release
            count_ptr = split_counts_ptr + seq * NUM_KV_HEADS + kv_head
            if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
                for first in tl.range(kv_head * G, kv_head * G + G, MERGE_HEADS, num_stages=1):
                    merged_heads = first + tl.arange(0, MERGE_HEADS)
                    merged = merge_splits(acc_ptr, m_ptr, l_ptr,
                                          (seq * NUM_KV_HEADS * G + merged_heads) * NUM_SPLITS,
                                          merged_heads < first + MERGE_HEADS,
                                          D, NUM_SPLITS, True)
                    tl.store(out_ptr + seq * stride_ob + merged_heads[:, None] * stride_oh
                             + d[None, :], merged.to(out_ptr.dtype.element_ty))
                tl.store(count_ptr, 0)


# Splits from which the decode kernel prefetches its first tile (PREFETCH; docs/kernels.md).
PREFETCH_MIN_SPLITS = 8
# Up to this many splits the last to finish merges them, else SplitSoftmax (docs/kernels.md).
MAX_SPLITS_MERGED_BY_THE_LAST = 8
# Registers a thread of the fp8 decode kernel may use: four 4-warp programs an SM (docs/kernels.md).
FP8_MAX_REGISTERS = 128


def _decode_num_splits(batch: int, num_kv_heads: int, max_context: int,
                       device: torch.device) -> int:
    """Splits: up to ~4 programs an SM, >= 256 keys a split of max_context (docs/kernels.md)."""
    splits, target = 1, 4 * num_sms(device)
    while (batch * num_kv_heads * splits * 2 <= target and splits * 512 <= max_context
           and splits < 64):
        splits *= 2
    return splits


def _merge_heads(group: int, num_splits: int) -> int:
    """Heads the last split merges at once: a power of two dividing G, <= 32 partial rows."""
    heads = 1
    while group % (2 * heads) == 0 and 2 * heads * num_splits <= 32:
        heads *= 2
    return heads


def _decode_tile(head_dim: int, fp8: bool) -> tuple[int, int, int]:
    """Default (block_n, num_warps, num_stages) of the decode kernel (docs/kernels.md)."""
    if fp8:
        return 128, 4, 2
    return min(64, max(16, 8192 // head_dim)), 4, 3


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, *,
                           k_scale=None, v_scale=None, order=None, out=None, num_splits=None,
                           block_n=None, num_warps=None, num_stages=None,
                           from_qkv: NormRopeInputs | None = None,
                           defer_merge: bool = False) -> "torch.Tensor | SplitSoftmax":
    """Attention of each sequence's newest query over its paged KV cache: [B, H, D] in q's dtype.

    q: [B, H, D], or None with from_qkv (the kernel computes q and stores the new K/V). Int32
    block_tables [B, max_blocks], context_lens [B] (0: zeros), order [B] (launch order).
    defer_merge: the partials (SplitSoftmax) where no program merges them."""
    if from_qkv is not None:
        assert q is None, "q comes from from_qkv"
        q = out = _from_qkv_output(from_qkv, k_cache, out)
    B, H, D = q.shape
    _, page, kvh, _ = k_cache.shape
    precision = check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, out)
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    G = H // kvh
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    block_n, num_warps, num_stages = (given or default for given, default in
                                      zip((block_n, num_warps, num_stages), _decode_tile(D, fp8)))
    if num_splits is None:
        num_splits = _decode_num_splits(B, kvh, block_tables.shape[1] * page, q.device)
    assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    last_split_merges = num_splits <= MAX_SPLITS_MERGED_BY_THE_LAST
    partials = _split_partials(q, kvh, num_splits, last_split_merges, out)
    pdl = pdl_enabled(q.device)
    qkv_args, qkv_splits, has_norm = _from_qkv_args(from_qkv, out)
    _decode_kernel[(num_splits, kvh, B)](
        q, k_cache, v_cache, *scale_ptrs(k_cache, v_cache, k_scale, v_scale), block_tables,
        context_lens, context_lens if order is None else order, out, *partials, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *paged_strides(k_cache, v_cache, k_scale, block_tables), *qkv_args,
        G=G, G_PAD=max(8 if fp8 else 16, triton.next_power_of_2(G)), D=D, PAGE=page,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, DOT_PRECISION=precision, FP8=fp8,
        FP8_COMPUTE=fp8_compute_dtype(q), ORDERED=order is not None, PDL=pdl,
        PREFETCH=num_splits >= PREFETCH_MIN_SPLITS, LAST_SPLIT_MERGES=last_split_merges,
        MERGE_HEADS=_merge_heads(G, num_splits), FROM_QKV=from_qkv is not None,
        QKV_SPLITS=qkv_splits, HAS_NORM=has_norm, NUM_KV_HEADS=kvh, num_warps=num_warps,
        num_stages=num_stages, launch_pdl=pdl,
        # from_qkv: no FMA contraction, so that q and k round as qk_norm_rope's
        enable_fp_fusion=from_qkv is None, **({"maxnreg": FP8_MAX_REGISTERS} if fp8 else {}),
    )
    if num_splits > 1 and not last_split_merges:
        split_softmax = SplitSoftmax(*partials[:3], out.dtype)
        return split_softmax if defer_merge else split_softmax.merge(out)
    return out


def _split_partials(q: torch.Tensor, num_kv_heads: int, num_splits: int, last_split_merges: bool,
                    placeholder: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernel's float32 acc [B, H, splits, D], m, l [B, H, splits], and split counts."""
    if num_splits == 1:
        return (placeholder,) * 4
    B, H, D = q.shape
    part_max = torch.empty(B, H, num_splits, device=q.device, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(B, H, num_splits, D, device=q.device, dtype=torch.float32)
    counts = placeholder
    if last_split_merges:
        counts = arrival_counts("decode splits", B * num_kv_heads, q.device)
    return part_acc, part_max, part_sum, counts


def _from_qkv_output(from_qkv: NormRopeInputs, k_cache: torch.Tensor,
                     out: torch.Tensor | None) -> torch.Tensor:
    """The output [rows, num_heads, D] of a from_qkv decode, which also stands in for q."""
    if out is not None:
        return out
    rows, D = from_qkv.qkv.shape[0], k_cache.shape[-1]
    return torch.empty(rows, from_qkv.num_heads, D, dtype=from_qkv.qkv.dtype, device=k_cache.device)


def _from_qkv_args(from_qkv: NormRopeInputs | None,
                   placeholder: torch.Tensor) -> tuple[tuple, int, bool]:
    """The kernel's from_qkv arguments (placeholders without it), QKV_SPLITS and HAS_NORM."""
    if from_qkv is None:
        p = placeholder
        return (p, 0, 0, p, p, 0, p, p, 0.0, p), 0, False
    data, splits, split_stride = split_operand(from_qkv.qkv)
    has_norm = from_qkv.q_weight is not None
    cos_sin = from_qkv.cos_sin_cache
    assert cos_sin.dtype == torch.float32 and cos_sin.stride(1) == 1 and data.stride(-1) == 1
    assert from_qkv.slot_mapping.dtype == torch.int64
    assert from_qkv.positions.shape == (data.shape[-2],)
    weights = (from_qkv.q_weight, from_qkv.k_weight) if has_norm else (placeholder, placeholder)
    return ((data, data.stride(-2), split_stride, from_qkv.positions, cos_sin, cos_sin.stride(0),
             *weights, from_qkv.eps, from_qkv.slot_mapping), splits, has_norm)
