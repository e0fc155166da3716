"""Tool calling and reasoning on /v1/chat/completions with the official client: required and named
tool choices constrain the output to valid calls (the tiny checkpoint's text is noise: only the
mask makes them), "auto" reads Hermes calls out of the text and the qwen3 reasoning parser its
think block, whole and streamed alike; the tools and earlier calls reach the chat template; bad
tool requests are 400s."""

import json
import re

import pytest
from conftest import ENGINE_OPTIONS, MODEL_NAME
from serve_helpers import assert_error, client_for, post

from nanovllm import LLM, SamplingParams
from nanovllm.serve.server import ServerThread

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

CHAT = "/v1/chat/completions"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
    "metric": {"type": "boolean"}}, "required": ["city", "metric"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"exact": {"type": "boolean"}}, "required": ["exact"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# A Hermes call the model is made to write (regex-constrained), as Qwen3 writes its own.
OPTIONS = {**ENGINE_OPTIONS, "max_model_len": 1024}
HERMES = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
          r'\{"city": "(Paris|Tokyo)", "metric": (true|false)\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def server(tiny_model):
    """The tools' JSON is a long prompt in the tiny vocabulary (a few characters a token)."""
    with ServerThread(tiny_model, MODEL_NAME, engine_options=OPTIONS,
                      tool_parser="hermes", reasoning_parser="qwen3") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with client_for(server) as client:
        yield client


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def streamed(client, reasoning: list | None = None,
             **request) -> tuple[str | None, list[tuple[str, dict]], str]:
    """(content, calls, finish reason) of a streamed one-choice answer, its deltas joined; the
    reasoning deltas appended to `reasoning`."""
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        (choice,) = chunk.choices
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        if getattr(choice.delta, "reasoning", None) and reasoning is not None:
            reasoning.append(choice.delta.reasoning)
        for call in choice.delta.tool_calls or []:
            assert call.id.startswith("call_") and call.type == "function"
            calls[call.index] = (call.function.name, json.loads(call.function.arguments))
        finish = choice.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def test_required_tool_choice_makes_valid_calls(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                              tool_choice="required", n=4, temperature=1.0,
                                              seed=3, max_tokens=120)
    called = [c for c in response.choices if c.finish_reason == "tool_calls"]
    assert called
    for choice in called:
        assert choice.message.content is None and choice.message.tool_calls
        for name, arguments in calls_of(choice.message):
            jsonschema.validate(arguments, SCHEMAS[name])


def test_a_named_function_gets_its_arguments(client):
    request = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=0,
                   max_tokens=60, tool_choice={"type": "function", "function": {"name": "add"}})
    response = client.chat.completions.create(**request)
    (choice,) = response.choices
    assert choice.finish_reason == "stop"  # as OpenAI's, for a named function
    ((name, arguments),) = calls_of(choice.message)
    assert name == "add"
    jsonschema.validate(arguments, ADD)
    assert streamed(client, **request) == (None, [(name, arguments)], "stop")


def test_auto_reads_the_models_own_calls_whole_and_streamed(client):
    request = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=0,
                   max_tokens=200, extra_body={"structured_outputs": {"regex": HERMES}})
    response = client.chat.completions.create(**request)
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."  # the white space before the call left out
    ((name, arguments),) = calls_of(choice.message)
    assert name == "get_weather"
    jsonschema.validate(arguments, WEATHER)
    assert streamed(client, **request) == ("Checking.", [(name, arguments)], "tool_calls")


def test_auto_without_a_call_is_the_text_as_offline_chat_with_tools(client, tiny_model):
    with LLM(tiny_model, **OPTIONS) as llm:
        offline = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False,
                           tools=TOOLS)[0].outputs[0]
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                              temperature=0, max_tokens=12)
    (choice,) = response.choices
    assert choice.message.content == offline.text and choice.message.tool_calls is None
    assert choice.finish_reason == offline.finish_reason
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0,
                                           max_tokens=12)
    assert response.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools were rendered


def test_earlier_calls_and_answers_reach_the_template(server):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    status, body = post(server, "/tokenize", {"messages": messages, "tools": TOOLS})
    assert status == 200, body
    status, text = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert '"name": "get_weather"' in text["prompt"]  # the tools' list
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text["prompt"]
    assert "<tool_response>\nsunny\n</tool_response>" in text["prompt"]


@pytest.mark.parametrize("body, words", [
    ({"tools": []}, ["tools must not be empty"]),
    ({"tool_choice": "required"}, ["tool_choice needs tools"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
     ["'mul'", "'get_weather', 'add'"]),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     ["response_format and tool_choice"]),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, ["tool_choice"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
      "tool_choice": "required"}, ["objec"]),
])
def test_bad_tool_requests_are_400s(server, body, words):
    assert_error(*post(server, CHAT, {"messages": MESSAGES, **body}), 400, *words)


@pytest.mark.parametrize("messages, text, reasoning, content", [
    # The model opens its think block itself (Qwen3's own template).
    (MESSAGES, "<think>\nweigh it\n</think>\n\nThe answer.", "\nweigh it\n", "\n\nThe answer."),
    # The prompt opened it (here by continuing an assistant message that starts one).
    (MESSAGES + [{"role": "assistant", "content": "<think>\n"}], "weigh it\n</think>\n\nDone.",
     "weigh it\n", "\n\nDone."),
])
def test_reasoning_comes_apart_from_the_content(client, messages, text, reasoning, content):
    continuing = messages[-1]["role"] == "assistant"
    request = dict(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=120,
                   extra_body={"structured_outputs": {"regex": re.escape(text)},
                               "add_generation_prompt": not continuing,
                               "continue_final_message": continuing})
    (choice,) = client.chat.completions.create(**request).choices
    assert (choice.message.reasoning, choice.message.content) == (reasoning, content)
    assert choice.finish_reason == "stop"
    pieces = []
    assert streamed(client, pieces, **request) == (content, [], "stop")
    assert "".join(pieces) == reasoning


def test_reasoning_then_a_call(client):
    thought = "<think>\nI should look it up.\n</think>\n\n"
    request = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=0,
                   max_tokens=240, extra_body={"structured_outputs": {
                       "regex": re.escape(thought) + HERMES[len(r"Checking\.\n"):]}})
    (choice,) = client.chat.completions.create(**request).choices
    assert choice.message.reasoning == "\nI should look it up.\n"
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    ((name, arguments),) = calls_of(choice.message)
    assert name == "get_weather"
    jsonschema.validate(arguments, WEATHER)
    pieces = []
    assert streamed(client, pieces, **request) == (None, [(name, arguments)], "tool_calls")
    assert "".join(pieces) == choice.message.reasoning


def test_thinking_switched_off_is_all_content(client):
    """enable_thinking=False: the template closes an empty think block, so a <think> the model
    writes is content."""
    text = "<think>not reasoning</think>ok"
    (choice,) = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=60,
        extra_body={"structured_outputs": {"regex": re.escape(text)},
                    "chat_template_kwargs": {"enable_thinking": False}}).choices
    assert (choice.message.reasoning, choice.message.content) == (None, text)
