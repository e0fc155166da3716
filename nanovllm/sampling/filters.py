"""min-p, top-k and top-p as one threshold per row: the smallest logit the row keeps."""

import math

import torch

from nanovllm.kernels.sampling_filters import top_p_search
from nanovllm.sampling.logits_processor import last_kept_candidate


def filter_thresholds(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                      max_top_k: int | None, top_p_without_top_k: bool,
                      num_chunks: int | None = None) -> torch.Tensor:
    """logits [rows, vocab], settings as in SamplingMetadata -> [rows] float32: the smallest logit
    each row keeps (-inf: all, as greedy rows do); top_p_without_top_k: some row must search."""
    num_rows, vocab_size = logits.shape
    sampled = temperatures > 0
    inv_temperature = 1.0 / torch.where(sampled, temperatures, 1.0)
    threshold = torch.full((num_rows,), -math.inf, dtype=torch.float32, device=logits.device)
    row_max = None
    if min_p is not None or top_p_without_top_k:
        row_max = logits.amax(dim=1).float()
    if min_p is not None:  # log(0) = -inf: rows without min-p keep everything
        threshold = torch.where(sampled, row_max + torch.log(min_p) / inv_temperature, threshold)
    if top_k is not None:
        with_top_k = sampled & (top_k < vocab_size)
        values = logits.topk(max_top_k, dim=1).values
        after_min_p = values < threshold.unsqueeze(1)
        tempered = (values.float() * inv_temperature.unsqueeze(1)).masked_fill_(after_min_p,
                                                                                -math.inf)
        kth = values.gather(1, last_kept_candidate(tempered, top_k, top_p)).squeeze(1).float()
        threshold = torch.where(with_top_k, torch.maximum(threshold, kth), threshold)
    else:
        with_top_k = torch.zeros_like(sampled)
    if top_p_without_top_k:
        searched = top_p_search(logits, sampled & (top_p < 1) & ~with_top_k, top_p, threshold,
                                 row_max, inv_temperature, num_chunks)
        threshold = torch.maximum(threshold, searched)
    return threshold
