"""The general sampler path on synthetic logits: vLLM's top-k / top-p / min-p and penalties,
greedy rows in mixed batches, seeds, raw logprobs, padded metadata."""

import math
from types import SimpleNamespace

import pytest
import torch

from nanovllm.engine.scheduler import step_sampling
from nanovllm.engine.sequence import Sequence
from nanovllm.kernels import sampling_filters
from nanovllm.kernels.sampling import sample_triton
from nanovllm.runner.sampler_graphs import SamplerGraphs
from nanovllm.runner.sampling_metadata import build_sampling_metadata
from nanovllm.sampling import sampler as sampler_module
from nanovllm.sampling.filters import filter_thresholds
from nanovllm.sampling.logits_processor import apply_penalties
from nanovllm.sampling.sampler import Sampler, SamplingMetadata
from nanovllm.sampling_params import SamplingParams

# The torch reference, and the Triton kernels (on the GPU, or under Triton's interpreter).
IMPLS = ["torch", "triton"]
CPU = torch.device("cpu")
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def metadata(seqs: list[Sequence], vocab_size: int, device: torch.device = CPU,
             num_rows: int | None = None) -> SamplingMetadata:
    return build_sampling_metadata(step_sampling(seqs), vocab_size,
                                   lambda array: torch.from_numpy(array).to(device),
                                   num_rows=num_rows)


def rows(params: list[SamplingParams], prompt=(1, 2, 3)) -> list[Sequence]:
    return [Sequence(list(prompt), p, block_size=16) for p in params]


def sample(logits: torch.Tensor, params: list[SamplingParams], seqs=None,
           impl="torch") -> SimpleNamespace:
    """Sampled token ids, and per row (ids, logprobs) lists when asked."""
    seqs = seqs or rows(params)
    device = KERNEL_DEVICE if impl == "triton" else CPU
    sampler = Sampler(use_triton=impl == "triton")
    out = sampler(logits.to(device, copy=True), metadata(seqs, logits.shape[1], device))
    logprobs = None
    if out.logprobs is not None:
        logprobs = list(zip(out.logprob_token_ids.tolist(), out.logprobs.tolist()))
    return SimpleNamespace(token_ids=out.token_ids.tolist(), logprobs=logprobs)


def allowed_set(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """The tokens vLLM may sample from one row of logits, computed the slow, obvious way."""
    logits = row.double() / p.temperature
    probs = torch.softmax(logits, dim=0)
    order = torch.argsort(logits, descending=True).tolist()
    keep = set(order)
    if p.min_p > 0:
        keep &= {t for t in order if probs[t] >= p.min_p * probs.max()}
    if p.top_k > 0:
        keep &= {t for t in order if logits[t] >= logits[order[p.top_k - 1]]}
    if p.top_p < 1:
        # Among the survivors (renormalised), the most likely tokens until their mass reaches top_p.
        kept = [t for t in order if t in keep]
        mass = torch.softmax(logits[kept], dim=0).tolist()
        total, nucleus = 0.0, set()
        for t, m in zip(kept, mass):
            nucleus.add(t)
            total += m
            if total >= p.top_p - 1e-6:
                break
        keep = nucleus
    return keep


def test_temperature_only_batches_keep_the_one_pass_sampler(monkeypatch):
    calls = []
    monkeypatch.setattr(sampler_module, "sample_torch",
                        lambda logits, t: calls.append(t) or logits.argmax(-1))
    plain = [SamplingParams(temperature=0.7), SamplingParams(temperature=0, stop="x", min_tokens=2)]
    meta = metadata(rows(plain), 50)
    assert meta.only_temperature
    assert meta.suppressed is None  # min_tokens without stop ids or EOS: nothing to hold back
    Sampler()(torch.randn(2, 50), meta)
    assert len(calls) == 1
    mixed = metadata(rows(plain + [SamplingParams(top_k=3)]), 50)
    assert not mixed.only_temperature and mixed.top_k.tolist() == [50, 50, 3]
    assert mixed.top_p is None and mixed.min_p is None and mixed.penalties is None
    assert mixed.max_top_k == 3 and mixed.top_p_within_top_k


def test_top_p_within_top_k_filters_from_candidates_else_sorts():
    bounded = [SamplingParams(top_k=7, top_p=0.9), SamplingParams(top_k=20), SamplingParams(),
               SamplingParams(top_k=900)]
    assert metadata(rows(bounded), 500).max_top_k == 500  # every k, capped by the vocabulary
    assert metadata(rows(bounded[:3]), 500).max_top_k == 20
    assert metadata(rows(bounded), 500).top_p_within_top_k
    unbounded = metadata(rows(bounded + [SamplingParams(top_p=0.5)]), 500)
    assert unbounded.max_top_k == 500 and not unbounded.top_p_within_top_k


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_rows_are_argmax_in_a_batch_mixing_every_control(impl):
    torch.manual_seed(0)
    logits = torch.randn(8, 500)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=5),
              SamplingParams(temperature=0, top_p=0.5), SamplingParams(top_p=0.8, seed=3),
              SamplingParams(temperature=0, min_p=0.3), SamplingParams(logprobs=2),
              SamplingParams(temperature=0, logprobs=3),
              SamplingParams(min_p=0.1, top_k=10, top_p=0.9)]
    tokens = sample(logits, params, impl=impl).token_ids
    for i, p in enumerate(params):
        if p.temperature == 0:
            assert tokens[i] == logits[i].argmax().item()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("controls", [{"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "min_p": 0.5}])
def test_tightest_filters_equal_greedy(controls, impl):
    torch.manual_seed(1)
    logits = torch.randn(64, 1000) * 3
    tokens = sample(logits, [SamplingParams(temperature=1.5, **controls)] * 64, impl=impl).token_ids
    assert tokens == logits.argmax(-1).tolist()


def filter_cases(dtype=torch.float32) -> tuple[torch.Tensor, list[SamplingParams]]:
    """48 rows of 200 logits, distinct also in bfloat16, and settings mixing every filter."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.stack([torch.randperm(200, generator=gen) * 0.03 - 3 for _ in range(48)])
    params = [SamplingParams(temperature=[0.5, 1.0, 2.0][i % 3], top_k=[0, 3, 20, 150][i % 4],
                             top_p=[1.0, 0.3, 0.9][i % 3 - 1],
                             min_p=[0.0, 0.05, 0.2, 0.6][i // 12])
              for i in range(48)]
    return logits.to(dtype), params


def meta_thresholds(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    return filter_thresholds(logits, meta.temperatures, meta.top_k, meta.top_p, meta.min_p,
                             meta.max_top_k, not meta.top_p_within_top_k)


def kernel_draws(logits: torch.Tensor, params: list[SamplingParams], repeats: int) -> torch.Tensor:
    """[rows, repeats] tokens from the Triton race, each row's threshold found once and the row
    repeated in one batch (under the interpreter, far cheaper than as many searches)."""
    meta = metadata(rows(params), logits.shape[1], KERNEL_DEVICE)
    logits = logits.to(KERNEL_DEVICE)
    thresholds = meta_thresholds(logits, meta)
    tokens = sample_triton(logits.repeat_interleave(repeats, dim=0),
                           meta.temperatures.repeat_interleave(repeats), seed=3,
                           thresholds=thresholds.repeat_interleave(repeats))
    return tokens.view(len(params), repeats).cpu()


def test_sampled_tokens_stay_inside_the_filtered_set():
    logits, params = filter_cases()
    allowed = [allowed_set(logits[i], p) for i, p in enumerate(params)]
    seen = [set() for _ in params]
    torch.manual_seed(3)
    for _ in range(30):
        for i, token in enumerate(sample(logits, params).token_ids):
            assert token in allowed[i], (i, params[i], token, sorted(allowed[i]))
            seen[i].add(token)
    assert sum(len(s) > 1 for s in seen) > 24  # rows with room to vary did vary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_thresholds_keep_exactly_the_allowed_set(dtype):
    logits, params = filter_cases(dtype)
    meta = metadata(rows(params), 200, KERNEL_DEVICE)
    thresholds = meta_thresholds(logits.to(KERNEL_DEVICE), meta)
    kept = logits >= thresholds.cpu().unsqueeze(1)
    allowed = [allowed_set(logits[i].float(), p) for i, p in enumerate(params)]
    for i, p in enumerate(params):
        assert set(kept[i].nonzero().flatten().tolist()) == allowed[i], (i, p)
    # A few rows search with 8 key bits per pass instead of 4: the same thresholds.
    few = slice(0, sampling_filters.FEW_ROWS)
    few_thresholds = filter_thresholds(logits[few].to(KERNEL_DEVICE), meta.temperatures[few],
                                       meta.top_k[few], meta.top_p[few], meta.min_p[few],
                                       meta.max_top_k, True)
    assert torch.equal(few_thresholds, thresholds[few])
    # Every row through the Sampler once, and ten draws of each row from the race alone.
    tokens = sample(logits, params, impl="triton").token_ids
    assert all(token in allowed[i] for i, token in enumerate(tokens))
    draws = kernel_draws(logits, params, repeats=10)
    assert all(set(draws[i].tolist()) <= allowed[i] for i in range(len(params)))
    assert sum(len(set(row.tolist())) > 1 for row in draws) > 24


def test_kernel_thresholds_do_not_depend_on_the_split_of_the_rows():
    """Rows split over several programs find the one-program thresholds; row 3 (top-p without
    top-k) searches, the others filter among their 400 largest logits."""
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(4, 1500, generator=gen) * 2).to(KERNEL_DEVICE)
    logits[1, 700] = logits[1, 1400] = 9.0  # a tie at the top, in two chunks
    temperatures = torch.tensor([1.0, 0.7, 1.3, 1.0], device=KERNEL_DEVICE)
    top_k = torch.tensor([7, 1, 400, 1500], device=KERNEL_DEVICE)
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.95], device=KERNEL_DEVICE)
    one = filter_thresholds(logits, temperatures, top_k, top_p, None, 400, True, num_chunks=1)
    three = filter_thresholds(logits, temperatures, top_k, top_p, None, 400, True, num_chunks=3)
    assert torch.equal(one, three)
    alone = [filter_thresholds(logits[i:i + 1], temperatures[i:i + 1], top_k[i:i + 1],
                               top_p[i:i + 1], None, 400, True, num_chunks=3)
             for i in range(4)]  # one row: 8-bit buckets
    assert torch.equal(torch.cat(alone), one)
    kept = (logits >= one.unsqueeze(1)).sum(dim=1).tolist()
    assert kept[:2] == [7, 2] and 1 < kept[2] < 400 and 1 < kept[3] < 1500


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("controls", [{}, {"top_k": 5}, {"top_p": 0.8}, {"min_p": 0.2},
                                      {"top_k": 6, "top_p": 0.9}])
def test_frequencies_match_the_filtered_tempered_softmax(controls, impl):
    # Fewer draws from the kernels: the interpreter runs one program per draw.
    vocab, draws, temperature = 8, 4000 if impl == "torch" else 1000, 0.7
    row = torch.linspace(-1.0, 1.5, vocab)
    params = SamplingParams(temperature=temperature, **controls)
    if not controls:  # the general path, no filter
        params = SamplingParams(temperature=temperature, seed=None, logprobs=0)
    torch.manual_seed(123)
    if impl == "triton":
        tokens = kernel_draws(row.unsqueeze(0), [params], draws).flatten().tolist()
    else:
        tokens = sample(row.expand(draws, vocab).contiguous(), [params] * draws).token_ids
    observed = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    keep = sorted(allowed_set(row, params))
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[keep] = torch.softmax(row.double()[keep] / temperature, dim=0) * draws
    assert observed[expected == 0].sum() == 0
    nonzero = expected > 0
    chi2 = ((observed[nonzero] - expected[nonzero]) ** 2 / expected[nonzero]).sum().item()
    limit = {8: 24.3, 7: 22.5, 6: 20.5, 5: 18.5, 4: 16.3, 3: 13.8, 2: 10.8}[len(keep)]
    assert chi2 < limit, (observed, expected)


def test_penalty_history_is_built_from_the_sequences():
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5),
              SamplingParams(temperature=0)]
    seqs = rows(params, prompt=(0, 1))
    seqs[0].append_token(2)
    seqs[0].append_token(2)
    seqs[1].append_token(5)
    logits = torch.zeros(2, 6)
    logits[:, :3] = torch.tensor([1.0, -1.0, 4.0])
    meta = metadata(seqs, 6)
    p = meta.penalties
    assert p.ids.tolist() == [[0, 1, 2, 2], [6, 6, 6, 6]] and p.prompt_lens.tolist() == [[2], [0]]
    out = apply_penalties(logits.clone(), p.ids, p.prompt_lens, p.repetition, p.frequency,
                          p.presence)
    assert out[0, :3].tolist() == pytest.approx([0.5, -2.0, 4.0 / 2 - 0.5 * 2 - 1.0])
    assert torch.equal(out[1], logits[1])
    seqs[0].append_token(0)  # the history grows with the sequence
    assert metadata(seqs, 6).penalties.ids[0].tolist() == [0, 1, 2, 2, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_min_tokens_suppresses_eos_and_stop_ids(impl):
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4])
    seq = Sequence([1, 2], params, 16, eos_token_ids={7})
    logits = torch.zeros(1, 10)
    logits[0, 7], logits[0, 4], logits[0, 3] = 3.0, 2.0, 1.0
    assert sample(logits, [params], [seq], impl).token_ids == [3]
    seq.append_token(3)
    assert sample(logits, [params], [seq], impl).token_ids == [3]
    seq.append_token(3)
    assert sample(logits, [params], [seq], impl).token_ids == [7]  # min_tokens reached


def test_a_row_short_of_min_tokens_keeps_its_step_off_the_one_pass_sampler():
    """StepSampling.only_temperature (whether a decode graph samples the step) is false while a
    row's stop ids are suppressed or with any control; a min_tokens with nothing to suppress keeps
    it true."""
    def only_temperature(seqs: list[Sequence]) -> bool:
        return step_sampling(seqs).only_temperature

    held = Sequence([1, 2], SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4]), 16,
                    eos_token_ids={7})
    plain = rows([SamplingParams(temperature=0.7),
                  SamplingParams(temperature=0, stop="x", min_tokens=2)])
    assert only_temperature(plain) and not only_temperature(plain + [held])
    assert not only_temperature(plain + rows([SamplingParams(top_p=0.9)]))
    held.append_token(3)
    assert not only_temperature([held])
    held.append_token(3)
    assert only_temperature([held])  # min_tokens reached


@pytest.mark.parametrize("impl", IMPLS)
def test_seeded_rows_repeat_whatever_else_is_in_the_batch(impl):
    torch.manual_seed(4)
    logits = torch.randn(6, 300)
    seeded = SamplingParams(temperature=1.0, seed=11, top_p=0.95)
    first = sample(logits[:1], [seeded], impl=impl).token_ids[0]
    other_rows = [SamplingParams(), SamplingParams(top_k=4, seed=12), SamplingParams(temperature=0)]
    for position in range(3):
        batch = other_rows[:position] + [seeded] + other_rows[position:]
        mixed = torch.cat([logits[1:1 + position], logits[:1], logits[1 + position:4]])
        assert sample(mixed, batch, impl=impl).token_ids[position] == first

    # Keyed by (seed, position): a position repeats its token, the next ones draw afresh.
    def draws(seed):
        seq = rows([SamplingParams(temperature=1.0, seed=seed)])
        tokens = []
        for _ in range(6):
            tokens.append(sample(torch.zeros(1, 1000), None, seq, impl=impl).token_ids[0])
            assert sample(torch.zeros(1, 1000), None, seq, impl=impl).token_ids[0] == tokens[-1]
            seq[0].append_token(tokens[-1])
        return tokens

    assert len(set(draws(11))) > 1
    assert draws(11) == draws(11) != draws(12)


@pytest.mark.parametrize("impl", IMPLS)
def test_logprobs_are_the_raw_log_softmax(impl):
    torch.manual_seed(5)
    logits = torch.randn(3, 100)
    params = [SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=1.5, top_k=10),
              SamplingParams(temperature=0), SamplingParams(logprobs=0)]
    out = sample(logits, params, impl=impl)
    reference = torch.log_softmax(logits, dim=-1)
    for row, (ids, values) in enumerate(out.logprobs):
        assert ids[0] == out.token_ids[row]
        assert ids[1:] == reference[row].topk(3).indices.tolist()
        assert values == pytest.approx(reference[row, ids].tolist(), abs=1e-6)
    assert all(math.isfinite(v) for _, values in out.logprobs for v in values)


@pytest.mark.parametrize("impl", IMPLS)
def test_padded_metadata_samples_the_same_rows(impl):
    """Metadata padded for a CUDA graph samples the real rows as the exact metadata does: greedy
    and seeded rows, penalties, min_tokens, logprobs."""
    torch.manual_seed(6)
    vocab = 300
    params = [SamplingParams(temperature=0.9, seed=1, top_k=5, top_p=0.9, repetition_penalty=1.3,
                             logprobs=2),
              SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4, 9, 11]),
              SamplingParams(temperature=1.2, seed=2, top_p=0.7, min_p=0.02,
                             frequency_penalty=0.4),
              SamplingParams(temperature=0, presence_penalty=2.0, logprobs=1),
              SamplingParams(temperature=0.5, seed=3, top_k=3)]
    seqs = rows(params, prompt=(4, 5, 6))
    for seq in seqs[0::2]:
        for token in (7, 8, 7):
            seq.append_token(token)
    exact = metadata(seqs, vocab)
    padded = metadata(seqs, vocab, num_rows=8)
    assert padded.temperatures.tolist()[5:] == [0, 0, 0]
    assert padded.top_k.tolist()[5:] == [vocab] * 3
    assert padded.top_p.tolist()[5:] == [1, 1, 1] and padded.min_p.tolist()[5:] == [0, 0, 0]
    assert padded.row_seeds.tolist()[5:] == [-1, -1, -1]
    assert padded.penalties.repetition.tolist()[5:] == [1, 1, 1]
    assert (exact.max_top_k, padded.max_top_k) == (5, 8)
    assert (exact.penalties.ids.shape, padded.penalties.ids.shape) == ((5, 6), (8, 8))
    assert torch.all(padded.penalties.ids[5:] == vocab)
    assert padded.penalties.prompt_lens.tolist()[5:] == [[0]] * 3
    assert padded.suppressed[0].tolist() == [1, 1, 1, 1]
    assert padded.suppressed[1].tolist() == [4, 9, 11, 4]
    # A smaller batch in the same bucket has the same shapes: the same CUDA graph serves both.
    fewer = metadata(seqs[:4], vocab, num_rows=8)
    assert fewer.shape_key() == padded.shape_key() != exact.shape_key()
    assert [t.shape for t in fewer.tensors()] == [t.shape for t in padded.tensors()]
    logits = torch.randn(8, vocab)
    device = KERNEL_DEVICE if impl == "triton" else CPU
    sampler = Sampler(use_triton=impl == "triton")
    want = sampler(logits[:5].to(device, copy=True), metadata(seqs, vocab, device))
    got = sampler(logits.to(device, copy=True), metadata(seqs, vocab, device, num_rows=8))
    assert got.token_ids.tolist()[:5] == want.token_ids.tolist()
    assert torch.equal(got.logprob_token_ids[:5], want.logprob_token_ids)
    assert torch.equal(got.logprobs[:5], want.logprobs)


def test_sampler_graphs_apply_to_batches_with_controls_within_the_buckets():
    graphs = SamplerGraphs(Sampler(), max_num_seqs=4)
    temperature, top_k = SamplingParams(temperature=0.6), SamplingParams(top_k=5)
    seqs = lambda *params: step_sampling([Sequence([1, 2], p, 16) for p in params])  # noqa: E731
    assert not graphs.applies(seqs(temperature, SamplingParams(temperature=0)))  # one kernel
    assert graphs.applies(seqs(temperature, top_k))
    assert graphs.applies(seqs(top_k, top_k, top_k, top_k))
    assert not graphs.applies(seqs(top_k, top_k, top_k, top_k, top_k))  # past the largest bucket


@pytest.mark.parametrize("impl", IMPLS)
def test_tokens_go_into_out_when_given(impl):
    """Sampler(..., out=) writes the tokens it returns into out, on both paths."""
    device = KERNEL_DEVICE if impl == "triton" else CPU
    sampler = Sampler(use_triton=impl == "triton")
    logits = torch.randn(3, 70, generator=torch.Generator().manual_seed(7)).to(device)
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=0),
              SamplingParams(top_k=3, seed=4)]
    for controls in (params[:2], params):
        meta = metadata(rows(controls), 70, device)
        torch.manual_seed(1)  # the torch reference draws its noise from torch's generator
        want = sampler(logits[:len(controls)].clone(), meta).token_ids
        out = torch.full((len(controls),), -1, dtype=torch.int64, device=device)
        torch.manual_seed(1)
        got = sampler(logits[:len(controls)].clone(), meta, out=out).token_ids
        assert got.data_ptr() == out.data_ptr() and torch.equal(out, want)
