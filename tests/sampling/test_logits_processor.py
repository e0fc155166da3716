"""The torch logits processors: vLLM's penalties, and top-k / top-p from candidates or a sort."""

import pytest
import torch

from nanovllm.sampling.logits_processor import apply_penalties, apply_top_k_top_p


def test_candidate_filtering_keeps_what_the_sort_keeps():
    """On logits without ties: top-k alone and with top-p, k = 1, no filter, a min-p row."""
    torch.manual_seed(0)
    vocab = 1000
    logits = torch.randn(12, vocab) * 3
    logits[10, 100:] = -float("inf")  # after min-p: fewer finite logits than k
    top_k = torch.tensor([vocab, 5, 40, 40, 40, 1, 40, vocab, 25, 300, 300, 12])
    top_p = torch.tensor([1.0, 1.0, 1e-6, 0.5, 0.93, 0.7, 1.0, 1.0, 0.99, 0.8, 0.9, 0.6])
    for p in (top_p, None):
        expected = apply_top_k_top_p(logits.clone(), top_k,
                                     top_p if p is not None else torch.ones(12))
        got = apply_top_k_top_p(logits.clone(), top_k, p, num_candidates=300)
        assert torch.equal(got.isfinite(), expected.isfinite())
        assert torch.equal(got[got.isfinite()], logits[got.isfinite()])
        kept = got.isfinite().sum(dim=1).tolist()
        if p is None:
            assert kept == [vocab, 5, 40, 40, 40, 1, 40, vocab, 25, 300, 100, 12]
        else:
            assert kept[2] == 1 and kept[3] < 40 and kept[4] < 40
            assert all(a < b for a, b in zip(kept[8:], [25, 300, 100, 12]))


def test_penalties_follow_vllm_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
                           [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    pad = 6
    prompt = torch.tensor([[0, 1, pad], [3, pad, pad]])
    output = torch.tensor([[2, 2, 4], [pad, pad, pad]])
    out = apply_penalties(logits.clone(), torch.cat([prompt, output], dim=1),
                          torch.tensor([[3], [3]]), repetition=torch.tensor([2.0, 1.0]),
                          frequency=torch.tensor([0.5, 0.0]), presence=torch.tensor([0.25, 0.0]))
    # Row 0: seen = {0, 1 (prompt), 2, 4 (output)}; token 2 twice in the output, token 4 once.
    expected0 = [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 * 2 - 0.25, 3.0, -2.0 * 2 - 0.5 - 0.25, 1.0]
    assert out[0].tolist() == pytest.approx(expected0)
    assert torch.equal(out[1], logits[1])  # neutral penalties change nothing


def test_penalties_match_dense_counting_on_random_histories():
    """Sorted runs against dense counts: repeats, padding, a row without history."""
    gen = torch.Generator().manual_seed(6)
    vocab, num_rows = 50, 6
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    prompt = torch.randint(0, 20, (num_rows, 12), generator=gen)
    output = torch.randint(10, 30, (num_rows, 9), generator=gen)
    prompt[1, 7:] = vocab
    output[2, 3:] = vocab
    prompt[5], output[5] = vocab, vocab  # no history: neutral penalties
    repetition = torch.tensor([1.3, 0.8, 2.0, 1.0, 1.1, 1.0])
    frequency = torch.tensor([0.2, 0.0, -0.5, 0.3, 1.0, 0.0])
    presence = torch.tensor([0.5, 0.1, 0.0, -0.2, 0.0, 0.0])
    got = apply_penalties(logits.clone(), torch.cat([prompt, output], dim=1),
                          torch.full((num_rows, 1), 12), repetition, frequency, presence)

    def counts(ids):
        ones = torch.ones(ids.shape)
        return torch.zeros(num_rows, vocab + 1).scatter_add_(1, ids, ones)[:, :vocab]

    output_counts = counts(output)
    seen = (counts(prompt) > 0) | (output_counts > 0)
    rep = torch.where(seen, repetition.unsqueeze(1), 1.0)
    expected = torch.where(logits > 0, logits / rep, logits * rep)
    expected = expected - frequency.unsqueeze(1) * output_counts
    expected = expected - presence.unsqueeze(1) * (output_counts > 0)
    assert torch.equal(got, expected)
