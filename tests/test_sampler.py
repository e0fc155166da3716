"""The sampler: greedy rows exact, sampled rows distributed as the tempered softmax (torch and Triton), and
the top-k / top-p bisection kernel against the sort that defines it."""

import pytest
import torch

from nanovllm.layers.logits_processor import top_k_top_p_bisect, top_k_top_p_sort
from nanovllm.layers.sampler import sample_torch, sample_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


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


def test_rows_split_into_chunks_draw_the_one_pass_tokens():
    torch.manual_seed(2)
    logits = torch.randn(6, 5000, device=DEVICE) * 2  # chunks of 1024 columns or more: up to 5 per row
    temperatures = torch.tensor([0.8, 0.0, 0.0, 0.0, 1.3, 0.6], device=DEVICE)
    logits[1, 100] = logits[1, 3000] = 60.0  # a greedy tie across chunks: the first index wins
    logits[2, 2100] = logits[2, 4000] = 70.0  # a tie inside later chunks
    logits[3:5, :2048] = -float("inf")  # the first chunks of a greedy and a sampled row are out
    for rows in (slice(0, 1), slice(1, 2), slice(0, 6)):  # one sampled row, one greedy row, all
        one_pass = sample_triton(logits[rows], temperatures[rows], seed=9, num_chunks=1)
        for num_chunks in (2, 5):
            assert torch.equal(sample_triton(logits[rows], temperatures[rows], seed=9, num_chunks=num_chunks),
                               one_pass)
    assert one_pass[1:4].tolist() == [100, 2100, logits[3].argmax().item()] and one_pass[4].item() >= 2048


@needs_cuda
@pytest.mark.parametrize("num_rows", [1, 2, 7, 64, 131, 300])
def test_default_split_draws_the_one_pass_tokens_on_the_real_vocab(num_rows):
    torch.manual_seed(3)
    logits = (torch.randn(num_rows, 151936, device="cuda") * 4).to(torch.bfloat16)
    temperatures = torch.rand(num_rows, device="cuda") + 0.2
    temperatures[::3] = 0
    for seed in range(5):
        one_pass = sample_triton(logits, temperatures, seed, num_chunks=1)
        assert torch.equal(sample_triton(logits, temperatures, seed), one_pass)
        greedy = temperatures == 0
        assert torch.equal(one_pass[greedy], logits.argmax(-1)[greedy])


def top_k_top_p_rows(vocab: int, device: str):
    """Rows of distinct logits, flat to peaked (one with a masked half, as min-p leaves it), and per-row
    top-k / top-p in every combination. Each top-p lies halfway between two cumulative masses of its
    row, so float rounding cannot move the cut-off: the sort and the bisection must agree exactly."""
    gen = torch.Generator().manual_seed(4)
    settings = [(0, 1.0), (50, 1.0), (0, 0.9), (50, 0.8), (1, 1.0), (0, 1e-6), (1, 0.5), (10, 0.5), (vocab - 1, 0.95),
                (300, 0.3), (0, 0.99), (7, 1e-6)]
    logits = torch.stack([torch.randperm(vocab, generator=gen).float() * [0.001, 0.01, 0.05][row % 3]
                          for row in range(len(settings))])
    logits[3, ::2] = -float("inf")
    top_k, top_p = [], []
    for row, (k, p) in zip(logits, settings):
        k = k or vocab
        if 1e-6 < p < 1:
            cumulative = torch.softmax(row.double().topk(k).values, dim=0).cumsum(0)
            n = int(torch.searchsorted(cumulative, p))  # the nucleus is the n + 1 largest
            p = float(cumulative[n] + (cumulative[n - 1] if n else 0.0)) / 2
        top_k.append(k)
        top_p.append(p)
    return (logits.to(device), torch.tensor(top_k, device=device),
            torch.tensor(top_p, dtype=torch.float32, device=device))


@pytest.mark.parametrize("vocab", [5000, pytest.param(151936, marks=needs_cuda)])
def test_top_k_top_p_bisection_keeps_what_the_sort_keeps(vocab):
    logits, top_k, top_p = top_k_top_p_rows(vocab, DEVICE)
    for k, p in ((top_k, top_p), (top_k, None), (None, top_p)):
        expected = top_k_top_p_sort(logits.clone(), k, p)
        assert torch.equal(top_k_top_p_bisect(logits.clone(), k, p), expected)
    kept = (top_k_top_p_sort(logits.clone(), top_k, top_p) > -float("inf")).sum(dim=1).tolist()
    assert kept[0] == vocab and kept[4] == kept[5] == kept[6] == kept[11] == 1 and max(kept[1:]) < vocab


def test_top_k_top_p_bisection_keeps_ties_at_the_cut_off():
    logits = torch.full((3, 100), -10.0, device=DEVICE)  # row 0: every logit ties
    logits[1, :4] = torch.tensor([3.0, 2.0, 2.0, 2.0])  # a tie at the top-p cut-off: cumulative .48 .65 .83 1
    logits[2, :4] = torch.tensor([5.0, 4.0, 4.0, 1.0])  # a tie at the k-th largest
    top_k = torch.tensor([1, 100, 2], device=DEVICE)
    top_p = torch.tensor([1e-6, 0.7, 1.0], device=DEVICE)
    by_sort = top_k_top_p_sort(logits.clone(), top_k, top_p) > -float("inf")
    by_bisection = top_k_top_p_bisect(logits.clone(), top_k, top_p) > -float("inf")
    assert by_sort[0].sum() == 1 and by_bisection[0].all()  # the sort keeps one of the tied tokens, bisection all
    assert by_sort[1, 0] and by_sort[1].sum() == 3  # the sort keeps two of the three tied tokens, bisection all
    assert by_bisection[1].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert by_sort[2].nonzero().flatten().tolist() == by_bisection[2].nonzero().flatten().tolist() == [0, 1, 2]
