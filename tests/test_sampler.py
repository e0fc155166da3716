"""The sampler: greedy rows exact, sampled rows distributed as the tempered softmax (torch and Triton)."""

import pytest
import torch

from nanovllm.layers.sampler import sample_torch, sample_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sample(impl, logits, temperatures, seed):
    if impl == "triton":
        return sample_triton(logits, temperatures, seed)
    torch.manual_seed(seed)
    return sample_torch(logits, temperatures)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_greedy_rows_are_argmax_in_a_mixed_batch(impl):
    torch.manual_seed(0)
    logits = torch.randn(6, 5000, device=DEVICE)
    logits[1, 4321] = 50.0  # a maximum in a later block of the vocabulary
    logits[3, 7] = logits[3, 9] = 60.0  # a tie: the first index wins, as torch.argmax
    temperatures = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.7, 0.0], device=DEVICE)
    tokens = sample(impl, logits, temperatures, seed=1)
    greedy = temperatures == 0
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
    assert tokens[3].item() == 7


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_frequencies_match_the_tempered_softmax(impl):
    vocab, draws, temperature = 8, 1500, 0.7
    row = torch.linspace(-1.0, 1.0, vocab, device=DEVICE)
    logits = row.expand(draws, vocab).contiguous()  # one row per draw: each gets independent noise
    tokens = sample(impl, logits, torch.full((draws,), temperature, device=DEVICE), seed=123)
    observed = torch.bincount(tokens.cpu(), minlength=vocab).double()
    expected = torch.softmax(row.double().cpu() / temperature, dim=0) * draws
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < 24.3, (observed, expected)  # chi-square, 7 degrees of freedom, p = 0.001
    assert len(set(tokens.tolist())) > 1


def test_triton_seed_reproduces_and_varies():
    logits = torch.zeros(32, 100, device=DEVICE)  # uniform: 100^32 equally likely outcomes
    temperatures = torch.ones(32, device=DEVICE)
    a, b, c = (sample_triton(logits, temperatures, seed) for seed in (5, 5, 6))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
