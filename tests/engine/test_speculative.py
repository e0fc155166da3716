"""N-gram speculative decoding: the config, the drafter's proposals, and lossless output: greedy
and seeded tokens equal to decoding without it (and to transformers), sampled tokens keep the
target's distribution, blocks of rejected drafts return to the pool."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import SpeculativeConfig
from nanovllm.engine.speculative import (
    MAX_BACKOFF,
    PROBE_STEPS,
    DraftGate,
    NgramDrafter,
    accepted_length,
)
from tests.conftest import _hf_model
from tests.engine.test_generate import PreemptionCounter

pytestmark = [pytest.mark.cpu_suite, pytest.mark.usefixtures("every_draft_verified")]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


def test_config_takes_vllms_keys_and_defaults():
    config = SpeculativeConfig.of({"method": "[ngram]", "num_speculative_tokens": 3})
    assert config == SpeculativeConfig(3, 5, 5, "ngram", 32)
    assert SpeculativeConfig.of({"num_speculative_tokens": 2, "prompt_lookup_max": 4}) == \
        SpeculativeConfig(2, 4, 4)
    assert SpeculativeConfig.of({"num_speculative_tokens": 2, "prompt_lookup_min": 2}) == \
        SpeculativeConfig(2, 2, 2)


@pytest.mark.parametrize("spec, error, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, ValueError,
     "method='eagle' is not supported; methods: ngram"),
    ({"method": "ngram"}, ValueError, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, ValueError, "num_speculative_tokens=0 must be in [1, 16]"),
    ({"num_speculative_tokens": 17}, ValueError, "num_speculative_tokens=17 must be in [1, 16]"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, ValueError,
     "prompt_lookup_max=2 must be >= 3"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, ValueError,
     "prompt_lookup_min=0 must be >= 1"),
    ({"num_speculative_tokens": "4"}, TypeError, "num_speculative_tokens must be an int"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, ValueError,
     "disable_by_batch_size=0 must be >= 1"),
    ({"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, ValueError,
     "key 'draft_tensor_parallel_size' is not supported"),
    ("ngram", TypeError, "speculative_config must be a dict, got str"),
])
def test_bad_config_raises_naming_it(tiny_model, spec, error, message):
    with pytest.raises(error) as info:
        LLM(tiny_model, speculative_config=spec)
    assert message in str(info.value)


def test_drafter_copies_after_the_longest_most_recent_match():
    drafter = NgramDrafter(SpeculativeConfig(3, 3, 1))
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    # The suffix (6, 7) occurred at 1 and at 5, neither with 2 before it: of the two matches of
    # length 2 the most recent wins, and the 3 tokens after it are the draft.
    assert drafter.propose(tokens, len(tokens)) == [1, 2, 6]
    tokens += [3]  # (7, 3) and (3,) never occurred
    assert drafter.propose(tokens, len(tokens)) == []
    # A longer match wins over a more recent one: (5, 6, 7) matches at 0, (6, 7) alone at 5.
    drafter = NgramDrafter(SpeculativeConfig(2, 3, 1))
    tokens = [5, 6, 7, 8, 4, 6, 7, 9, 5, 6, 7]
    assert drafter.propose(tokens, len(tokens)) == [8, 4]
    # Only known tokens are copied: the draft stops at the last one.
    tokens = [4, 4]
    assert NgramDrafter(SpeculativeConfig(4, 2, 1)).propose(tokens, 2) == [4]


def test_drafter_backs_off_after_rejected_drafts():
    drafter = NgramDrafter(SpeculativeConfig(2, 2, 1))
    tokens = [1, 2, 1]
    misses = []
    for _ in range(4):
        drafter.record(2, 0)
        skipped = 0
        while not drafter.propose(tokens, len(tokens)):
            skipped += 1
        misses.append(skipped)
    assert misses == [1, 2, 4, 8]
    drafter.record(2, 1)  # an accepted token resets the backoff
    drafter.record(2, 0)
    assert drafter.skip == 1 and drafter.backoff == 2
    for _ in range(10):
        drafter.record(1, 0)
    assert drafter.backoff == MAX_BACKOFF


def test_accepted_length():
    assert accepted_length([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted_length([4, 5], [4, 5, 7]) == 2
    assert accepted_length([4], [3, 8]) == 0
    assert accepted_length([], [3]) == 0


def loopy_prompts(prompts) -> list[list[int]]:
    """The shared prompts plus ones that repeat themselves (long drafts to verify)."""
    return prompts + [[7, 8, 9, 10] * 6, [3, 1, 4, 1, 5, 9, 2, 6] * 3 + [3, 1, 4]]


def test_greedy_tokens_equal_transformers_under_chunking_preemption_and_prefix_hits(
        tiny_model, prompts, hf_reference):
    """12 blocks of 16 tokens cannot hold every request: preemption; a 20-token budget chunks
    the prompts; the second pass hits the prefix cache."""
    greedy = SamplingParams(temperature=0, max_tokens=len(hf_reference[0]), ignore_eos=True)
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=12,
             max_num_batched_tokens=20, speculative_config=NGRAM) as llm:
        counter = PreemptionCounter(llm.llm_engine.scheduler)
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        second = [o.outputs[0].token_ids
                  for o in llm.generate(prompts[::-1], greedy, use_tqdm=False)]
        engine = llm.llm_engine
        assert counter.count > 0 and engine.num_draft_tokens > 0
        engine.scheduler.block_manager.check_integrity([])
        assert engine.scheduler.block_manager.num_free_blocks == 12
    assert first == hf_reference
    assert second == hf_reference[::-1]


def test_outputs_equal_decoding_without_it(tiny_model, prompts):
    """Greedy and seeded samples (n > 1, top-k/p, penalties, min_tokens, logprobs, a stop
    string, EOS) give the tokens, text, finish reasons and logprobs of decoding without drafts:
    the draws are keyed by position. Logprobs to 1e-5: float32 logits of the same tokens
    computed in a batch of another shape (a verify step's rows)."""
    params = [
        SamplingParams(temperature=0, max_tokens=48, logprobs=2),
        SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=40, top_k=20, top_p=0.9),
        SamplingParams(temperature=1.0, seed=5, max_tokens=40, repetition_penalty=1.3,
                       presence_penalty=0.3, frequency_penalty=0.2, min_tokens=10),
        SamplingParams(temperature=0, max_tokens=64, stop=["ab"], include_stop_str_in_output=True),
    ]
    requests = loopy_prompts(prompts)
    runs = []
    for spec in (None, NGRAM):
        with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=96,
                 speculative_config=spec) as llm:
            outputs = llm.generate(requests, [params[i % 4] for i in range(len(requests))],
                                   use_tqdm=False)
            runs.append([[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs)
                          for c in o.outputs] for o in outputs])
            accepted = llm.llm_engine.num_accepted_tokens
            llm.llm_engine.scheduler.block_manager.check_integrity([])
    assert accepted > 20
    for without, with_drafts in zip(*runs, strict=True):
        for (tokens, text, reason, stop, logprobs), expected in zip(with_drafts, without,
                                                                    strict=True):
            assert (tokens, text, reason, stop) == expected[:4]
            if logprobs is not None:
                got = [{t: e.logprob for t, e in entry.items()} for entry in logprobs]
                want = [{t: e.logprob for t, e in entry.items()} for entry in expected[4]]
                assert [list(e) for e in got] == [list(e) for e in want]
                for g, w in zip(got, want):
                    assert list(g.values()) == pytest.approx(list(w.values()), abs=1e-5)


def test_sampled_tokens_keep_the_target_distribution(tiny_model):
    """Unseeded draws at temperature 0.5 from a prompt whose first token is most likely 20, which
    the prompt follows by 217: after a first token 20 each step drafts [217, 11]. The second
    token (a verify step's first row) and, where it is 217, the third (its second row, behind an
    accepted draft token) are chi-square tested against transformers' probabilities. The engine
    is seeded, so the test is deterministic; it fails at p < 1e-3."""
    scipy_stats = pytest.importorskip("scipy.stats")
    prompt = [20, 217, 11, 12, 13, 14]
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1,
            "prompt_lookup_min": 1, "disable_by_batch_size": 100}
    params = SamplingParams(temperature=0.5, max_tokens=3, ignore_eos=True)
    samples = []
    # 100 at a time: the verify rows fit beside them under max_num_seqs (a row each).
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=512, max_num_seqs=300,
             speculative_config=spec, seed=0) as llm:
        for _ in range(20):
            outputs = llm.generate([prompt] * 100, params, use_tqdm=False)
            samples += [o.outputs[0].token_ids for o in outputs]
        assert llm.llm_engine.num_accepted_tokens > 300
    model = _hf_model(tiny_model)

    def target(context: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([context])).logits[0, -1].double()
        return torch.softmax(logits / 0.5, dim=-1)

    second = [s[1] for s in samples if s[0] == 20]
    third = [s[2] for s in samples if s[:2] == [20, 217]]
    assert len(second) > 800 and len(third) > 300  # the paths tested are common
    for drawn, context in ((second, prompt + [20]), (third, prompt + [20, 217])):
        probs = target(context)
        counts = torch.bincount(torch.tensor(drawn), minlength=len(probs)).double()
        expected = probs * len(drawn)
        big = expected >= 5  # chi-square cells: tokens expected 5+ times, the rest pooled
        observed = torch.cat([counts[big], counts[~big].sum().view(1)])
        cells = torch.cat([expected[big], expected[~big].sum().view(1)])
        p_value = scipy_stats.chisquare(observed.numpy(), cells.numpy()).pvalue
        assert p_value > 1e-3, (p_value, observed.tolist(), cells.tolist())


def count_steps(engine) -> list[int]:
    """Wraps engine.step; the returned list's item counts the calls."""
    count, inner = [0], engine.step

    def step():
        count[0] += 1
        return inner()

    engine.step = step
    return count


def test_copying_answer_of_the_real_model_accepts_drafts(smollm2_gguf):
    """SmolLM2 asked to repeat a text: greedy text equal to decoding without drafts, in fewer
    steps (most of the answer is accepted drafts); a question with nothing to copy gives the
    same text too."""
    text = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
            "with a single step. All that glitters is not gold.")
    copy = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{text}"}]
    free = [{"role": "user", "content": "Write a short poem about the sea."}]
    params = SamplingParams(temperature=0, max_tokens=48)
    runs, steps = [], []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4,
                        "prompt_lookup_max": 4, "prompt_lookup_min": 2}):
        with LLM(smollm2_gguf, dtype="float32", max_model_len=512, kvcache_block_size=16,
                 num_kvcache_blocks=64, speculative_config=spec) as llm:
            runs.append([o.outputs[0].text for o in llm.chat([copy, free], params,
                                                              use_tqdm=False)])
            count = count_steps(llm.llm_engine)
            answer = llm.chat(copy, params, use_tqdm=False)[0].outputs[0]
            steps.append(count[0])
            accepted = llm.llm_engine.num_accepted_tokens
    assert runs[1] == runs[0]
    assert answer.text.startswith("The quick brown fox")
    # Each step yields a token plus its accepted drafts: at least half the answer was drafted.
    assert steps[1] <= steps[0] - len(answer.token_ids) // 2, steps
    assert accepted >= len(answer.token_ids) // 2


def test_tp2_verify_steps_equal_transformers(tiny_model, prompts, hf_reference):
    """The workers run a verify step's rows as decode rows too."""
    greedy = SamplingParams(temperature=0, max_tokens=len(hf_reference[0]), ignore_eos=True)
    with LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=64,
             speculative_config=NGRAM) as llm:
        outputs = llm.generate(loopy_prompts(prompts), greedy, use_tqdm=False)
        assert llm.llm_engine.num_accepted_tokens > 0
    assert [o.outputs[0].token_ids for o in outputs[:len(prompts)]] == hf_reference


def test_no_drafts_past_disable_by_batch_size(tiny_model):
    """A decode step of more sequences than disable_by_batch_size verifies nothing and keeps
    the overlap; at or under it, drafts are verified."""
    loopy = [[7, 8, 9, 10] * 6, [3, 1, 4, 1, 5, 9, 2, 6] * 3 + [3, 1, 4], [5, 6] * 10]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    spec = {**NGRAM, "disable_by_batch_size": 2}
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64,
             speculative_config=spec) as llm:
        llm.generate(loopy, greedy, use_tqdm=False)
        assert llm.llm_engine.num_drafts == 0
        llm.generate(loopy[:2], greedy, use_tqdm=False)
        assert llm.llm_engine.num_drafts > 0


def test_drafter_expects_the_moving_average_of_its_accepted_tokens():
    drafter = NgramDrafter(SpeculativeConfig(4, 2, 1))
    assert drafter.expected == 1.0  # before any verified draft
    drafter.record(4, 3)
    assert drafter.expected == 2.0  # halfway to 3
    drafter.record(4, 0)
    assert drafter.expected == 1.0
    drafter.record(0, 0)  # no draft: nothing learned
    assert drafter.expected == 1.0


def test_gate_admits_drafts_expected_to_add_a_token_a_sequence(monkeypatch):
    """Two drafters expecting 1.5 tokens each: enough for a batch of 3, not of 4; a declined
    batch is probed every PROBE_STEPS-th step."""
    monkeypatch.undo()  # the gate as the engine has it
    drafters = [NgramDrafter(SpeculativeConfig(4, 2, 1)) for _ in range(2)]
    for drafter in drafters:
        drafter.expected = 1.5
    gate = DraftGate()
    assert gate.admits(drafters, num_running=3)
    decisions = [gate.admits(drafters, num_running=4) for _ in range(2 * PROBE_STEPS)]
    admitted = [step for step, admits in enumerate(decisions) if admits]
    assert admitted == [PROBE_STEPS - 1, 2 * PROBE_STEPS - 1]
    assert not gate.admits([], num_running=1)


def test_drafts_the_gate_declines_are_not_verified(tiny_model, monkeypatch):
    """The engine asks the gate before each step with drafts, with the running batch's size;
    a declined step verifies nothing, and the tokens are those of decoding without drafts."""
    asked = []

    def decline(self, drafters, num_running):
        asked.append((len(drafters), num_running))
        return False

    monkeypatch.setattr(DraftGate, "admits", decline)
    loopy = [[7, 8, 9, 10] * 6, [3, 1, 4, 1, 5, 9, 2, 6] * 3 + [3, 1, 4]]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    runs = []
    for spec in (None, NGRAM):
        with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64,
                 speculative_config=spec) as llm:
            runs.append([o.outputs[0].token_ids
                         for o in llm.generate(loopy, greedy, use_tqdm=False)])
            assert llm.llm_engine.num_drafts == 0
    assert asked and all(0 < n <= running == 2 for n, running in asked), asked
    assert runs[1] == runs[0]
