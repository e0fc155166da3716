"""Tool calling on /v1/chat/completions, as vLLM does it. The tools reach the chat template. With
tool_choice "required" or a named function, structured outputs constrain the text to calls of
the tools (a JSON array of {"name", "parameters"}, or the named function's arguments). With
"auto" (the server started with --enable-auto-tool-choice --tool-call-parser hermes), the model's
own calls are read out of its text in the Hermes format that Qwen2.5 and Qwen3 write:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

import json
import re
import uuid
from dataclasses import dataclass

from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.serve.protocol import APIError, ChatCompletionRequest, FunctionCall
from nanovllm.serve.reasoning import held_tail

TOOL_CALL_PARSERS = ("hermes",)
START, END = "<tool_call>", "</tool_call>"
# Each call from its start tag to its end tag, or to the end of a text cut short.
CALL = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolMode:
    """How a request's output becomes tool calls: "auto" (parsed out of free text), "required"
    (a constrained JSON array of calls) or "named" (the constrained arguments of `name`)."""

    kind: str
    name: str | None = None


def tool_mode(request: ChatCompletionRequest, auto_parser: str | None) -> ToolMode | None:
    """The request's tool_choice, checked (a 400 naming what is wrong); None for plain text.
    Unset, it is "auto" when tools are given, as OpenAI's."""
    if request.tools is not None and not request.tools:
        raise APIError(400, "tools must not be empty: give at least one tool or leave the field "
                       "out", "tools")
    choice = request.tool_choice or ("auto" if request.tools else "none")
    if choice == "none":
        return None
    if not request.tools:
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    if choice == "auto":
        if auto_parser is None:
            raise APIError(400, 'tool_choice "auto" needs the server started with '
                           "--enable-auto-tool-choice --tool-call-parser hermes; "
                           '"none", "required" and a named function need neither', "tool_choice")
        return ToolMode("auto")
    if choice == "required":
        return ToolMode("required")
    names = [tool.function.name for tool in request.tools]
    if choice.function.name not in names:
        raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is "
                       f"not among the tools ({', '.join(map(repr, names))})", "tool_choice")
    return ToolMode("named", choice.function.name)


def tool_constraint(request: ChatCompletionRequest,
                    mode: ToolMode | None) -> StructuredOutputsParams | None:
    """The structured output a required or named tool choice generates under: JSON laid out as
    json.dumps lays it out (", " and ": "), so that a model cannot pad a call with whitespace."""
    if mode is None or mode.kind == "auto":
        return None
    schemas = {tool.function.name: tool.function.parameters or {"type": "object"}
               for tool in request.tools}
    if mode.kind == "named":
        return StructuredOutputsParams(json=schemas[mode.name], disable_any_whitespace=True)
    call = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
             "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema}}
            for name, schema in schemas.items()]
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
    if not request.parallel_tool_calls:
        calls["maxItems"] = 1
    return StructuredOutputsParams(json=calls, disable_any_whitespace=True)


def parse_tool_calls(text: str, mode: ToolMode) -> tuple[str | None, list[FunctionCall]]:
    """(the content, the calls) of a choice's whole text (the content before a call, without its
    trailing white space, or None); (text, []) where it holds no call
    that parses (a text cut short by max_tokens, a model that wrote something else)."""
    try:
        if mode.kind == "named":
            json.loads(text)
            return None, [FunctionCall(name=mode.name, arguments=text)]
        if mode.kind == "required":
            return None, [_call(call["name"], call["parameters"]) for call in json.loads(text)]
        start = text.find(START)
        if start < 0:
            return text, []
        calls = [json.loads(block) for block in CALL.findall(text, start)]
        content = text[:start].rstrip() or None
        return content, [_call(c["name"], c.get("arguments", {})) for c in calls]
    except (ValueError, TypeError, KeyError, AttributeError):
        return text, []


def _call(name: str, arguments) -> FunctionCall:
    if not isinstance(name, str):
        raise TypeError(f"a call's name must be a string, got {name!r}")
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return FunctionCall(name=name, arguments=text)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """One choice's text as it streams under a tool mode. "auto" passes the content on until a
    call may begin (a tail that could start the tag, and white space before it, wait for the
    next delta); "required" and "named" hold everything. The last delta brings what is left and
    the calls, parsed from the whole text once."""

    def __init__(self, mode: ToolMode):
        self.mode = mode
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.start = -1  # where the first call's tag begins, once seen

    def feed(self, text: str, finished: bool) -> tuple[str | None, list[FunctionCall]]:
        """(the content to send now, the calls: only with the last delta)."""
        searched = max(0, len(self.text) - len(START) + 1)  # a tag may straddle the deltas
        self.text += text
        if finished:
            content, calls = parse_tool_calls(self.text, self.mode)
            return (None if content is None else content[self.sent:]), calls
        if self.mode.kind != "auto":
            return None, []
        if self.start < 0:
            self.start = self.text.find(START, searched)
        end = self.start if self.start >= 0 else len(self.text) - held_tail(self.text, START)
        content = self.text[self.sent:end].rstrip()
        self.sent += len(content)
        return content, []
