"""Greedy generation through the public API is token-identical to transformers' greedy decoding."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling.logits_processor import apply_penalties
from nanovllm.step import PLACEHOLDER
from tests.conftest import NUM_NEW_TOKENS, _hf_model, hf_greedy

pytestmark = pytest.mark.cpu_suite  # exact against transformers on the CPU (see conftest)

GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


class PreemptionCounter:
    """Wraps a scheduler's _preempt to count preemptions."""

    def __init__(self, scheduler):
        self.count = 0
        inner = scheduler._preempt

        def counting(seq):
            self.count += 1
            inner(seq)

        scheduler._preempt = counting


def greedy_twice_under_preemption(llm, prompts) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of `prompts`, then of them reversed (prefix hits), on an engine whose pool is
    too small for them all (asserted: some request is preempted)."""
    counter = PreemptionCounter(llm.llm_engine.scheduler)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts[::-1], GREEDY, use_tqdm=False)
    assert counter.count > 0
    return [o["token_ids"] for o in first], [o["token_ids"] for o in second]


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("case,options", [
    ("plain", {}),
    ("chunked", {"max_num_batched_tokens": 7}),
    ("few_seqs", {"max_num_seqs": 2}),
])
def test_greedy_matches_transformers(tiny_model, prompts, hf_reference, block_size, case, options):
    with LLM(tiny_model, kvcache_block_size=block_size, num_kvcache_blocks=64, max_model_len=512,
             **options) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == hf_reference
    assert all(o["finish_reason"] == "length" for o in outputs)


def test_greedy_under_preemption(tiny_model, prompts, hf_reference):
    # Each request needs up to 6 blocks of 16 tokens; 8 blocks cannot hold two of them at once.
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=8) as llm:
        counter = PreemptionCounter(llm.llm_engine.scheduler)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.llm_engine.scheduler.block_manager.num_free_blocks == 8
    assert counter.count > 0
    assert [o["token_ids"] for o in outputs] == hf_reference


def test_greedy_under_preemption_block_256(tiny_model, hf_reference, prompts):
    # Prompts of ~250 tokens cross the 256-token block boundary while decoding.
    long_prompts = [[(7 * i + j) % 256 for j in range(240 + i)] for i in range(4)]
    from tests.conftest import hf_greedy

    expected = [hf_greedy(tiny_model, p, NUM_NEW_TOKENS) for p in long_prompts]
    with LLM(tiny_model, kvcache_block_size=256, num_kvcache_blocks=3, max_model_len=512) as llm:
        counter = PreemptionCounter(llm.llm_engine.scheduler)
        outputs = llm.generate(long_prompts, GREEDY, use_tqdm=False)
    assert counter.count > 0
    assert [o["token_ids"] for o in outputs] == expected


def test_prefix_hits_give_identical_tokens(tiny_model, prompts, hf_reference):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        # The 40-token shared prefix's two full blocks are now cached and revivable.
        probe = Sequence(prompts[5], GREEDY, 16)
        assert len(llm.llm_engine.scheduler.block_manager.cached_prefix(probe)) == 2
        second = llm.generate(prompts[::-1], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in first] == hf_reference
    assert [o["token_ids"] for o in second] == hf_reference[::-1]


def test_reset_prefix_cache_computes_prompts_in_full_again(tiny_model, prompts, hf_reference):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
        llm.reset_prefix_cache()
        cached_tokens = []  # of each sequence as it is admitted
        allocate = llm.llm_engine.scheduler.block_manager.allocate

        def spy(seq, cached):
            allocate(seq, cached)
            cached_tokens.append(seq.num_cached_tokens)

        llm.llm_engine.scheduler.block_manager.allocate = spy
        again = llm.generate(prompts, GREEDY, use_tqdm=False)
    # Without the reset, the repeated prompts and the 40-token shared prefix would hit (the test
    # above); within this batch, only prompts admitted after an earlier one's prefill may.
    assert cached_tokens[:5] == [0] * 5  # the five unique prompts, admitted first
    assert [o["token_ids"] for o in again] == hf_reference


def test_untied_checkpoint_and_text_prompts(tiny_model_untied):
    from transformers import AutoTokenizer

    from tests.conftest import hf_greedy

    tok = AutoTokenizer.from_pretrained(tiny_model_untied)
    texts = ["hello world", "héllo wörld, ünïcode"]
    expected = [hf_greedy(tiny_model_untied, tok.encode(t), 8) for t in texts]
    with LLM(tiny_model_untied, kvcache_block_size=16, num_kvcache_blocks=32) as llm:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate(texts, params, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected
    assert [o["text"] for o in outputs] == [tok.decode(e) for e in expected]


def test_sampling_with_temperature_is_valid_and_varies(tiny_model, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        outputs = llm.generate(prompts[:4] * 2, params, use_tqdm=False)
    assert all(len(o["token_ids"]) == 16 for o in outputs)
    assert all(0 <= t < 320 for o in outputs for t in o["token_ids"])
    assert outputs[0]["token_ids"] != outputs[4]["token_ids"]  # same prompt, independent samples


def test_eos_stops_generation(tiny_model, prompts, hf_reference):
    # Pretend the 5th greedy token of prompt 0 is EOS: generation must stop right after it.
    eos = hf_reference[0][4]
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        llm.llm_engine.scheduler.eos_token_ids = {eos}
        params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS)
        (out,) = llm.generate([prompts[0]], params, use_tqdm=False)
        # The step launched before EOS came back is dropped, its extra block freed with the rest.
        assert llm.llm_engine.scheduler.block_manager.num_free_blocks == 64
    first = hf_reference[0].index(eos)
    assert out["token_ids"] == hf_reference[0][:first + 1]
    assert out["finish_reason"] == "stop"


def test_triton_backend_greedy_matches_transformers(tiny_model, prompts, hf_reference):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64, attention_backend="triton",
             max_num_batched_tokens=40) as llm:
        orders = []  # (context lengths, decode order) of each decode step
        prepare = llm.llm_engine.model_runner.inputs.prepare_decode

        def spy(step, *args):
            input_ids, positions, meta = prepare(step, *args)
            orders.append((meta.context_lens.tolist(), meta.decode_order.tolist()))
            return input_ids, positions, meta

        llm.llm_engine.model_runner.inputs.prepare_decode = spy
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate(prompts[:6], params, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [ref[:8] for ref in hf_reference[:6]]
    # The decode kernel took each step's rows longest context first (ties in row order).
    assert orders and all(order == sorted(range(len(lens)), key=lambda b: -lens[b])
                          for lens, order in orders)
    assert any(order != sorted(order) for _, order in orders)


def count_inflight_inputs(llm) -> list[tuple[int, int]]:
    """Spy on decode input preparation: (inputs still in flight, batch size) of each decode step."""
    counts = []
    prepare = llm.llm_engine.model_runner.inputs.prepare_decode

    def spy(step, *args):
        inflight = sum(token_id == PLACEHOLDER for token_id in step.token_ids)
        counts.append((inflight, len(step)))
        return prepare(step, *args)

    llm.llm_engine.model_runner.inputs.prepare_decode = spy
    return counts


def test_decode_is_launched_before_the_previous_tokens_reach_the_host(tiny_model, prompts,
                                                                      hf_reference):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        counts = count_inflight_inputs(llm)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == hf_reference
    # Every decode input is the previous step's token, read on the device.
    assert counts and all(inflight == batch for inflight, batch in counts)


def test_penalties_count_the_tokens_still_in_flight(tiny_model, prompts):
    """Penalised rows overlap too (the history gets its in-flight token on the device), and match
    penalties applied to transformers' logits step by step."""
    penalised = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                               repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3)
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        counts = count_inflight_inputs(llm)
        outputs = llm.generate(prompts[:4], [penalised, plain, penalised, penalised],
                               use_tqdm=False)
    assert counts and all(inflight == batch for inflight, batch in counts)
    assert outputs[1]["token_ids"] == hf_greedy(tiny_model, prompts[1], 10)
    for i in (0, 2, 3):
        prompt, out = prompts[i], outputs[i]
        assert out["token_ids"] == penalised_greedy(tiny_model, prompt, penalised)


def penalised_greedy(model_path: str, prompt: list[int], params: SamplingParams) -> list[int]:
    model = _hf_model(model_path)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = model(torch.tensor([tokens])).logits[0, -1:].float()
            apply_penalties(logits, torch.tensor([tokens]), torch.tensor([[len(prompt)]]),
                            torch.tensor([params.repetition_penalty]),
                            torch.tensor([params.frequency_penalty]),
                            torch.tensor([params.presence_penalty]))
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]
