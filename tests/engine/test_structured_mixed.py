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
