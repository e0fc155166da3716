"""Structured outputs in a mixed batch under preemption (tiny checkpoint), and a schema-constrained
chat answer of the real SmolLM2."""

import json
import re

import pytest

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from tests.engine.test_generate import PreemptionCounter
from tests.engine.test_structured_outputs import CHOICES, REGEX, SCHEMA

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.cpu_suite


def structured(**spec) -> StructuredOutputsParams:
    return StructuredOutputsParams(**spec)


def unconstrained(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    return SamplingParams(temperature=1.0, seed=i, max_tokens=48, ignore_eos=True)


def test_mixed_batch_under_preemption(tiny_model, prompts):
    """Rows with and without grammars (n > 1) on a pool too small for them all: every grammar row
    is valid, and the unconstrained rows (greedy, seeded) draw what they draw alone."""
    free = [unconstrained(i) for i in range(len(prompts))]
    grammar_params = [SamplingParams(n=2, max_tokens=60, structured_outputs=structured(
        regex=REGEX)), SamplingParams(n=3, max_tokens=40, structured_outputs=structured(
            choice=CHOICES)), SamplingParams(max_tokens=100, structured_outputs=structured(
                json=SCHEMA, disable_any_whitespace=True))]
    options = dict(kvcache_block_size=16, num_kvcache_blocks=14, max_model_len=256)
    with LLM(tiny_model, **options) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
        counter = PreemptionCounter(llm.llm_engine.scheduler)
        mixed_prompts, mixed_params = [], []
        for i, prompt in enumerate(prompts):
            mixed_prompts += [prompt, prompt[:8]]
            mixed_params += [free[i], grammar_params[i % 3]]
        outputs = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
        assert counter.count > 0
        llm.llm_engine.scheduler.block_manager.check_integrity([])
    assert [o.outputs[0].token_ids for o in outputs[::2]] == alone
    for i, output in enumerate(outputs[1::2]):
        for completion in output.outputs:
            if i % 3 == 0:
                assert completion.finish_reason != "stop" or re.fullmatch(REGEX, completion.text)
            elif i % 3 == 1:
                assert completion.finish_reason == "stop" and completion.text in CHOICES
            elif completion.finish_reason == "stop":
                jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_schema_constrained_chat_on_smollm2(smollm2_gguf):
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=structured(
        json=schema, disable_any_whitespace=True))
    messages = [{"role": "user", "content": "Name a large city and its population as JSON."}]
    with LLM(smollm2_gguf, dtype="float32", max_model_len=512, kvcache_block_size=16,
             num_kvcache_blocks=64) as llm:
        output = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "stop", output.text
    jsonschema.validate(json.loads(output.text), schema)


def count_steps(engine) -> list[int]:
    """Wraps engine.step; the returned list gets each step's launched decode rows (0: none)."""
    launched, inner_run, inner_step = [], engine.model_runner.run, engine.step

    def run(step):
        launched[-1] = 0 if step.is_prefill else len(step)
        return inner_run(step)

    def step():
        launched.append(0)
        return inner_step()

    engine.model_runner.run, engine.step = run, step
    return launched


def test_grammar_rows_decode_every_step(tiny_model):
    """A batch of grammar rows alone keeps the overlap: every step launches every row. The regex
    takes 16 letters then EOS: a prefill samples the first letter, 16 decode steps the rest and
    EOS, and one more decode is launched by the step that learns of EOS (its tokens are dropped).
    A grammar row that waited for its token in flight would launch every other step."""
    params = SamplingParams(max_tokens=40, structured_outputs=structured(regex="[a-z]{16}"))
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        launched = count_steps(llm.llm_engine)
        outputs = llm.generate([[1, 2, 3], [4, 5, 6, 7]], params, use_tqdm=False)
    assert [re.fullmatch("[a-z]{16}", o.outputs[0].text) is not None for o in outputs] == [True] * 2
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop"] * 2
    assert launched == [0] + [2] * 17


def test_tp2_grammar_rows_equal_one_rank(tiny_model, prompts):
    """With tensor parallelism the workers join a masked step's sampling half (the tokens'
    broadcast): greedy constrained tokens equal one rank's (the model's tokens are identical at
    every size, test_tensor_parallel)."""
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=structured(
        regex=REGEX)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    params = [params[i % 2] for i in range(len(prompts))]
    runs = []
    for size in (1, 2):
        with LLM(tiny_model, tensor_parallel_size=size, kvcache_block_size=16,
                 num_kvcache_blocks=64) as llm:
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                       use_tqdm=False)])
    assert runs[1] == runs[0]
