"""Batched logits processing for the sampler, in vLLM's order and with vLLM's definitions:
penalties, then (after temperature) min-p, then top-k and top-p. Every function works on a float32
[num_rows, vocab] tensor in place; a row whose setting is off is left unchanged.
"""

import torch


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


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      num_candidates: int | None = None) -> torch.Tensor:
    """top_k: [rows] int64 (vocab = off) keeps the k largest logits (and ties with the k-th);
    top_p: [rows] float32 (1 = off) keeps the smallest set of most likely tokens whose probability
    reaches top_p (at least the most likely token), after top-k.

    `num_candidates` (at least every row's k; given when every row with top_p < 1 also has a top_k)
    lets the rows be filtered from their largest num_candidates logits instead of a full sort."""
    if num_candidates is not None:
        return _top_k_top_p_from_candidates(logits, top_k, top_p, num_candidates)
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        kth = sorted_logits.gather(1, (logits.shape[1] - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, -float("inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    drop = cumulative <= 1 - top_p.unsqueeze(1)  # the tail whose total stays within 1 - top_p
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, -float("inf"))
    return logits.scatter_(1, order, sorted_logits)


def _top_k_top_p_from_candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None,
                                 num_candidates: int) -> torch.Tensor:
    """Both filters keep every logit at or above a per-row threshold, found among the row's
    `num_candidates` largest logits (a partial sort, and no host sync): the k-th largest, raised by
    top-p to the last of the most likely candidates whose mass reaches top_p. Rows filtering nothing
    get -inf. Ties with the threshold are kept (the sort path may cut through a tie in top-p)."""
    values = logits.topk(num_candidates, dim=-1).values  # [rows, candidates], descending
    position = torch.arange(num_candidates, device=logits.device)
    off = top_k >= logits.shape[1]
    in_top_k = position < top_k.unsqueeze(1)  # [rows, candidates]
    last = (top_k.clamp(max=num_candidates) - 1).unsqueeze(1)  # last kept position, [rows, 1]
    if top_p is not None:
        probs = values.masked_fill(~in_top_k, -float("inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # of the more likely candidates
        keep = in_top_k & ((mass_before < top_p.unsqueeze(1)) | (top_p.unsqueeze(1) >= 1))
        # The most likely candidate is always kept (clamped for a row of NaN logits, which keeps none).
        last = torch.minimum(last, keep.sum(dim=-1, keepdim=True) - 1).clamp_(min=0)
    threshold = values.gather(1, last).masked_fill_(off.unsqueeze(1), -float("inf"))
    return logits.masked_fill_(logits < threshold, -float("inf"))
