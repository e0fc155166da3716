"""min-p, top-k and top-p as one threshold per row, the smallest logit it keeps: found among a row's
k largest logits if it has top-k, else (top-p alone) by a radix search over order-preserving integer
keys of the logits, 4 key bits a pass (8 for a single row)."""

import math

import torch
import triton
import triton.language as tl

from nanovllm.kernels.device import num_sms

FEW_ROWS = 1  # batches of at most this many rows search 8 key bits a pass (docs/kernels.md)
BLOCK_BUCKETS = 8192  # columns per loop step times buckets


@triton.jit
def _float_key(values, KEY_SHIFT: tl.constexpr):
    """float32 -> int32 keys ordered as the floats (KEY_SHIFT 16: bfloat16 values, 16-bit keys)."""
    bits = values.to(tl.int32, bitcast=True) >> KEY_SHIFT
    return bits ^ ((bits >> 31) & (0x7FFFFFFF >> KEY_SHIFT))


@triton.jit
def _key_float(key, KEY_SHIFT: tl.constexpr):
    bits = key.to(tl.int32)
    bits = (bits ^ ((bits >> 31) & (0x7FFFFFFF >> KEY_SHIFT))) << KEY_SHIFT
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _keys_and_weights(logits_ptr, cols, end, lo, shift, floor, row_max, scale,
                      KEY_SHIFT: tl.constexpr):
    mask = cols < end
    logits = tl.load(logits_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.where(mask & (logits >= floor), tl.exp2((logits - row_max) * scale), 0.0)
    key = _float_key(logits, KEY_SHIFT)
    # key - lo wraps for keys under lo to a bucket past the range
    bucket = (key - lo).to(tl.uint32, bitcast=True) >> shift.to(tl.uint32)
    return key, bucket, weight


@triton.jit
def _narrow(row, weights_ptr, num_chunks, lo_ptr, lo, shift, target_ptr, threshold_ptr,
            FIRST: tl.constexpr, KEY_SHIFT: tl.constexpr, NUM_BUCKETS: tl.constexpr,
            NUM_BINS: tl.constexpr):
    """lo moves to the highest bucket whose mass from the top reaches the target."""
    index = tl.arange(0, NUM_BUCKETS)
    chunk = tl.arange(0, 64)
    buckets = tl.zeros([NUM_BUCKETS], dtype=tl.float32)
    above = 0.0
    for first in range(0, num_chunks, 64):
        base = weights_ptr + (row * num_chunks + first + chunk) * NUM_BINS
        valid = first + chunk < num_chunks
        buckets += tl.sum(tl.load(base[:, None] + index[None, :], mask=valid[:, None], other=0.0,
                                  cache_modifier=".cg"), axis=0)
        above += tl.sum(tl.load(base + NUM_BUCKETS, mask=valid, other=0.0,
                                cache_modifier=".cg"), axis=0)
    upper = index[None, :] >= index[:, None]
    from_top = above + tl.sum(tl.where(upper, buckets[None, :], 0.0), axis=1)
    target = tl.load(target_ptr + row)
    if FIRST:
        target *= tl.max(from_top, axis=0)
        tl.store(target_ptr + row, target)
    # mass(>= lo) >= target holds from pass to pass (the same sums in the same order)
    bucket = tl.max(tl.where(from_top >= target, index, 0), axis=0)
    lo = (lo.to(tl.int64) + (bucket.to(tl.int64) << shift.to(tl.int64))).to(tl.int32)
    tl.store(lo_ptr + row, lo)
    tl.store(threshold_ptr + row, _key_float(lo, KEY_SHIFT))


@triton.jit(do_not_specialize=["shift"])
def _search_pass_kernel(logits_ptr, logits_stride, vocab_size, chunk_size, active_ptr, lo_ptr,
                        shift, floor_ptr, row_max_ptr, inv_temperature_ptr, weights_ptr,
                        arrivals_ptr, target_ptr, threshold_ptr, FIRST: tl.constexpr,
                        KEY_SHIFT: tl.constexpr, NUM_BUCKETS: tl.constexpr,
                        NUM_BINS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, chunk): the chunk's mass per bucket and above them into weights [rows, chunks,
    NUM_BINS]; the row's last program narrows. Columns are [BLOCK, 1]: no shuffle to broadcast."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    if tl.load(active_ptr + row) != 0:
        lo = tl.load(lo_ptr + row)
        top = tl.minimum(lo.to(tl.int64) + (NUM_BUCKETS << shift.to(tl.int64)) - 1, 2**31 - 1)
        floor = tl.load(floor_ptr + row)
        row_max = tl.load(row_max_ptr + row)
        scale = tl.load(inv_temperature_ptr + row) * 1.4426950408889634  # log2(e) / T
        row_ptr = logits_ptr + row * logits_stride
        begin = chunk * chunk_size
        end = tl.minimum(begin + chunk_size, vocab_size)
        buckets = tl.zeros([BLOCK, NUM_BUCKETS], dtype=tl.float32)
        above = tl.zeros([BLOCK, 1], dtype=tl.float32)
        for start in range(begin, end, BLOCK):
            key, bucket, weight = _keys_and_weights(row_ptr, start + tl.arange(0, BLOCK)[:, None],
                                                    end, lo, shift, floor, row_max, scale,
                                                    KEY_SHIFT)
            above += tl.where(key > top, weight, 0.0)
            hit = bucket == tl.arange(0, NUM_BUCKETS)[None, :].to(tl.uint32)
            buckets += tl.where(hit, weight, 0.0)
        num_chunks = tl.num_programs(1)
        out = weights_ptr + (row * num_chunks + chunk) * NUM_BINS
        tl.store(out + tl.arange(0, NUM_BUCKETS), tl.sum(buckets, axis=0))
        tl.store(out + NUM_BUCKETS, tl.sum(tl.reshape(above, [BLOCK]), axis=0))
        # acq_rel: the program that arrives last sees every program's stores.
        if tl.atomic_add(arrivals_ptr + row, 1) == num_chunks - 1:
            tl.store(arrivals_ptr + row, 0)
            _narrow(row, weights_ptr, num_chunks, lo_ptr, lo, shift, target_ptr, threshold_ptr,
                    FIRST, KEY_SHIFT, NUM_BUCKETS, NUM_BINS)


def top_p_search(logits: torch.Tensor, active: torch.Tensor, top_p: torch.Tensor,
                  floor: torch.Tensor, row_max: torch.Tensor, inv_temperature: torch.Tensor,
                  num_chunks: int | None = None) -> torch.Tensor:
    """[rows]: the largest t with mass(>= t) >= top_p x mass(>= floor); -inf for inactive rows."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    key_bits = 16 if logits.dtype == torch.bfloat16 else 32
    bucket_bits = 8 if num_rows <= FEW_ROWS else 4
    num_buckets = 1 << bucket_bits
    lo = torch.full((num_rows,), -(1 << (key_bits - 1)), dtype=torch.int32, device=device)
    threshold = torch.full((num_rows,), -math.inf, dtype=torch.float32, device=device)
    if num_chunks is None:
        programs_per_sm = 4 if bucket_bits == 4 else 1
        num_chunks = max(1, programs_per_sm * num_sms(device) // num_rows) if logits.is_cuda else 1
    block = min(BLOCK_BUCKETS // num_buckets, triton.next_power_of_2(vocab_size))
    chunk_size = triton.cdiv(triton.cdiv(vocab_size, num_chunks), block) * block
    num_chunks = triton.cdiv(vocab_size, chunk_size)
    weights = torch.empty(num_rows, num_chunks, 2 * num_buckets, dtype=torch.float32, device=device)
    arrivals = torch.zeros(num_rows, dtype=torch.int32, device=device)
    target = top_p.to(torch.float32, copy=True)
    active = active.to(torch.int8)
    for shift in range(key_bits - bucket_bits, -1, -bucket_bits):
        _search_pass_kernel[(num_rows, num_chunks)](
            logits, logits.stride(0), vocab_size, chunk_size, active, lo, shift, floor, row_max,
            inv_temperature, weights, arrivals, target, threshold,
            FIRST=shift == key_bits - bucket_bits, KEY_SHIFT=32 - key_bits,
            NUM_BUCKETS=num_buckets, NUM_BINS=2 * num_buckets, BLOCK=block, num_warps=8)
    return threshold
