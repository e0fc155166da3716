"""The one-pass sampler: per row, argmax of logit / T + Gumbel noise (greedy rows: of the logit),
over the columns a threshold keeps, with counter-based Philox noise (sampling/sampler.py)."""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanovllm.kernels.device import arrival_counts, num_sms


@triton.jit
def _uniforms(seed, first_group, BLOCK: tl.constexpr):
    """[BLOCK] uniforms for BLOCK columns from a multiple of 4: column 4j + i is output i of Philox
    counter first_group + j, so a column's draw does not depend on how the row is blocked."""
    r0, r1, r2, r3 = tl.rand4x(seed, first_group + tl.arange(0, BLOCK // 4))
    return tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK])


@triton.jit
def _gumbel(uniform, FAST_LOG: tl.constexpr):
    if FAST_LOG:
        gumbel = -libdevice.fast_logf(-libdevice.fast_logf(uniform))
    else:
        gumbel = -tl.log(-tl.log(uniform))
    return gumbel


@triton.jit
def _sample_kernel(logits_ptr, logits_stride, temperatures_ptr, thresholds_ptr, row_seeds_ptr,
                   scores_ptr, tokens_ptr, arrivals_ptr, out_ptr, seed_ptr, vocab_size, chunk_size,
                   FILTERED: tl.constexpr, ROW_SEEDS: tl.constexpr, BLOCK: tl.constexpr,
                   MAX_CHUNKS: tl.constexpr, FAST_LOG: tl.constexpr):
    """Program (row, chunk): the chunk's best score and token into [rows, chunks] partials; the
    row's last program (arrivals [rows]) writes the best chunk's token. MAX_CHUNKS 1: one chunk."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    seed = tl.load(seed_ptr)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0
    inv_temperature = 1.0 / tl.where(greedy, 1.0, temperature)
    first_group = row * tl.cdiv(vocab_size, 4)
    if ROW_SEEDS:  # a seeded row (key >= 0) draws from its key alone, wherever it is in the batch
        row_seed = tl.load(row_seeds_ptr + row)
        first_group = tl.where(row_seed >= 0, 0, first_group)
        seed = tl.where(row_seed >= 0, row_seed, seed)
    threshold = tl.load(thresholds_ptr + row) if FILTERED else -float("inf")
    begin = chunk * chunk_size
    end = tl.minimum(begin + chunk_size, vocab_size)
    best_score = -float("inf")
    best_token = begin
    for start in range(begin, end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < end
        logits = tl.load(logits_ptr + row * logits_stride + cols, mask=mask,
                         other=-float("inf")).to(tl.float32)
        gumbel = _gumbel(_uniforms(seed, first_group + start // 4, BLOCK), FAST_LOG)
        scores = tl.where(greedy, logits, logits * inv_temperature + gumbel)
        scores = tl.where(mask & (logits >= threshold), scores, -float("inf"))
        block_best, block_token = tl.max(scores, axis=0, return_indices=True,
                                         return_indices_tie_break_left=True)
        better = block_best > best_score  # strict: the earliest maximum wins, as torch.argmax
        best_token = tl.where(better, start + block_token, best_token)
        best_score = tl.where(better, block_best, best_score)
    if MAX_CHUNKS == 1:
        tl.store(out_ptr + row, best_token)
    else:
        num_chunks = tl.num_programs(1)
        partial = row * num_chunks + chunk
        tl.store(scores_ptr + partial, best_score)
        tl.store(tokens_ptr + partial, best_token)
        # Every thread's stores come before the count (one thread's atomic releases them).
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel", scope="gpu") == num_chunks - 1:
            chunks = tl.arange(0, MAX_CHUNKS)
            # .cg: the other programs' partials from L2, past this SM's L1
            scores = tl.load(scores_ptr + row * num_chunks + chunks, mask=chunks < num_chunks,
                             other=-float("inf"), cache_modifier=".cg")
            _, best_chunk = tl.max(scores, axis=0, return_indices=True,
                                   return_indices_tie_break_left=True)
            token = tl.load(tokens_ptr + row * num_chunks + best_chunk, cache_modifier=".cg")
            tl.store(out_ptr + row, token)
            tl.store(arrivals_ptr + row, 0)


CHUNK_BLOCK = 1024  # columns per block, and the smallest chunk, when rows are split


def sample_triton(logits: torch.Tensor, temperatures: torch.Tensor, seed: int | torch.Tensor,
                  num_chunks: int | None = None, thresholds: torch.Tensor | None = None,
                  row_seeds: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [rows, vocab] -> [rows] int64, each row over `num_chunks` programs; thresholds [rows]:
    the smallest logit each row keeps; row_seeds [rows]: Philox keys, -1 for rows drawing `seed`."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1
    if isinstance(seed, int):
        seed = torch.tensor([seed], dtype=torch.int64, device=logits.device)
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_chunks is None:
        num_chunks = max(1, 8 * num_sms(logits.device) // num_rows) if logits.is_cuda else 1
    if num_chunks == 1:
        block = min(4096, max(16, triton.next_power_of_2(vocab_size)))
        num_warps, chunk_size = 8, vocab_size
    else:
        block, num_warps = CHUNK_BLOCK, 4
        chunk_size = triton.cdiv(triton.cdiv(vocab_size, num_chunks), block) * block
        num_chunks = triton.cdiv(vocab_size, chunk_size)
    if num_chunks == 1:
        scores = tokens = arrivals = out
    else:
        scores = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
        tokens = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=logits.device)
        arrivals = arrival_counts("sampler chunks", num_rows, logits.device)
    _sample_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), temperatures, thresholds, row_seeds, scores, tokens, arrivals,
        out, seed, vocab_size, chunk_size, FILTERED=thresholds is not None,
        ROW_SEEDS=row_seeds is not None, BLOCK=block, MAX_CHUNKS=triton.next_power_of_2(num_chunks),
        FAST_LOG=logits.is_cuda, num_warps=num_warps)
    return out
