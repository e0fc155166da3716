"""A chat choice's text read as reasoning and content (split_reasoning, ReasoningStream) and as
tool calls (parse_tool_calls, ToolCallStream): whole and streamed, which must agree however the
text is cut into deltas."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanovllm.serve.protocol import FunctionCall
from nanovllm.serve.reasoning import (
    CLOSED,
    OPEN,
    OWN,
    ReasoningStream,
    prompt_thinking,
    split_reasoning,
)
from nanovllm.serve.tools import ToolCallStream, ToolMode, parse_tool_calls

AUTO, REQUIRED, NAMED = ToolMode("auto"), ToolMode("required"), ToolMode("named", "add")
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def call(name: str, **arguments) -> FunctionCall:
    return FunctionCall(name=name, arguments=json.dumps(arguments))


@pytest.mark.parametrize("text, content, calls", [
    ("no call here", "no call here", []),
    (WEATHER, None, [call("get_weather", city="Paris")]),
    ("Let me check.\n" + WEATHER + "\n" + ADD, "Let me check.",
     [call("get_weather", city="Paris"), call("add", a=1, b=2)]),
    # Cut short after its JSON, before the end tag: still a call.
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', None, [call("add", a=1, b=2)]),
    # Arguments given as JSON text are passed on as they are.
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', None,
     [FunctionCall(name="add", arguments='{"a": 1}')]),
    # Not a call after all: the whole text is the content.
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>\n{"name": "add", "argu', '<tool_call>\n{"name": "add", "argu', []),
])
def test_hermes_calls_in_free_text(text, content, calls):
    assert parse_tool_calls(text, AUTO) == (content, calls)


def test_required_and_named_calls():
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "f", "parameters": {}}]'
    assert parse_tool_calls(text, REQUIRED) == (None, [call("add", a=1, b=2), call("f")])
    assert parse_tool_calls('[{"name": "add"', REQUIRED) == ('[{"name": "add"', [])
    assert parse_tool_calls('[{"name": 3, "parameters": {}}]', REQUIRED)[1] == []
    assert parse_tool_calls('{"a": 1}', NAMED) == (None, [FunctionCall(name="add",
                                                                       arguments='{"a": 1}')])
    assert parse_tool_calls('{"a": ', NAMED) == ('{"a": ', [])


def streamed(text: str, cuts: list[int], mode: ToolMode) -> tuple[str | None, list, list[str]]:
    """The text fed in pieces cut at `cuts`: (the content sent, the calls, each piece's content)."""
    stream = ToolCallStream(mode)
    bounds = [0, *sorted(set(cuts)), len(text)]
    pieces, calls = [], []
    for k, (start, end) in enumerate(zip(bounds, bounds[1:])):
        content, calls = stream.feed(text[start:end], finished=k == len(bounds) - 2)
        pieces.append(content)
    sent = [p for p in pieces if p is not None]
    return ("".join(sent) if sent else None), calls, pieces


TEXTS = ["no call here", WEATHER, "Let me check.\n" + WEATHER + ADD, "a <tool ticket",
         "ends in <tool_ca", "<tool_call>\n{not json}\n</tool_call>", "x<tool_call" + WEATHER]


@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 80), max_size=6))
def test_a_stream_agrees_with_the_whole_text_however_cut(text, cuts):
    content, calls = parse_tool_calls(text, AUTO)
    sent, streamed_calls, pieces = streamed(text, [c for c in cuts if c < len(text)], AUTO)
    assert (sent or None, streamed_calls) == (content, calls)


def test_a_tail_that_may_start_a_call_waits_for_the_next_delta():
    text = "Sure<tool_call>" + WEATHER[len("<tool_call>"):]
    assert streamed(text, [9, 20], AUTO)[2] == ["Sure", "", ""]
    # White space may come before a call, so it waits too.
    assert streamed("a <tool ticket", [7], AUTO)[2] == ["a", " <tool ticket"]


def test_required_and_named_streams_hold_everything_until_the_end():
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}]'
    sent, calls, pieces = streamed(text, [5, 17, 30], REQUIRED)
    assert pieces[:-1] == [None, None, None] and sent is None
    assert calls == [call("add", a=1, b=2)]
    assert streamed('{"a": 1', [3], NAMED)[:2] == ('{"a": 1', [])


@pytest.mark.parametrize("text, thinking, reasoning, content", [
    ("plain answer", OWN, None, "plain answer"),
    ("<think>\nweigh it\n</think>\n\nYes.", OWN, "\nweigh it\n", "\n\nYes."),
    ("weigh it</think>Yes.", OPEN, "weigh it", "Yes."),
    ("still weighing", OPEN, "still weighing", ""),  # cut short while thinking
    ("<think>still", OWN, "still", ""),
    ("</think>Yes.", OPEN, None, "Yes."),
    ("a <think> in passing", OWN, None, "a <think> in passing"),
    ("<think>x</think>y", CLOSED, None, "<think>x</think>y"),  # thinking switched off
])
def test_reasoning_apart_from_content(text, thinking, reasoning, content):
    assert split_reasoning(text, thinking) == (reasoning, content)


def test_where_the_prompt_ends_says_where_the_output_starts():
    assert prompt_thinking("<|im_start|>assistant\n<think>\n") == OPEN
    assert prompt_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n") == CLOSED
    # An earlier turn's think block does not count: only where the prompt ends.
    assert prompt_thinking("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n") == OWN


REASONED = ["<think>\nweigh it\n</think>\n\nYes.", "weigh it</think>Yes.", "plain",
            "<thin", "<think>cut </thi", "a </think", "<t<think>x</think>"]


@given(st.sampled_from(REASONED), st.sampled_from([OPEN, CLOSED, OWN]),
       st.lists(st.integers(0, 40), max_size=6))
def test_a_reasoning_stream_agrees_with_the_whole_text_however_cut(text, thinking, cuts):
    stream = ReasoningStream(thinking)
    bounds = [0, *sorted({c for c in cuts if c < len(text)}), len(text)]
    reasoning = content = ""
    for k, (start, end) in enumerate(zip(bounds, bounds[1:])):
        new_reasoning, new_content = stream.feed(text[start:end], finished=k == len(bounds) - 2)
        reasoning, content = reasoning + new_reasoning, content + new_content
    whole = split_reasoning(text, thinking)
    assert (reasoning or None, content) == whole
