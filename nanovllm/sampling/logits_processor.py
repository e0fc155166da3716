"""Batched logits processing for the sampler, in vLLM's order and with vLLM's definitions:
penalties, then (after temperature) min-p, then top-k and top-p. Every function works on a float32
[num_rows, vocab] tensor in place; a row whose setting is off is left unchanged.
"""

import torch


def apply_penalties(logits: torch.Tensor, ids: torch.Tensor, prompt_lens: torch.Tensor, repetition: torch.Tensor,
                    frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """logits: [rows, vocab]; ids: [rows, len] each row's prompt then output token ids, padding (the
    id vocab) anywhere; prompt_lens: [rows, 1], the columns of the prompt; penalties: [rows] (rows whose
    ids are all padding must have neutral penalties).

    repetition divides the positive logits and multiplies the negative logits of every token seen in
    the prompt or the output; frequency is subtracted once per occurrence in the output, presence once
    for any occurrence in the output.

    Only the seen tokens' logits are read and written: the ids are sorted per row, so a token's
    occurrences form a run, and every position of a run writes the same penalised value.
    """
    vocab_size = logits.shape[1]
    in_output = torch.arange(ids.shape[1], device=ids.device) >= prompt_lens  # [rows, len]
    ids, order = ids.sort(dim=1)  # padding last
    in_output = (in_output.gather(1, order) & (ids < vocab_size)).float()
    # Padding joins the run of the row's last token (with no occurrence), or is token vocab-1 in a row
    # without tokens, whose neutral penalties leave it unchanged.
    last_token = (ids < vocab_size).sum(dim=1, keepdim=True).sub_(1).clamp_(min=0)
    ids = torch.where(ids < vocab_size, ids, ids.gather(1, last_token)).clamp_(max=vocab_size - 1)
    # Output occurrences per run: the running count at the run's end minus the count before its start.
    running = in_output.cumsum(dim=1)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    ends = torch.ones_like(ids, dtype=torch.bool)
    ends[:, :-1] = starts[:, 1:]
    before = torch.where(starts, running - in_output, -1.0).cummax(dim=1).values
    at_end = torch.where(ends, running, float("inf")).flip(1).cummin(dim=1).values.flip(1)
    counts = at_end - before
    values = logits.gather(1, ids)
    repetition = repetition.unsqueeze(1)
    values = torch.where(values > 0, values / repetition, values * repetition)
    values = values - frequency.unsqueeze(1) * counts
    values = values - presence.unsqueeze(1) * (counts > 0)
    return logits.scatter_(1, ids, values)


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
    `num_candidates` largest logits (a partial sort, and no host sync). Rows filtering nothing get
    -inf. Ties with the threshold are kept (the sort path may cut through a tie in top-p)."""
    values = logits.topk(num_candidates, dim=-1).values  # [rows, candidates], descending
    threshold = values.gather(1, last_kept_candidate(values, top_k, top_p))
    threshold.masked_fill_((top_k >= logits.shape[1]).unsqueeze(1), -float("inf"))
    return logits.masked_fill_(logits < threshold, -float("inf"))


def last_kept_candidate(values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None) -> torch.Tensor:
    """values: each row's largest tempered logits, descending ([rows, candidates], at least the row's
    k of them; -inf where min-p dropped one) -> [rows, 1]: the position of the last candidate kept, the
    k-th, or before it the last of the most likely candidates whose mass reaches top_p."""
    num_candidates = values.shape[1]
    position = torch.arange(num_candidates, device=values.device)
    in_top_k = position < top_k.unsqueeze(1)  # [rows, candidates]
    last = (top_k.clamp(max=num_candidates) - 1).unsqueeze(1)  # last kept position, [rows, 1]
    if top_p is not None:
        probs = values.masked_fill(~in_top_k, -float("inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # of the more likely candidates
        keep = in_top_k & ((mass_before < top_p.unsqueeze(1)) | (top_p.unsqueeze(1) >= 1))
        # The most likely candidate is always kept (clamped for a row of NaN logits, which keeps none).
        last = torch.minimum(last, keep.sum(dim=-1, keepdim=True) - 1).clamp_(min=0)
    return last
