"""lm-eval's API models against the server: `local-completions`' loglikelihoods are the offline
engine's (nanovllm.lm_eval over the same LLM), through echo with logprobs, whether it tokenizes
itself or through the server; `local-chat-completions`' generations are offline chat's."""

import json

import pytest
from conftest import MODEL_NAME, REQUEST_TIMEOUT
from lm_eval.api.instance import Instance
from lm_eval.models.api_models import JsonChatStr
from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

from nanovllm import SamplingParams
from nanovllm.lm_eval import NanoVLLM

pytestmark = pytest.mark.cpu_suite

PAIRS = [
    ("The capital of France is", " Paris"),
    ("Hello", " world!"),
    ("", "abc"),  # an empty context: scored after the EOS token, on both sides
    ("Question: 2 + 2 =", " 4\nAnswer: four"),
]
# The same engine and weights serve both sides, and each prompt's logprobs are computed by the
# same kernels; a batch's make-up may change a float32 reduction's order (a few ulps of a logit
# of magnitude ~10, ~1e-6), far inside 1e-4 for a sum of a dozen tokens. JSON carries the floats
# exactly (the shortest repr that reads back the same double).
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def local_completions(server, tiny_model, llm):
    """lm-eval's client: token-id prompts, tokenized by the checkpoint's own tokenizer."""
    return LocalCompletionsAPI(
        base_url=f"{server.url}/v1/completions", model=MODEL_NAME, tokenizer=tiny_model,
        tokenizer_backend="huggingface", tokenized_requests=True,
        max_length=llm.llm_engine.limits.max_model_len, num_concurrent=1, max_retries=1,
        timeout=int(REQUEST_TIMEOUT))


@pytest.fixture(scope="module")
def remote_tokenizer_completions(server, llm):
    """lm-eval's client left to its defaults: it finds /tokenizer_info and /tokenize and
    tokenizes through the server, with no tokenizer of its own."""
    return LocalCompletionsAPI(
        base_url=f"{server.url}/v1/completions", model=MODEL_NAME,
        max_length=llm.llm_engine.limits.max_model_len, num_concurrent=1, max_retries=1,
        timeout=int(REQUEST_TIMEOUT))


def assert_loglikelihoods_equal_offline(model, llm):
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]
    served = model.loglikelihood(requests, disable_tqdm=True)
    offline = NanoVLLM(llm).loglikelihood(requests, disable_tqdm=True)
    worst = max(abs(s[0] - o[0]) for s, o in zip(served, offline))
    assert worst <= TOLERANCE, (worst, served, offline)
    assert [s[1] for s in served] == [o[1] for o in offline]


def test_local_completions_loglikelihood_equals_offline(local_completions, llm):
    assert_loglikelihoods_equal_offline(local_completions, llm)


def test_remote_tokenizer_loglikelihood_equals_offline(remote_tokenizer_completions, llm):
    assert remote_tokenizer_completions.tokenizer_backend == "remote"
    assert remote_tokenizer_completions.eot_token_id == llm.tokenizer.eos_token_id
    assert_loglikelihoods_equal_offline(remote_tokenizer_completions, llm)


def test_local_chat_completions_generate_until_equals_offline_chat(server, llm):
    """lm-eval's chat model (messages as the task's JSON, greedy, the task's stop strings)."""
    chat = LocalChatCompletion(base_url=f"{server.url}/v1/chat/completions", model=MODEL_NAME,
                               num_concurrent=1, max_retries=1, timeout=int(REQUEST_TIMEOUT))
    conversations = [[{"role": "user", "content": "Hello there"}],
                     [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Question: 2 + 2 ="}]]
    until = {"until": ["\n\n", "Question:"], "max_gen_toks": 12}
    requests = [Instance("generate_until", {}, (JsonChatStr(json.dumps(c)), until), i)
                for i, c in enumerate(conversations)]
    served = chat.generate_until(requests, disable_tqdm=True)
    params = SamplingParams(temperature=0, max_tokens=12, stop=until["until"])
    offline = [out.outputs[0].text for out in llm.chat(conversations, params, use_tqdm=False)]
    assert served == offline
