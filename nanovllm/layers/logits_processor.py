"""Batched logits processing for the sampler, in vLLM's order and with vLLM's definitions:
penalties, then (after temperature) min-p, then top-k and top-p. Every function works on a float32
[num_rows, vocab] tensor in place; a row whose setting is off is left unchanged.
"""

import torch
import triton
import triton.language as tl


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """token_ids: [rows, len] padded with `vocab_size` -> [rows, vocab] occurrence counts (float32)."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, prompt_ids: torch.Tensor, output_ids: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """logits: [rows, vocab]; prompt_ids / output_ids: [rows, len] padded with vocab; penalties: [rows].

    repetition divides the positive logits and multiplies the negative logits of every token seen in
    the prompt or the output; frequency is subtracted once per occurrence in the output, presence once
    for any occurrence in the output.
    """
    vocab_size = logits.shape[1]
    output_counts = token_counts(output_ids, vocab_size)  # [rows, vocab]
    seen = (token_counts(prompt_ids, vocab_size) > 0) | (output_counts > 0)
    repetition = torch.where(seen, repetition.unsqueeze(1), 1.0)
    logits.mul_(torch.where(logits > 0, 1.0 / repetition, repetition))
    logits.sub_(frequency.unsqueeze(1) * output_counts)
    logits.sub_(presence.unsqueeze(1) * (output_counts > 0))
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p [rows] times the row's largest probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, -float("inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """top_k: [rows] int64 (vocab = off) keeps the k largest logits (and ties with the k-th);
    top_p: [rows] float32 (1 = off) keeps the smallest set of most likely tokens whose probability
    reaches top_p (at least the most likely token), among the tokens top-k kept. On CUDA a bisection
    kernel finds the cut-offs without sorting (`top_k_top_p_bisect`); elsewhere the sort is the definition."""
    if logits.is_cuda:
        return top_k_top_p_bisect(logits, top_k, top_p)
    return top_k_top_p_sort(logits, top_k, top_p)


def top_k_top_p_sort(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's definition by sorting each row (see `apply_top_k_top_p`)."""
    if top_p is None:  # a partial sort is enough: the k-th largest logit is the threshold
        off = top_k == logits.shape[1]
        k = top_k.masked_fill(off, 1)
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, k.unsqueeze(1) - 1)  # [rows, 1]
        return logits.masked_fill_(logits < kth.masked_fill_(off.unsqueeze(1), -float("inf")), -float("inf"))
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        kth = sorted_logits.gather(1, (logits.shape[1] - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, -float("inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    drop = cumulative <= 1 - top_p.unsqueeze(1)  # the tail whose total stays within 1 - top_p
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, -float("inf"))
    return logits.scatter_(1, order, sorted_logits)


@triton.jit
def _key(x):
    """float32 -> int32 in the same order, -inf lowest: consecutive keys are adjacent float values."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _value(key):
    """The float32 of an (int64) key: the inverse of _key."""
    key = key.to(tl.int32)
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _top_k_top_p_kernel(logits_ptr, logits_stride, top_k_ptr, top_p_ptr, vocab_size,
                        HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row, masking the row in place. Each cut-off is the largest threshold t that still
    keeps enough of the row (count(logits >= t) >= k, then mass(logits >= t) >= top_p), found by bisection
    on the keys of t: `lo` always keeps enough, `hi` never does, and the search ends when they are
    adjacent keys, i.e. after at most 32 passes over the row, on the exact float32 cut-off. Columns past
    the vocabulary load as -inf: never counted (every t tried is above -inf) and of probability 0."""
    row_ptr = logits_ptr + tl.program_id(0).to(tl.int64) * logits_stride
    row_max = -float("inf")
    row_min = float("inf")
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        x = tl.load(row_ptr + cols, mask=mask, other=-float("inf"))
        row_max = tl.maximum(row_max, tl.max(x, axis=0))
        row_min = tl.minimum(row_min, tl.min(tl.where(mask, x, float("inf")), axis=0))
    lo = _key(row_min).to(tl.int64)  # keeps the whole row
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + tl.program_id(0))
        # Top-k: lo ends on the k-th largest logit; no search when off.
        hi = tl.where(k < vocab_size, _key(row_max).to(tl.int64) + 1, lo + 1)
        while lo + 1 < hi:
            mid = lo + (hi - lo) // 2
            t = _value(mid)
            count = 0
            for start in range(0, vocab_size, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=-float("inf"))
                count += tl.sum((x >= t).to(tl.int32), axis=0)
            enough = count >= k
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
    if HAS_TOP_P:
        p = tl.load(top_p_ptr + tl.program_id(0))
        # Top-p, on the probabilities renormalised over the tokens top-k kept (the row max among them).
        cut = _value(lo)
        total = 0.0
        for start in range(0, vocab_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=-float("inf"))
            total += tl.sum(tl.where(x >= cut, tl.exp(x - row_max), 0.0), axis=0)
        # Above the max the mass is 0 < top_p * total: the cut-off stays at most the max, which is kept.
        # No search when off.
        hi = tl.where(p < 1, _key(row_max).to(tl.int64) + 1, lo + 1)
        while lo + 1 < hi:
            mid = lo + (hi - lo) // 2
            t = _value(mid)
            mass = 0.0
            for start in range(0, vocab_size, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=-float("inf"))
                mass += tl.sum(tl.where(x >= t, tl.exp(x - row_max), 0.0), axis=0)
            enough = mass >= p * total
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
    cut = _value(lo)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        x = tl.load(row_ptr + cols, mask=mask, other=0.0)
        tl.store(row_ptr + cols, -float("inf"), mask=mask & (x < cut))


def top_k_top_p_bisect(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """`apply_top_k_top_p` without sorting: per row, bisection for the logit cut-off (see the kernel).

    Ties at a cut-off are kept. Top-k then keeps exactly what the sort keeps. Top-p keeps every token
    equal to the last one it needs, where the sort counts tied tokens one by one and may keep only
    some of them: on a tie straddling the cut-off, bisection keeps a few more tokens (never fewer);
    without ties, both keep the same set. (A top_p = 1 row is left as it is, where the sort also drops
    the tokens whose probability underflows to 0: they cannot be sampled either way.)"""
    num_rows, vocab_size = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    _top_k_top_p_kernel[(num_rows,)](logits, logits.stride(0), logits if top_k is None else top_k,
                                     logits if top_p is None else top_p, vocab_size, HAS_TOP_K=top_k is not None,
                                     HAS_TOP_P=top_p is not None, BLOCK=4096, num_warps=8)
    return logits
