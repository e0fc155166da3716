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


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """top_k: [rows] int64 (vocab = off) keeps the k largest logits (and ties with the k-th);
    top_p: [rows] float32 (1 = off) keeps the smallest set of most likely tokens whose probability
    reaches top_p (at least the most likely token)."""
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
