"""nanovllm.lm_eval against lm-eval's own HF model (HFLM) on the same tiny checkpoint: the same
loglikelihoods and the same greedy generations, through real lm-eval Instances and one
simple_evaluate call on a local task."""

import json
import subprocess
import sys

import pytest
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from nanovllm import SamplingParams
from nanovllm.lm_eval import NanoVLLM

pytestmark = pytest.mark.cpu_suite

MAX_MODEL_LEN = 48
ENGINE_OPTIONS = dict(max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=64, kvcache_block_size=16)
# Both sides run float32 on the CPU with the same weights; only the kernels (and their reduction
# orders) differ. A logprob of this 2-layer, 64-wide model is off by ~1e-6 between them (a few
# float32 ulps of logits of magnitude ~10), so a sum of up to a few dozen tokens stays within
# 1e-4, the acceptance bound.
TOLERANCE = 1e-4
FLOAT32_EPS = 2.0**-24  # unit roundoff: HFLM sums a window's logprobs in float32

LOGLIKELIHOOD_PAIRS = [
    ("The capital of France is", " Paris"),
    ("Hello", " world!"),
    ("", "abc"),  # an empty context: scored after prefix_token_id
    ("a b ", "c d"),  # the trailing space moves to the continuation
    ("Question: 2 + 2 =", " 4\nAnswer: four"),
    ("x" * 60, "y"),  # longer than the context: its oldest tokens go
]
ROLLING_TEXTS = ["short text", "A longer text that the context holds in no single window at all."]
GENERATIONS = [
    ("The capital", {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}),
    ("Once upon", {"until": ["e"], "max_gen_toks": 12, "do_sample": False}),
    ("abc", {"until": ["G", "%"], "max_gen_toks": 16, "temperature": 0.0}),
    ("Hi", {"max_gen_toks": 8}),
]


@pytest.fixture(scope="module")
def hflm(tiny_model):
    # Rolling windows: HFLM feeds max_length tokens; ours feeds them plus the scored last token
    # plus one generated token, so max_model_len - 2 gives both the same windows.
    return HFLM(pretrained=tiny_model, device="cpu", dtype="float32", batch_size=1,
                max_length=MAX_MODEL_LEN - 2)


@pytest.fixture(scope="module")
def ours(tiny_model):
    """Built as the `lm_eval` command builds it: by its registered name and an argument string,
    the engine options passed through to LLM."""
    options = ",".join(f"{k}={v}" for k, v in ENGINE_OPTIONS.items())
    model = get_model("nanovllm").create_from_arg_string(f"pretrained={tiny_model},{options}",
                                                         {"batch_size": 1, "device": "cpu"})
    yield model
    model.llm.exit()


def instances(request_type: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihood_equals_hflm(hflm, ours):
    requests = instances("loglikelihood", LOGLIKELIHOOD_PAIRS)
    expected = hflm.loglikelihood(requests, disable_tqdm=True)
    actual = ours.loglikelihood(requests, disable_tqdm=True)
    worst = max(abs(a[0] - e[0]) for a, e in zip(actual, expected))
    assert worst <= TOLERANCE, (worst, actual, expected)
    assert [a[1] for a in actual] == [e[1] for e in expected]


def test_is_greedy_on_the_greedy_continuation(hflm, ours):
    """A continuation of greedy tokens is greedy on both sides, and one changed token is not."""
    context = ours.tok_encode("Once upon a time")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    greedy = ours.llm.generate([{"prompt_token_ids": context}], params,
                               use_tqdm=False)[0].outputs[0].token_ids
    changed = greedy[:3] + [(greedy[3] + 1) % 256]
    requests = [(None, context, greedy), (None, context, changed)]
    expected = hflm._loglikelihood_tokens(requests, disable_tqdm=True)
    actual = ours._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [a[1] for a in actual] == [e[1] for e in expected] == [True, False]
    assert all(abs(a[0] - e[0]) <= TOLERANCE for a, e in zip(actual, expected))


def test_loglikelihood_rolling_equals_hflm(hflm, ours):
    requests = instances("loglikelihood_rolling", [(t,) for t in ROLLING_TEXTS])
    expected = hflm.loglikelihood_rolling(requests, disable_tqdm=True)
    actual = ours.loglikelihood_rolling(requests, disable_tqdm=True)
    for text, a, e in zip(ROLLING_TEXTS, actual, expected):
        # The kernels' 1e-4, plus HFLM's float32 summation: at most n-1 roundings of a partial
        # sum no larger than the total, per window of at most max_length tokens.
        summation = MAX_MODEL_LEN * FLOAT32_EPS * abs(e)
        assert abs(a - e) <= TOLERANCE + summation, (text, a, e)
    assert len(ours.tok_encode(ROLLING_TEXTS[1])) > MAX_MODEL_LEN  # several windows


def test_generate_until_equals_hflm(hflm, ours):
    requests = instances("generate_until", GENERATIONS)
    expected = hflm.generate_until(requests, disable_tqdm=True)
    assert ours.generate_until(requests, disable_tqdm=True) == expected
    assert any(expected) and not all(expected)  # some stopped at once, some generated


def test_registered_with_the_engine_options(ours):
    assert get_model("nanovllm") is NanoVLLM and isinstance(ours, NanoVLLM)
    assert ours.max_length == MAX_MODEL_LEN
    assert ours.llm.llm_engine.limits.num_blocks == ENGINE_OPTIONS["num_kvcache_blocks"]
    wrapped = NanoVLLM(ours.llm)  # an LLM already built: the same engine
    assert wrapped.llm is ours.llm and wrapped.max_length == MAX_MODEL_LEN
    with pytest.raises(ValueError, match="engine options go with a model to load"):
        NanoVLLM(ours.llm, max_num_seqs=4)


def local_choice_task(tmp_path) -> dict:
    """A multiple-choice task over a local JSON file: no dataset download."""
    docs = [{"question": "The capital of France is", "choices": [" Paris", " Rome", " Oslo"],
             "answer": 0},
            {"question": "2 + 2 =", "choices": [" 4", " 5"], "answer": 0},
            {"question": "The sky is", "choices": [" blue", " green", " red", " loud"],
             "answer": 2}]
    path = tmp_path / "choices.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return {"task": "tiny_choice", "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(path)}}, "test_split": "test",
            "output_type": "multiple_choice", "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}


def test_simple_evaluate_equals_hflm(hflm, ours, tmp_path):
    task = local_choice_task(tmp_path)
    tasks = TaskManager(include_defaults=False)  # not lm-eval's whole catalogue: only ours
    results = [simple_evaluate(model=model, tasks=[task], log_samples=True, bootstrap_iters=0,
                               task_manager=tasks) for model in (hflm, ours)]
    expected, actual = (r["results"]["tiny_choice"] for r in results)
    assert actual["acc,none"] == expected["acc,none"]
    assert actual["acc_norm,none"] == expected["acc_norm,none"]
    scores = [[float(resp[0][0]) for sample in r["samples"]["tiny_choice"]
               for resp in sample["resps"]] for r in results]
    assert len(scores[1]) == 9
    assert max(abs(a - e) for a, e in zip(scores[1], scores[0])) <= TOLERANCE


def test_importing_nanovllm_does_not_import_lm_eval():
    code = ("import sys, nanovllm; from nanovllm import LLM, SamplingParams; "
            "import nanovllm.llm, nanovllm.serve.app; "
            "assert 'lm_eval' not in sys.modules, 'lm_eval imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
