"""min-p, top-k and top-p on the GPU as one threshold per row, without sorting the vocabulary.

Each filter keeps the logits at or above a threshold of the row, in raw-logit order (temperature
scales a row without reordering it):
- min-p keeps p_v >= min_p * p_max, i.e. logit_v >= max + T * log(min_p);
- top-k keeps the logits at or above the k-th largest;
- top-p, after min-p and top-k, keeps the most likely tokens until their probability reaches top_p:
  the logits at or above the largest t whose mass above t (softmax at temperature T, over what min-p
  and top-k kept) reaches top_p of the kept mass.

Rows with top-k find both top-k and top-p thresholds among their k largest logits (torch.topk, as
the CPU path does). A row with top-p but no top-k has no such bound, so its threshold is searched
for over the whole row: a radix search over the order-preserving integer keys of the floats finds t
exactly, 4 key bits per pass (8 for a single row): each pass reads the row once and weighs the 16
(256) buckets of the current key range, plus the logits above it; the row's last program then keeps
the highest bucket whose mass from the top still reaches the target. 16-bit keys (bf16 logits) take
4 passes, 32-bit keys (float32, e.g. penalised) 8; half that for a single row. The passes are a fixed
number, so nothing waits for the GPU. Rows that do not search skip every pass.
"""

import math

import torch
import triton
import triton.language as tl

from nanovllm.kernels.device import num_sms
from nanovllm.sampling.logits_processor import last_kept_candidate

# Key bits per search pass: 4, or 8 for a batch of at most FEW_ROWS rows, whose passes are cheap on the GPU
# but cost a kernel launch each on the host: half the passes for 16x the work per logit (H200: a pass
# over one row takes ~10 us either way, but 8 rows at 8 bits take ~170-250 us a pass).
FEW_ROWS = 1
BLOCK_BUCKETS = 8192  # columns per loop step times buckets


@triton.jit
def _float_key(values, KEY_SHIFT: tl.constexpr):
    """float32 -> int32 keys ordered as the floats: the bits shifted right by KEY_SHIFT (16 for bfloat16
    values, whose low 16 bits are zero), then the magnitude bits of negative floats flipped."""
    bits = values.to(tl.int32, bitcast=True) >> KEY_SHIFT
    return bits ^ ((bits >> 31) & (0x7FFFFFFF >> KEY_SHIFT))


@triton.jit
def _key_float(key, KEY_SHIFT: tl.constexpr):
    """The inverse of _float_key (exact for float32 keys, and for bfloat16 keys with KEY_SHIFT 16)."""
    bits = key.to(tl.int32)
    return ((bits ^ ((bits >> 31) & (0x7FFFFFFF >> KEY_SHIFT))) << KEY_SHIFT).to(tl.float32, bitcast=True)


@triton.jit
def _keys_and_weights(logits_ptr, cols, end, lo, shift, floor, row_max, scale, KEY_SHIFT: tl.constexpr):
    """For the columns `cols` (any shape) of a row: each logit's key, its bucket in the range
    [lo, lo + buckets << shift) (a larger number outside it), and its probability mass (unnormalised:
    exp((logit - row max) / T), 0 under the floor and for columns past `end`)."""
    mask = cols < end
    logits = tl.load(logits_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.where(mask & (logits >= floor), tl.exp2((logits - row_max) * scale), 0.0)
    key = _float_key(logits, KEY_SHIFT)
    # key - lo wraps for keys under lo, to at least 16 << shift (lo + 16 << shift never passes the top key).
    bucket = (key - lo).to(tl.uint32, bitcast=True) >> shift.to(tl.uint32)
    return key, bucket, weight


@triton.jit
def _narrow(row, weights_ptr, num_chunks, lo_ptr, lo, shift, target_ptr, threshold_ptr, FIRST: tl.constexpr,
            KEY_SHIFT: tl.constexpr, NUM_BUCKETS: tl.constexpr, NUM_BINS: tl.constexpr):
    """lo moves to the highest bucket whose mass from the top (its own, the buckets above it and the
    logits above the range) reaches the target. The first pass also sets the target: top_p (in target)
    times the whole kept mass. threshold = the float of lo, final after the last pass."""
    index = tl.arange(0, NUM_BUCKETS)
    chunk = tl.arange(0, 64)
    buckets = tl.zeros([NUM_BUCKETS], dtype=tl.float32)
    above = 0.0
    for first in range(0, num_chunks, 64):  # sum the chunks' partial weights, 64 chunks at a time
        base = weights_ptr + (row * num_chunks + first + chunk) * NUM_BINS
        valid = first + chunk < num_chunks
        # .cg: read what the other programs wrote (through L2), not a stale L1 line.
        buckets += tl.sum(tl.load(base[:, None] + index[None, :], mask=valid[:, None], other=0.0,
                                  cache_modifier=".cg"), axis=0)
        above += tl.sum(tl.load(base + NUM_BUCKETS, mask=valid, other=0.0, cache_modifier=".cg"), axis=0)
    # from_top[j] = W(key >= start of bucket j), falling as j rises.
    from_top = above + tl.sum(tl.where(index[None, :] >= index[:, None], buckets[None, :], 0.0), axis=1)
    target = tl.load(target_ptr + row)
    if FIRST:  # the range is every key: from_top[0] is the whole kept mass
        target *= tl.max(from_top, axis=0)
        tl.store(target_ptr + row, target)
    # W(>= lo) >= target holds from pass to pass (the same sums in the same order); at least keep lo.
    bucket = tl.max(tl.where(from_top >= target, index, 0), axis=0)
    lo = (lo.to(tl.int64) + (bucket.to(tl.int64) << shift.to(tl.int64))).to(tl.int32)
    tl.store(lo_ptr + row, lo)
    tl.store(threshold_ptr + row, _key_float(lo, KEY_SHIFT))


# `shift` changes every pass: specialising on it (divisible by 16 or not) would compile two variants.
@triton.jit(do_not_specialize=["shift"])
def _search_pass_kernel(logits_ptr, logits_stride, vocab_size, chunk_size, active_ptr, lo_ptr, shift, floor_ptr,
                        row_max_ptr, inv_temperature_ptr, weights_ptr, arrivals_ptr, target_ptr, threshold_ptr,
                        FIRST: tl.constexpr, KEY_SHIFT: tl.constexpr, NUM_BUCKETS: tl.constexpr,
                        NUM_BINS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, chunk): the mass of the chunk's logits in each bucket of the row's key range
    [lo, lo + NUM_BUCKETS << shift) (bucket b: keys lo + [b << shift, (b + 1) << shift)), and in bin
    NUM_BUCKETS the mass above the range, into weights [rows, chunks, NUM_BINS]; the row's last
    program to finish (counted in arrivals) then narrows the range.
    Each column is compared with every bucket in a [BLOCK, NUM_BUCKETS] layout that the columns, loaded
    as [BLOCK, 1], broadcast into without a shuffle (loaded as [BLOCK] they cost ~5x more, measured)."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    if tl.load(active_ptr + row) != 0:
        lo = tl.load(lo_ptr + row)
        top = tl.minimum(lo.to(tl.int64) + (NUM_BUCKETS << shift.to(tl.int64)) - 1, 2**31 - 1)  # last key in range
        floor = tl.load(floor_ptr + row)
        row_max = tl.load(row_max_ptr + row)
        scale = tl.load(inv_temperature_ptr + row) * 1.4426950408889634  # log2(e) / T
        row_ptr = logits_ptr + row * logits_stride
        begin = chunk * chunk_size
        end = tl.minimum(begin + chunk_size, vocab_size)
        buckets = tl.zeros([BLOCK, NUM_BUCKETS], dtype=tl.float32)
        above = tl.zeros([BLOCK, 1], dtype=tl.float32)
        for start in range(begin, end, BLOCK):
            key, bucket, weight = _keys_and_weights(row_ptr, start + tl.arange(0, BLOCK)[:, None], end, lo, shift,
                                                    floor, row_max, scale, KEY_SHIFT)
            above += tl.where(key > top, weight, 0.0)
            hit = bucket == tl.arange(0, NUM_BUCKETS)[None, :].to(tl.uint32)
            buckets += tl.where(hit, weight, 0.0)
        num_chunks = tl.num_programs(1)
        out = weights_ptr + (row * num_chunks + chunk) * NUM_BINS
        tl.store(out + tl.arange(0, NUM_BUCKETS), tl.sum(buckets, axis=0))
        tl.store(out + NUM_BUCKETS, tl.sum(tl.reshape(above, [BLOCK]), axis=0))
        # acq_rel: the stores above are visible to the program that arrives last, which sees all of them.
        if tl.atomic_add(arrivals_ptr + row, 1) == num_chunks - 1:
            tl.store(arrivals_ptr + row, 0)  # ready for the next pass
            _narrow(row, weights_ptr, num_chunks, lo_ptr, lo, shift, target_ptr, threshold_ptr, FIRST, KEY_SHIFT,
                    NUM_BUCKETS, NUM_BINS)


def _top_p_search(logits: torch.Tensor, active: torch.Tensor, top_p: torch.Tensor, floor: torch.Tensor,
                  row_max: torch.Tensor, inv_temperature: torch.Tensor, num_chunks: int | None = None) -> torch.Tensor:
    """For each active row, the largest logit t with mass(floor <= logits >= t) >= top_p x mass(logits >=
    floor); -inf for the other rows. Each row is split over `num_chunks` programs (by default, on
    CUDA, rows x chunks is about four programs per SM, or one with 8-bit buckets)."""
    num_rows, vocab_size = logits.shape
    key_bits = 16 if logits.dtype == torch.bfloat16 else 32
    bucket_bits = 8 if num_rows <= FEW_ROWS else 4
    num_buckets = 1 << bucket_bits
    lo = torch.full((num_rows,), -(1 << (key_bits - 1)), dtype=torch.int32, device=logits.device)  # every key
    threshold = torch.full((num_rows,), -math.inf, dtype=torch.float32, device=logits.device)
    if num_chunks is None:
        programs_per_sm = 4 if bucket_bits == 4 else 1  # with 8 bits, fewer partials for the last program to sum
        num_chunks = max(1, programs_per_sm * num_sms(logits.device) // num_rows) if logits.is_cuda else 1
    block = min(BLOCK_BUCKETS // num_buckets, triton.next_power_of_2(vocab_size))
    chunk_size = triton.cdiv(triton.cdiv(vocab_size, num_chunks), block) * block
    num_chunks = triton.cdiv(vocab_size, chunk_size)
    # Per program and pass: the buckets' masses, then the mass above the range (at num_buckets).
    weights = torch.empty(num_rows, num_chunks, 2 * num_buckets, dtype=torch.float32, device=logits.device)
    arrivals = torch.zeros(num_rows, dtype=torch.int32, device=logits.device)
    target = top_p.to(torch.float32, copy=True)  # becomes top_p x the kept mass in the first pass
    active = active.to(torch.int8)
    for shift in range(key_bits - bucket_bits, -1, -bucket_bits):
        _search_pass_kernel[(num_rows, num_chunks)](
            logits, logits.stride(0), vocab_size, chunk_size, active, lo, shift, floor, row_max,
            inv_temperature, weights, arrivals, target, threshold, FIRST=shift == key_bits - bucket_bits,
            KEY_SHIFT=32 - key_bits, NUM_BUCKETS=num_buckets, NUM_BINS=2 * num_buckets, BLOCK=block, num_warps=8)
    return threshold


def filter_thresholds(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None, min_p: torch.Tensor | None, max_top_k: int | None,
                      top_p_without_top_k: bool, num_chunks: int | None = None) -> torch.Tensor:
    """logits: [rows, vocab] (rows contiguous); the settings are [rows] tensors as in SamplingMetadata
    (None when no row uses them); max_top_k: the largest k of the rows with top-k; top_p_without_top_k:
    whether some row has top-p but no top-k (it then takes the search). -> [rows] float32: the smallest
    raw logit each row keeps (-inf for rows that keep everything, and for greedy rows, which ignore
    the filters). num_chunks: programs per row of the search (default: see _top_p_search)."""
    num_rows, vocab_size = logits.shape
    sampled = temperatures > 0
    inv_temperature = 1.0 / torch.where(sampled, temperatures, 1.0)
    threshold = torch.full((num_rows,), -math.inf, dtype=torch.float32, device=logits.device)
    row_max = None
    if min_p is not None or top_p_without_top_k:
        row_max = logits.amax(dim=1).float()
    if min_p is not None:  # log(0) = -inf: rows without min-p keep everything
        threshold = torch.where(sampled, row_max + torch.log(min_p) / inv_temperature, threshold)
    with_top_k = sampled & (top_k < vocab_size) if top_k is not None else torch.zeros_like(sampled)
    if top_k is not None:  # top-k, and top-p within it, among each row's max_top_k largest logits
        values = logits.topk(max_top_k, dim=1).values  # [rows, max_top_k], descending
        tempered = (values.float() * inv_temperature.unsqueeze(1)).masked_fill_(values < threshold.unsqueeze(1),
                                                                                -math.inf)  # after min-p
        last = last_kept_candidate(tempered, top_k, top_p)
        threshold = torch.where(with_top_k, torch.maximum(threshold, values.gather(1, last).squeeze(1).float()),
                                threshold)
    if top_p_without_top_k:
        searched = _top_p_search(logits, sampled & (top_p < 1) & ~with_top_k, top_p, threshold, row_max,
                                 inv_temperature, num_chunks)
        threshold = torch.maximum(threshold, searched)
    return threshold
