"""vLLM's logits processors on float32 [rows, vocab] logits, in place: penalties, min-p, top-k/p."""

import torch


def apply_penalties(logits: torch.Tensor, ids: torch.Tensor, prompt_lens: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """ids [rows, len]: prompt then output ids, padded with vocab; prompt_lens [rows, 1]."""
    vocab_size = logits.shape[1]
    in_output = torch.arange(ids.shape[1], device=ids.device) >= prompt_lens
    ids, order = ids.sort(dim=1)
    in_output = (in_output.gather(1, order) & (ids < vocab_size)).float()
    # Padding joins the row's last run, or is id vocab - 1 in an empty row (neutral penalties).
    last_token = (ids < vocab_size).sum(dim=1, keepdim=True).sub_(1).clamp_(min=0)
    ids = torch.where(ids < vocab_size, ids, ids.gather(1, last_token)).clamp_(max=vocab_size - 1)
    # Output occurrences per run of a token: the running count at its end minus that before it.
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
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, -float("inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      num_candidates: int | None = None) -> torch.Tensor:
    """top_k [rows] (vocab = off), then top_p [rows] (1 = off), among num_candidates if given."""
    if num_candidates is not None:
        return _top_k_top_p_from_candidates(logits, top_k, top_p, num_candidates)
    sorted_logits, order = logits.sort(dim=-1)
    if top_k is not None:
        kth = sorted_logits.gather(1, (logits.shape[1] - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, -float("inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    drop = cumulative <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, -float("inf"))
    return logits.scatter_(1, order, sorted_logits)


def _top_k_top_p_from_candidates(logits: torch.Tensor, top_k: torch.Tensor,
                                 top_p: torch.Tensor | None, num_candidates: int) -> torch.Tensor:
    values = logits.topk(num_candidates, dim=-1).values
    threshold = values.gather(1, last_kept_candidate(values, top_k, top_p))
    threshold.masked_fill_((top_k >= logits.shape[1]).unsqueeze(1), -float("inf"))
    return logits.masked_fill_(logits < threshold, -float("inf"))


def last_kept_candidate(values: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor | None) -> torch.Tensor:
    """values [rows, candidates], descending -> [rows, 1]: the last position top-k/p keep."""
    num_candidates = values.shape[1]
    position = torch.arange(num_candidates, device=values.device)
    in_top_k = position < top_k.unsqueeze(1)
    last = (top_k.clamp(max=num_candidates) - 1).unsqueeze(1)
    if top_p is not None:
        probs = values.masked_fill(~in_top_k, -float("inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        keep = in_top_k & ((mass_before < top_p.unsqueeze(1)) | (top_p.unsqueeze(1) >= 1))
        # At least the most likely candidate (clamped for a row of NaN logits, which keeps none).
        last = torch.minimum(last, keep.sum(dim=-1, keepdim=True) - 1).clamp_(min=0)
    return last


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor,
                        bitmask: torch.Tensor) -> torch.Tensor:
    """In place: -inf in logits [n, vocab] at rows [g] where bitmask [g, ceil(vocab / 32)] int32
    has the token's bit clear (word t // 32, bit t % 32); the torch reference of the kernel."""
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(len(bitmask), -1)[:, :vocab_size]
    logits[rows] = logits[rows].masked_fill(allowed == 0, -float("inf"))
    return logits
