"""Speculative verify steps and grammar-masked steps on an NVIDIA GPU (skipped without CUDA): the
decode graphs replay a verify step's rows; a masked step samples after its forward."""

import re

import pytest

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from tests.conftest import needs_cuda

# conftest adds the `cuda` marker
pytestmark = [needs_cuda, pytest.mark.usefixtures("every_draft_verified")]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_verify_steps_equal_transformers_in_float32(tiny_model, prompts, hf_reference,
                                                    enforce_eager):
    """float32 (Triton attention, no TF32): greedy tokens with drafts equal transformers' on the
    CPU, through the decode graphs and eagerly; prompts that repeat themselves accept drafts."""
    loopy = [[7, 8, 9, 10] * 6, [3, 1, 4, 1, 5, 9, 2, 6] * 3 + [3, 1, 4]]
    greedy = SamplingParams(temperature=0, max_tokens=len(hf_reference[0]), ignore_eos=True)
    runs = []
    for spec in (None, NGRAM):
        with LLM(tiny_model, dtype="float32", max_model_len=512, kvcache_block_size=16,
                 num_kvcache_blocks=128, enforce_eager=enforce_eager,
                 speculative_config=spec) as llm:
            runs.append([o.outputs[0].token_ids
                         for o in llm.generate(prompts + loopy, greedy, use_tqdm=False)])
            accepted = llm.llm_engine.num_accepted_tokens
    assert accepted > 0
    assert runs[1] == runs[0]
    assert runs[1][:len(prompts)] == hf_reference


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_bf16_verify_rows_store_their_kv_before_attending(tiny_bf16, enforce_eager):
    """bf16 on the Triton backend: up to 32 decode rows, attention may store the rows' K/V in
    the same kernel, which a verify step's later rows must not rely on (they read the earlier
    rows' K/V): it takes graphs without that fusion. One stream at a time, so verify steps have
    5 rows. The sampled tokens' logprobs with drafts equal those without to 0.05 (bf16 logits:
    2^-8 relative rounding of logits of magnitude < 2, through rows computed in batches of
    another shape), up to the first token that differs (a near tie)."""
    loopy = [[7, 8, 9, 10] * 6, [3, 1, 4, 1, 5, 9, 2, 6] * 3 + [3, 1, 4]]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0)
    runs = []
    for spec in (None, NGRAM):
        with LLM(tiny_bf16, max_model_len=256, enforce_eager=enforce_eager,
                 speculative_config=spec) as llm:
            runs.append([llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
                         for prompt in loopy])
            accepted = llm.llm_engine.num_accepted_tokens
    assert accepted > 0
    compared = 0
    for plain, drafted in zip(*runs):
        for token, other, entry, other_entry in zip(plain.token_ids, drafted.token_ids,
                                                    plain.logprobs, drafted.logprobs):
            if token != other:
                break
            assert abs(entry[token].logprob - other_entry[token].logprob) <= 0.05
            compared += 1
    assert compared >= 48  # at least one whole answer's worth of tokens agreed


def test_grammar_rows_valid_with_graphs(tiny_bf16):
    """A batch of 16 regex rows and 16 free rows at temperature 1: the forward replays the decode
    graphs, the masked sampler runs after the masks are filled; every grammar row matches."""
    regex = r"[a-c]{2,4}-\d{1,3}"
    constrained = SamplingParams(temperature=1.0, max_tokens=24, structured_outputs=(
        StructuredOutputsParams(regex=regex)))
    free = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    prompts = [[i + 1, i + 2, i + 3] for i in range(32)]
    with LLM(tiny_bf16, max_model_len=256) as llm:
        outputs = llm.generate(prompts, [constrained, free] * 16, use_tqdm=False)
    for output in outputs[::2]:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        assert re.fullmatch(regex, completion.text), completion.text
    assert all(len(o.outputs[0].token_ids) == 24 for o in outputs[1::2])
