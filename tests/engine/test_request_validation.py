"""Requests are checked when accepted: edited SamplingParams, numpy token ids, and an engine
started with skip_tokenizer_init. A refused request leaves the engine serving."""

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams

OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=128)
GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [5, 17, 200, 3, 99, 42, 7]
OTHER = [11, 12, 13, 14, 15, 16, 250]


@pytest.fixture
def llm(tiny_model):
    with LLM(tiny_model, **OPTIONS) as engine:
        yield engine


def tokens(llm, prompts, params=None) -> list[list[int]]:
    outputs = llm.generate(prompts, params or SamplingParams(**GREEDY), use_tqdm=False)
    return [o["token_ids"] for o in outputs]


def assert_nothing_queued(llm):
    assert not llm.llm_engine.scheduler.waiting and not llm.llm_engine.scheduler.running
    assert llm.llm_engine.scheduler.block_manager.num_free_blocks == 16


# ---- SamplingParams edited after construction ---------------------------------------------------

@pytest.mark.parametrize("field,value,error,message", [
    ("temperature", float("nan"), ValueError, "temperature must be >= 0 (0 = greedy), got nan"),
    ("temperature", -1.0, ValueError, "temperature must be >= 0 (0 = greedy), got -1.0"),
    ("top_p", 5, ValueError, "top_p must be in (0, 1], got 5"),
    ("top_k", -2, ValueError, "top_k must be 0 or -1 (off) or >= 1, got -2"),
    ("max_tokens", "8", TypeError, "max_tokens must be an int, got '8'"),
    ("min_tokens", 9, ValueError, "min_tokens must be in [0, max_tokens=8], got 9"),
    ("ignore_eos", 1, TypeError, "ignore_eos must be a bool, got 1"),
    ("stop_token_ids", [-1], ValueError, "stop_token_ids must be >= 0, got [-1]"),
    ("logprobs", 21, ValueError, "logprobs must be in [0, 20], got 21"),
    ("presence_penalty", 3.0, ValueError, "presence_penalty must be in [-2, 2], got 3.0"),
])
def test_edited_params_are_checked_again_with_the_constructors_message(llm, field, value, error,
                                                                       message):
    with pytest.raises(error) as constructor:
        SamplingParams(**{**GREEDY, field: value})
    assert str(constructor.value) == message
    params = SamplingParams(**GREEDY)
    expected = tokens(llm, [PROMPT], params)
    original = getattr(params, field)
    setattr(params, field, value)
    submissions = (lambda: llm.generate([PROMPT], params, use_tqdm=False),
                   lambda: llm.generate([OTHER, PROMPT], [SamplingParams(**GREEDY), params]),
                   lambda: llm.add_request(PROMPT, params),
                   lambda: llm.stream([PROMPT], params))
    for submit in submissions:
        with pytest.raises(error, match=f"^{re.escape(message)}$"):
            submit()
        assert_nothing_queued(llm)
    setattr(params, field, original)
    assert tokens(llm, [PROMPT], params) == expected


def test_edited_stop_is_normalized_again(llm):
    params = SamplingParams(**GREEDY)
    params.stop = "never appears"
    params.stop_token_ids = (np.int64(3),)
    llm.generate([PROMPT], params, use_tqdm=False)
    assert params.stop == ["never appears"] and params.stop_token_ids == [3]


# ---- numpy token ids ----------------------------------------------------------------------------

def test_numpy_token_ids_give_the_same_tokens_as_ints(llm):
    expected = tokens(llm, [PROMPT, OTHER])
    as_numpy = [np.int64(t) for t in PROMPT]
    assert tokens(llm, [as_numpy, [np.int32(t) for t in OTHER]]) == expected
    assert tokens(llm, as_numpy) == expected[:1]  # one prompt
    assert all(type(t) is np.int64 for t in as_numpy)  # the caller's list is left as it was
    assert tokens(llm, [[np.uint16(t) for t in PROMPT]]) == expected[:1]
    assert tokens(llm, np.array(PROMPT)) == expected[:1]
    assert tokens(llm, [np.array(PROMPT), np.array(OTHER)]) == expected
    assert tokens(llm, np.array([PROMPT, OTHER], dtype=np.int32)) == expected
    assert tokens(llm, torch.tensor([PROMPT, OTHER])) == expected


def test_numpy_stop_token_ids(llm):
    (baseline,) = tokens(llm, [PROMPT])
    stop = baseline[2]
    params = SamplingParams(**GREEDY, stop_token_ids=[np.int64(stop)])
    assert params.stop_token_ids == [stop] and type(params.stop_token_ids[0]) is int
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert out["token_ids"] == baseline[:baseline.index(stop) + 1]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop


@pytest.mark.parametrize("prompt,message", [
    ([1, True], "prompt 0 has token id True, which is not an int"),
    ([1, np.bool_(True)], r"prompt 0 has token id (np\.)?True_?, which is not an int"),
    ([1, np.float32(2)], r"prompt 0 has token id (np\.float32\()?2\.0\)?, which is not an int"),
    ([np.array([1.0, 2.0])], "prompt 0 has token id 1.0, which is not an int"),
    ([1, np.int64(320)], r"prompt 0 has token id 320 outside the vocabulary \[0, 320\)"),
    (np.array([3, -1]), r"prompt 0 has token id -1 outside the vocabulary \[0, 320\)"),
])
def test_bad_numpy_token_ids_are_refused_and_the_engine_keeps_serving(llm, prompt, message):
    expected = tokens(llm, [PROMPT])
    with pytest.raises(ValueError, match=f"^{message}$"):
        llm.generate(prompt, SamplingParams(**GREEDY), use_tqdm=False)
    assert_nothing_queued(llm)
    assert tokens(llm, [PROMPT]) == expected


def test_numpy_stop_token_ids_outside_the_vocabulary(llm):
    params = SamplingParams(**GREEDY, stop_token_ids=[np.int64(320)])
    with pytest.raises(ValueError, match=r"stop_token_ids has 320 outside the vocabulary"):
        llm.generate([PROMPT], params, use_tqdm=False)
    with pytest.raises(TypeError, match="stop_token_ids must be a list of int"):
        SamplingParams(stop_token_ids=[np.bool_(True)])


# ---- skip_tokenizer_init ------------------------------------------------------------------------

SKIP_MESSAGE = "the engine was started with skip_tokenizer_init=True, so it has no tokenizer"


def test_skip_tokenizer_init_takes_token_ids_and_refuses_text(tiny_model):
    with LLM(tiny_model, **OPTIONS) as llm:
        expected = tokens(llm, [PROMPT, OTHER])
        expected_eos = llm.llm_engine.eos_token_ids
    with LLM(tiny_model, skip_tokenizer_init=True, **OPTIONS) as llm:
        with open(os.path.join(tiny_model, "generation_config.json")) as f:
            assert llm.llm_engine.eos_token_ids == expected_eos == {json.load(f)["eos_token_id"]}
        refused = (lambda: llm.generate(["hello"], SamplingParams(**GREEDY), use_tqdm=False),
                   lambda: llm.add_request("hello", SamplingParams(**GREEDY)),
                   lambda: llm.chat([{"role": "user", "content": "hi"}], SamplingParams(**GREEDY)),
                   lambda: llm.stream([PROMPT], SamplingParams(**GREEDY)),
                   lambda: llm.generate([PROMPT], SamplingParams(**GREEDY, stop="x")))
        for submit in refused:
            with pytest.raises(ValueError, match=SKIP_MESSAGE):
                submit()
            assert_nothing_queued(llm)
        outputs = llm.generate([PROMPT, OTHER], SamplingParams(**GREEDY), use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected
    assert [o["text"] for o in outputs] == ["", ""]


def test_skip_tokenizer_init_takes_eos_ids_from_the_config_files(tiny_model, tmp_path):
    with LLM(tiny_model, **OPTIONS) as llm:
        (baseline,) = tokens(llm, [PROMPT])
    path = shutil.copytree(tiny_model, tmp_path / "ckpt")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(path / name)
    eos = baseline[2]
    for name in ("config.json", "generation_config.json"):
        with open(path / name) as f:
            config = json.load(f)
        with open(path / name, "w") as f:
            json.dump({**config, "eos_token_id": [eos] if "generation" in name else eos}, f)
    with LLM(str(path), skip_tokenizer_init=True, **OPTIONS) as llm:
        assert llm.llm_engine.eos_token_ids == {eos}
        (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8),
                              use_tqdm=False)
    assert out["token_ids"] == baseline[:baseline.index(eos) + 1]
    assert out["finish_reason"] == "stop" and out["text"] == ""
