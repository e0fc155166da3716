"""Triton paged decode attention: one query per sequence over its paged KV cache, the G query heads of a
kv head in one program (GQA), split-K over long contexts, the splits merged by the last of them to finish
(for many splits, by a kernel of its own). The cache layouts and the fp8 scheme: triton_attention.py."""

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
from nanovllm.kernels.attention.kv_cache import fp8_v_offset
from nanovllm.kernels.attention.split_softmax import SplitSoftmax, merge_splits
from nanovllm.kernels.device import arrival_counts, num_sms, pdl_enabled, prefetch_to_l2
from nanovllm.kernels.gemm.split_k import split_operand
from nanovllm.kernels.qk_norm_rope import NormRopeInputs, decode_q_storing_kv, rope_factors


@triton.jit
def _prefetch_runs(ptr, block_table, start, end, stride_b, stride_t, head_offset, cols,
                   RUN: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Prefetch into L2 what one paged tensor holds of a tile's tokens start..end-1 (at most BLOCK_N): one
    token of each aligned run of RUN (a run's tokens share their lines), at offsets `cols` from its row."""
    tok = tl.minimum(start + tl.arange(0, BLOCK_N // RUN) * RUN, end - 1)
    blk = tile_blocks(block_table, start, tok, None, PAGE, BLOCK_N)
    rows = blk * stride_b + (tok % PAGE) * stride_t + head_offset
    prefetch_to_l2(ptr + rows[:, None] + cols[None, :])


@triton.jit
def _prefetch_tile(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table, start, end, kv_head,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, stride_sb, stride_sh,
                   D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr):
    """Prefetch into L2 the K/V tile (and fp8 scales) of tokens start..end-1 that load_kv reads first."""
    LINE: tl.constexpr = 1024 // k_ptr.dtype.element_ty.primitive_bitwidth  # elements a 128-byte line holds
    if D >= LINE:  # a line every LINE elements of a token's head
        head_lines = tl.arange(0, D // LINE) * LINE
    else:
        head_lines = tl.arange(0, 1)
    _prefetch_runs(k_ptr, block_table, start, end, stride_kb, stride_kt, kv_head * stride_kh, head_lines,
                   1, BLOCK_N, PAGE)
    if FP8:  # V's tokens contiguous: a line holds up to 128 tokens of one dim; the scales 32 tokens
        V_RUN: tl.constexpr = min(PAGE, BLOCK_N, 128)
        S_RUN: tl.constexpr = min(PAGE, BLOCK_N, 32)
        _prefetch_runs(v_ptr, block_table, start, end, stride_vb, stride_vt, kv_head * stride_vh,
                       tl.arange(0, D) * stride_vd, V_RUN, BLOCK_N, PAGE)
        _prefetch_runs(k_scale_ptr, block_table, start, end, stride_sb, 1, kv_head * stride_sh, tl.arange(0, 1),
                       S_RUN, BLOCK_N, PAGE)
        _prefetch_runs(v_scale_ptr, block_table, start, end, stride_sb, 1, kv_head * stride_sh, tl.arange(0, 1),
                       S_RUN, BLOCK_N, PAGE)
    else:
        _prefetch_runs(v_ptr, block_table, start, end, stride_vb, stride_vt, kv_head * stride_vh,
                       head_lines * stride_vd, 1, BLOCK_N, PAGE)


@triton.jit
def _keys_major_step(q, k, v, k_scale, v_scale, m_i, l_i, acc_t, key_mask, sm_scale_log2,
                     DOT_PRECISION: tl.constexpr, FP8_COMPUTE: tl.constexpr):
    """softmax_step for the fp8 decode kernel, transposed: the logits are K q^T [BLOCK_N, G_PAD] and the
    output accumulates as acc_t = sum_j v_j p_j^T [D, G_PAD]. The MMA's 16-row side then holds keys and
    head_dim, and its 8-wide side the G query heads (G_PAD >= 8), where q [G_PAD, D] as the 16-row side
    would pad G = 2 heads to 16 rows: the softmax touches half the elements, and q is a B operand kept in
    registers instead of an A operand rebuilt from shared memory each tile (160 register moves a warp).
    The kernel issues 663 instructions a warp per 128-key tile, not 905 (scripts/kernel_sass.py --loops).
    k, v [BLOCK_N, D] fp8 with scales [BLOCK_N] (0 past the context); key_mask [BLOCK_N]; m_i, l_i [G_PAD]."""
    logits = tl.dot(k.to(FP8_COMPUTE), tl.trans(q), input_precision=DOT_PRECISION) * k_scale[:, None]
    logits = tl.where(key_mask[:, None], logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, 0) * sm_scale_log2)
    p = tl.exp2(logits * sm_scale_log2 - m_new[None, :])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 0)
    p, v_max = v_scaled_weights(p, v_scale, 0, FP8_COMPUTE)
    acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v.to(FP8_COMPUTE)), p, input_precision=DOT_PRECISION) * v_max
    return m_new, l_i, acc_t


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, context_lens_ptr, order_ptr, out_ptr, acc_ptr,
    m_ptr, l_ptr, split_counts_ptr, sm_scale_log2, stride_qb, stride_qh, stride_ob, stride_oh, stride_kb, stride_kt,
    stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, stride_sb, stride_sh, stride_bt,
    qkv_ptr, stride_qkv, qkv_split_stride, positions_ptr, cos_sin_ptr, stride_cs, q_weight_ptr, k_weight_ptr, eps,
    slot_mapping_ptr, staged_v_ptr,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, FP8_COMPUTE: tl.constexpr,
    ORDERED: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, LAST_SPLIT_MERGES: tl.constexpr,
    MERGE_HEADS: tl.constexpr, FROM_QKV: tl.constexpr, QKV_SPLITS: tl.constexpr, HAS_NORM: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, STAGED_V: tl.constexpr,
):
    """Grid (NUM_SPLITS, KVH, B): the G query heads of kv head program_id(1) over split program_id(0) of the
    context, of sequence order[program_id(2)] if ORDERED, else program_id(2).

    The split varies fastest. A split takes whole tiles, so a context's last splits are the empty ones
    (1,511 keys in 8 splits of 2 tiles: splits 6 and 7), and the GPU puts programs of nearby indices on an
    SM together. With the split slowest, 88 of 132 SMs got four 2-tile programs and 21 only empty ones;
    with it fastest an SM's programs mix splits, and 8 streams decode 2% faster (H200, BENCHMARKS.md,
    thirty-fifth session, scripts/decode_timeline.py). After it the kv head varies fastest, so the GPU takes
    up a sequence's kv heads together and reads each block's K and V (a token's K heads are contiguous)
    within a short time, not in eight passes over the batch: 2-6% faster than a (B, KVH) grid from batch
    128, likely by DRAM locality (twelfth session, call 5). At one split (from batch ~33) that is the order.

    With PDL the kernel is launched while the q/k norm + RoPE kernel before it still runs and stores this
    step's K/V. Until gdc_wait it reads only what the host wrote before the step (context lengths, order,
    block tables; FROM_QKV: positions, slots) and what no kernel writes (FROM_QKV: the q/k norm weights and
    cos/sin); with PREFETCH it also asks L2 for its first tile of K/V, whose stale lines the store then
    overwrites in L2, the GPU's point of coherence.

    FROM_QKV: q is not in memory; each program computes its G heads from the qkv projection as the q/k norm +
    RoPE kernel would (qk_norm_rope.decode_q_storing_kv), and the one whose split holds the newest key first
    stores that token's K/V. PDL then overlaps this kernel with the qkv projection instead.

    With NUM_SPLITS > 1 each program stores its split's partial softmax (m, l, acc). With LAST_SPLIT_MERGES
    it also counts itself in split_counts[seq, kv_head], and the last of the NUM_SPLITS to arrive merges
    them into out (MERGE_HEADS heads at a time) and sets the count back to 0 for the next launch; else
    a SplitSoftmax of them is merged later (by its merge kernel, or as o_proj's skinny GEMM loads it)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    if ORDERED:
        seq = tl.load(order_ptr + seq)
    ctx = tl.load(context_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N  # whole tiles per split
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if FROM_QKV:  # host-written inputs, the norm weights and cos/sin, read before the wait
        cos_sin_row = cos_sin_ptr + tl.load(positions_ptr + seq) * stride_cs
        q_factors = rope_factors(cos_sin_row, q_weight_ptr, HAS_NORM, D)
        k_factors = rope_factors(cos_sin_row, k_weight_ptr, HAS_NORM, D)
        slot = tl.load(slot_mapping_ptr + seq)
    if STAGED_V:  # host-written
        slot = tl.load(slot_mapping_ptr + seq)
    if PDL:
        if PREFETCH:
            if start < end:
                _prefetch_tile(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table, start, end, kv_head,
                               stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                               stride_sb, stride_sh, D, PAGE, BLOCK_N, FP8)
        tl.extra.cuda.gdc_wait()

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = kv_head * G + g  # [G_PAD]
    head_mask = (g < G)[:, None]
    if FROM_QKV:  # this program's split holds the newest key: it stores that token's K/V first
        newest = (start <= ctx - 1) & (ctx - 1 < end) & (slot != -1)
        q = decode_q_storing_kv(qkv_ptr, stride_qkv, qkv_split_stride, seq.to(tl.int64), kv_head, q_factors,
                                k_factors, eps, newest, slot, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, G, G_PAD,
                                G * NUM_KV_HEADS, NUM_KV_HEADS, D, PAGE, QKV_SPLITS, HAS_NORM, FP8,
                                out_ptr.dtype.element_ty)
        tl.debug_barrier()  # the stores before any thread's loads of the cache
    else:
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=head_mask, other=0.0)  # [G_PAD, D]
    if FP8:
        q = q.to(FP8_COMPUTE)

    m_i = tl.full([G_PAD], NEG_INF, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    acc_t = tl.zeros([D, G_PAD], tl.float32)  # fp8: acc transposed (_keys_major_step)
    acc_unit = 1.0
    if STAGED_V:  # the newest key's V is not in the cache yet: it comes first, from the staging rows
        newest = (start <= ctx - 1) & (ctx - 1 < end) & (slot != -1)
        new_slot = tl.where(newest, slot, 0)  # the other programs read slot 0 and take nothing of it
        new_block, new_offset = new_slot // PAGE, new_slot % PAGE
        new_k = tl.load(k_ptr + new_block * stride_kb + new_offset * stride_kt + kv_head * stride_kh + d)
        new_scales = new_block * stride_sb + kv_head * stride_sh + new_offset
        new_k_scale = tl.load(k_scale_ptr + new_scales)
        new_v_scale = tl.load(v_scale_ptr + new_scales)
        new_v = tl.load(staged_v_ptr + (seq * NUM_KV_HEADS + kv_head) * D + d)
        new_logit = tl.sum(q.to(tl.float32) * new_k.to(tl.float32)[None, :], 1) * new_k_scale * sm_scale_log2
        m_i = tl.where(newest, new_logit, m_i)
        l_i = tl.where(newest, 1.0, l_i)
        acc_t = tl.where(newest, new_v.to(tl.float32) * new_v_scale, 0.0)[:, None] + acc_t
        end = tl.where(newest, ctx - 1, end)  # the loop's keys: the others
    # One pipelined loop, the last (partial) tile included: run apart, unpipelined, an fp8 partial tile
    # made the kernel 1.2x slower over ragged contexts (BENCHMARKS.md, eighth session).
    for s in range(start, end, BLOCK_N):
        k, v, k_scale, v_scale = load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table, s, end, kv_head,
                                          stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
                                          stride_sb, stride_sh, D, PAGE, BLOCK_N, FP8, True)
        key_mask = s + tl.arange(0, BLOCK_N) < end
        if FP8:
            m_i, l_i, acc_t = _keys_major_step(q, k, v, k_scale, v_scale, m_i, l_i, acc_t, key_mask, sm_scale_log2,
                                               DOT_PRECISION, FP8_COMPUTE)
        else:
            m_i, l_i, acc, acc_unit = softmax_step(q, None, k, v, k_scale, v_scale, m_i, l_i, acc, acc_unit,
                                                    key_mask[None, :], sm_scale_log2, DOT_PRECISION, FP8, FP8_COMPUTE)
    if STAGED_V:  # its V into the cache, after the loop read the lines around it
        if newest:
            tl.store(v_ptr + fp8_v_offset(slot, kv_head, d, NUM_KV_HEADS, D, PAGE), new_v)
    if FP8:
        acc = tl.trans(acc_t)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # context_len 0 -> zeros
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_mask)
    else:  # partials: m, l [B, H, NUM_SPLITS], acc [B, H, NUM_SPLITS, D], float32, contiguous
        first_row = (seq * NUM_KV_HEADS * G + heads) * NUM_SPLITS  # [G_PAD], split 0's rows
        tl.store(m_ptr + first_row + split, m_i, mask=g < G)
        tl.store(l_ptr + first_row + split, l_i, mask=g < G)
        tl.store(acc_ptr + (first_row + split)[:, None] * D + d[None, :], acc, mask=head_mask)
        if LAST_SPLIT_MERGES:
            # Every thread's stores come before the count (one thread's atomic, releasing them at GPU scope).
            tl.debug_barrier()
            count_ptr = split_counts_ptr + seq * NUM_KV_HEADS + kv_head
            if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
                # MERGE_HEADS heads at a time, so that their loads are in flight together; the other programs'
                # partials are loaded from L2 (.cg), past this SM's L1
                for first in tl.range(kv_head * G, kv_head * G + G, MERGE_HEADS, num_stages=1):  # no smem buffers
                    merged_heads = first + tl.arange(0, MERGE_HEADS)
                    merged = merge_splits(acc_ptr, m_ptr, l_ptr,
                                          (seq * NUM_KV_HEADS * G + merged_heads) * NUM_SPLITS,
                                          merged_heads < first + MERGE_HEADS,  # all True: MERGE_HEADS divides G
                                          D, NUM_SPLITS, True)
                    tl.store(out_ptr + seq * stride_ob + merged_heads[:, None] * stride_oh + d[None, :],
                             merged.to(out_ptr.dtype.element_ty))
                tl.store(count_ptr, 0)


# The decode kernel prefetches its first tile (PREFETCH) from this many splits: a few sequences, whose
# programs all start at once, each reading a few tiles. H200, thirteenth session (BENCHMARKS.md): at batch 1
# (16 splits) the kernel added 113-140 µs a step, not 151; at batch 8 (4 splits) decode was 1.6% slower.
PREFETCH_MIN_SPLITS = 8


def _decode_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Power-of-two split count: up to ~4 programs per SM, keeping >= 256 keys per split of the longest context.
    A split takes whole 128-key tiles of its sequence's context, so at shorter contexts fewer splits get work,
    and the others only compute q and store empty partials: a batch-1 step over 1,000-2,000 keys with 16 splits
    (of max_model_len 4,096) is faster than with 32 (H200, single stream 1,290-1,299 against 1,251-1,268 tok/s;
    BENCHMARKS.md, twenty-fourth session). Up to ~8 programs per SM (batch 8: 16 splits, which o_proj merges)
    was 10% slower at 8 streams (twenty-sixth session)."""
    splits, target = 1, 4 * num_sms(device)
    while batch * num_kv_heads * splits * 2 <= target and splits * 512 <= max_context and splits < 64:
        splits *= 2
    return splits


# Up to this many splits the last one to finish merges them; from more, a kernel of its own does (as many
# programs as heads, which PDL starts while the decode kernel runs), or with defer_merge o_proj's skinny GEMM as
# it loads them. H200, fp8, 1,000-2,000-token contexts
# (BENCHMARKS.md, sixteenth session): merging in the decode kernel made decode 2.8% faster at batch 8 (8 splits)
# and 1.3% at 16 (4 splits), but 3.5% slower at batch 1 (16 splits), 0.4% at 2 (32), 2.5% at 4 (16): its
# merge waits on a fence, an atomic and a round trip to L2, one program per kv head. Since o_proj merges what
# the kernel leaves (defer_merge), batch 1 gained 2% (single stream 1,395-1,400 against 1,368-1,371 tok/s); leaving
# batch 8's 8 splits to o_proj too was 2.3% slower (twenty-sixth session).
MAX_SPLITS_MERGED_BY_THE_LAST = 8


def _merge_heads(group: int, num_splits: int) -> int:
    """Heads the last split merges at once: the largest power of two dividing its group that keeps their
    partials to 32 rows of head_dim (32 registers a thread at 4 warps, fewer than the attention loop takes)."""
    heads = 1
    while group % (2 * heads) == 0 and 2 * heads * num_splits <= 32:
        heads *= 2
    return heads


# Registers a thread of the fp8 decode kernel may use. It takes 136 on its own (sm_90, Triton 3.6), which leaves
# room for three 4-warp programs an SM; at 128, four, with no spill and 663 instructions a tile instead of 635.
FP8_MAX_REGISTERS = 128


def _decode_tile(head_dim: int, fp8: bool) -> tuple[int, int, int]:
    """Default (block_n, num_warps, num_stages) of the decode kernel.

    fp8: H200 sweeps of 2026-11-30 (H=16, KVH=8, D=128, 256-token pages), 128/4/2 was the best tile at
    every large shape, before and after V went token-contiguous and the grid went (KVH, B). Last sweep
    (BENCHMARKS.md, twelfth session, call 7): B=256 ctx=1024 3.73 TB/s (88% of copy bandwidth; 128/4/4
    3.72, 128/4/3 3.71), B=256 ctx 100-1124 3.08, B=32 ctx=2048 2.65 at 2 splits, B=8 ctx=4096 1.94 at 8
    splits. Those sweeps ran the fp8 kernel before its keys-major step (seventeenth session), which was
    measured at this tile only: 3.84 TB/s at B=256 ctx=1024 (91% of copy). The bf16 cache keeps 64/4/3.
    """
    if fp8:  # a tile may span pages (then each token looks up its block id)
        return 128, 4, 2
    return min(64, max(16, 8192 // head_dim)), 4, 3


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, *, k_scale=None, v_scale=None,
                           order=None, out=None, num_splits=None, block_n=None, num_warps=None, num_stages=None,
                           from_qkv: NormRopeInputs | None = None,
                           defer_merge: bool = False,
                           staged_v: tuple[torch.Tensor, torch.Tensor] | None = None) -> "torch.Tensor | SplitSoftmax":
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
    from_qkv (q None): the qkv projection instead of q; the kernel computes q as qk_norm_rope would and
    stores the new K/V (not yet in the cache) as its store would.
    staged_v (v, slot_mapping): the newest token's V, quantized (qk_norm_rope's stage_v: fp8 [B, KVH, D]), is
    not yet in the cache (its K and both scales are). The program whose split holds it attends to it first,
    from v, then to the rest of its split, and writes it into the cache after its loop; the output then
    differs from the cached path's by rounding only (the sum's order; that key's weight is not rounded to fp16).
    Writing it before the loop, followed by a barrier, made bench.py 1.3% slower (forty-first session); after,
    0.5% faster than qk_norm_rope's store (forty-second; BENCHMARKS.md).
    defer_merge: where no program of the kernel merges the splits (more than MAX_SPLITS_MERGED_BY_THE_LAST), return
    their partials, a SplitSoftmax, for the kernel that reads the output to merge (skinny_linear does).
    """
    if from_qkv is not None:
        assert q is None, "q comes from from_qkv"
        rows, D = from_qkv.qkv.shape[0], k_cache.shape[-1]
        q = out = torch.empty(rows, from_qkv.num_heads, D, dtype=from_qkv.qkv.dtype, device=k_cache.device) \
            if out is None else out
    B, H, D = q.shape
    _, page, kvh, _ = k_cache.shape
    precision = check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, out)
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
    last_split_merges = num_splits <= MAX_SPLITS_MERGED_BY_THE_LAST
    if num_splits > 1:  # per-split running max, sum and unnormalized output
        part_max = torch.empty(B, H, num_splits, device=q.device, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(B, H, num_splits, D, device=q.device, dtype=torch.float32)
        # (The heuristic splits only batches of B * KVH <= 2 * SMs rows: the first 1,024 counts last.)
        split_counts = arrival_counts("decode splits", B * kvh, q.device) if last_split_merges else out  # else unused
    else:
        part_max = part_sum = part_acc = split_counts = out  # unused
    strides = paged_strides(k_cache, v_cache, k_scale, block_tables)
    pdl = pdl_enabled(q.device)
    qkv_args, qkv_splits, has_norm = _from_qkv_args(from_qkv, out)
    if staged_v is not None:
        assert from_qkv is None and fp8 and staged_v[0].shape == (B, kvh, D) and staged_v[0].is_contiguous()
        qkv_args = (*qkv_args[:-1], staged_v[1])  # the slot mapping
    staged_v_ptr = out if staged_v is None else staged_v[0]
    _decode_kernel[(num_splits, kvh, B)](
        q, k_cache, v_cache, *scale_ptrs(k_cache, v_cache, k_scale, v_scale), block_tables, context_lens,
        context_lens if order is None else order, out, part_acc, part_max, part_sum, split_counts, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *strides, *qkv_args, staged_v_ptr,
        G=G, G_PAD=max(8 if fp8 else 16, triton.next_power_of_2(G)), D=D, PAGE=page, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, DOT_PRECISION=precision, FP8=fp8, FP8_COMPUTE=fp8_compute_dtype(q),
        ORDERED=order is not None, PDL=pdl,
        PREFETCH=num_splits >= PREFETCH_MIN_SPLITS, LAST_SPLIT_MERGES=last_split_merges,
        MERGE_HEADS=_merge_heads(G, num_splits), FROM_QKV=from_qkv is not None, QKV_SPLITS=qkv_splits,
        HAS_NORM=has_norm, NUM_KV_HEADS=kvh, STAGED_V=staged_v is not None, num_warps=num_warps,
        num_stages=num_stages, launch_pdl=pdl,
        # from_qkv: no FMA contraction, so that q and k round as qk_norm_rope's (which says why)
        enable_fp_fusion=from_qkv is None, **({"maxnreg": FP8_MAX_REGISTERS} if fp8 else {}),
    )
    if num_splits > 1 and not last_split_merges:
        partials = SplitSoftmax(part_acc, part_max, part_sum, out.dtype)
        return partials if defer_merge else partials.merge(out)
    return out


def _from_qkv_args(from_qkv: NormRopeInputs | None, placeholder: torch.Tensor) -> tuple[tuple, int, bool]:
    """The decode kernel's qkv arguments (qkv, its row and split strides, positions, cos/sin cache and its row
    stride, q/k norm weights, eps, slot mapping), its QKV_SPLITS and HAS_NORM; placeholders without from_qkv."""
    if from_qkv is None:
        return (placeholder, 0, 0, placeholder, placeholder, 0, placeholder, placeholder, 0.0, placeholder), 0, False
    data, splits, split_stride = split_operand(from_qkv.qkv)
    has_norm = from_qkv.q_weight is not None
    cos_sin = from_qkv.cos_sin_cache
    assert cos_sin.dtype == torch.float32 and cos_sin.stride(1) == 1 and data.stride(-1) == 1
    assert from_qkv.slot_mapping.dtype == torch.int64 and from_qkv.positions.shape == (data.shape[-2],)
    weights = (from_qkv.q_weight, from_qkv.k_weight) if has_norm else (placeholder, placeholder)
    return ((data, data.stride(-2), split_stride, from_qkv.positions, cos_sin, cos_sin.stride(0), *weights,
             from_qkv.eps, from_qkv.slot_mapping), splits, has_norm)
