"""The sampler: greedy rows exact, sampled rows drawn from the tempered softmax (torch, Triton)."""

import pytest
import torch

from nanovllm.kernels import device as device_facts
from nanovllm.kernels.sampling import sample_triton
from nanovllm.sampling.sampler import sample_torch
from tests.conftest import needs_cuda

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
    logits = torch.zeros(32, 100, device=DEVICE)
    temperatures = torch.ones(32, device=DEVICE)
    a, b, c = (sample_triton(logits, temperatures, seed) for seed in (5, 5, 6))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_rows_split_into_chunks_draw_the_one_pass_tokens():
    torch.manual_seed(2)
    logits = torch.randn(6, 5000, device=DEVICE) * 2
    temperatures = torch.tensor([0.8, 0.0, 0.0, 0.0, 1.3, 0.6], device=DEVICE)
    logits[1, 100] = logits[1, 3000] = 60.0  # a greedy tie across chunks: the first index wins
    logits[2, 2100] = logits[2, 4000] = 70.0  # a tie inside later chunks
    logits[3:5, :2048] = -float("inf")  # the first chunks of a greedy and a sampled row are out
    for rows in (slice(0, 1), slice(1, 2), slice(0, 6)):
        one_pass = sample_triton(logits[rows], temperatures[rows], seed=9, num_chunks=1)
        for num_chunks in (2, 5):
            split = sample_triton(logits[rows], temperatures[rows], seed=9, num_chunks=num_chunks)
            assert torch.equal(split, one_pass)
    assert one_pass[1:4].tolist() == [100, 2100, logits[3].argmax().item()]
    assert one_pass[4].item() >= 2048


def test_split_rows_write_into_out_and_leave_their_arrival_counts_zeroed():
    """A row's last chunk writes into out and zeroes the row's count, for the next launch."""
    torch.manual_seed(5)
    logits = torch.randn(3, 5000, device=DEVICE) * 3
    temperatures = torch.tensor([0.0, 0.9, 1.2], device=DEVICE)
    for seed in (1, 2):
        one_pass = sample_triton(logits, temperatures, seed, num_chunks=1)
        for num_chunks in (1, 4):
            out = torch.full((3,), -1, dtype=torch.int64, device=DEVICE)
            assert sample_triton(logits, temperatures, seed, num_chunks=num_chunks, out=out) is out
            assert torch.equal(out, one_pass)
    counts = device_facts._ARRIVAL_COUNTS["sampler chunks", logits.device]
    assert sum(c.count_nonzero().item() for c in counts) == 0


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


@needs_cuda
def test_a_new_seed_compiles_no_new_kernel():
    """The seed changes every step: seeds of every divisibility share one compiled kernel."""
    from nanovllm.kernels.sampling import _sample_kernel

    logits = torch.randn(4, 5000, device="cuda")
    temperatures = torch.ones(4, device="cuda")
    sample_triton(logits, temperatures, seed=3, num_chunks=1)
    kernel_cache = _sample_kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(kernel_cache)
    for seed in (1, 16, 32, 7, 2**30):
        sample_triton(logits, temperatures, seed=seed, num_chunks=1)
    assert len(kernel_cache) == compiled
