"""Refused requests: OpenAI's error body with the documented status, the others unharmed."""

import threading

import openai
import pytest
from conftest import MODEL_NAME
from serve_helpers import assert_error, post, request

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def test_malformed_json_is_a_400(server):
    assert_error(*post(server, COMPLETIONS, b'{"prompt": "x", '), 400, "not valid JSON")
    assert_error(*post(server, CHAT, b"not json"), 400, "not valid JSON")


@pytest.mark.parametrize("field, value, words", [
    ("max_tokens", "5", ["max_tokens", "'5'"]),
    ("temperature", "hot", ["temperature"]),
    ("stream", 1.5, ["stream"]),
    ("prompt", 5, ["prompt must be one of", "5"]),
    ("stop", [1, 2], ["stop"]),
])
def test_a_wrong_type_is_a_400_naming_the_field(server, field, value, words):
    status, body = post(server, COMPLETIONS, {"model": MODEL_NAME, "prompt": "x", field: value})
    assert_error(status, body, 400, *words)
    assert body["error"]["param"] == field
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("field, value, words", [
    ("temperature", -1.0, ["temperature must be >= 0", "-1.0"]),
    ("top_p", 0.0, ["top_p"]),
    ("n", 0, ["n must be >= 1"]),
    ("max_tokens", 0, ["max_tokens"]),
    ("logprobs", 50, ["logprobs", "50"]),
])
def test_an_invalid_value_gets_the_engines_message(server, field, value, words):
    assert_error(*post(server, COMPLETIONS, {"model": MODEL_NAME, "prompt": "x", field: value}),
                 400, *words)


def test_a_prompt_past_max_model_len_is_a_400(server, llm):
    limit = llm.llm_engine.limits.max_model_len
    status, body = post(server, COMPLETIONS, {"model": MODEL_NAME, "prompt": [7] * (limit + 1),
                                              "max_tokens": 4})
    assert_error(status, body, 400, str(limit + 1), f"max_model_len={limit}")
    status, body = post(server, CHAT, {"model": MODEL_NAME, "max_tokens": 4,
                                       "messages": [{"role": "user", "content": "x" * limit}]})
    assert_error(status, body, 400, f"max_model_len={limit}")


def test_missing_and_unsupported_fields(server):
    assert_error(*post(server, COMPLETIONS, {"model": MODEL_NAME}), 400, "prompt")
    assert_error(*post(server, COMPLETIONS, {"prompt": []}), 400, "prompt must not be empty")
    assert_error(*post(server, CHAT, {"messages": []}), 400, "messages")
    assert_error(*post(server, COMPLETIONS, {"prompt": "x", "echo": True, "logprobs": 50}), 400,
                 "logprobs", "50")
    assert_error(*post(server, COMPLETIONS, {"prompt": "x", "best_of": 3}), 400, "best_of")
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert_error(*post(server, CHAT, {"messages": [{"role": "user", "content": "x"}],
                                      "tools": tools}), 400, '"auto"',
                 "--enable-auto-tool-choice --tool-call-parser hermes")
    assert_error(*post(server, CHAT, {"messages": [{"role": "user", "content": "x"}],
                                      "top_logprobs": 2}), 400, "logprobs=true")


def test_an_unknown_model_is_a_404(server, client):
    status, body = post(server, COMPLETIONS, {"model": "gpt-4", "prompt": "x"})
    assert_error(status, body, 404, "'gpt-4'", MODEL_NAME)
    assert body["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_bad_requests_do_not_disturb_a_running_stream(server, client):
    expected = client.completions.create(model=MODEL_NAME, prompt="steady", temperature=0,
                                         max_tokens=24).choices[0].text
    got = []

    def stream():
        chunks = client.completions.create(model=MODEL_NAME, prompt="steady", temperature=0,
                                           max_tokens=24, stream=True)
        got.extend(c.choices[0].text for c in chunks)

    thread = threading.Thread(target=stream)
    thread.start()
    for _ in range(10):
        post(server, COMPLETIONS, b"{")
        post(server, COMPLETIONS, {"prompt": "x", "temperature": -3.0})
        post(server, COMPLETIONS, {"prompt": [1] * 1000})
    thread.join(120)
    assert "".join(got) == expected
    status, _ = request(server, "/health")
    assert status == 200
