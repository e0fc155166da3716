"""From OpenAI requests to the engine's SamplingParams, and from the engine's deltas to OpenAI's
choices: the one place the wire format meets the engine's outputs."""

import dataclasses
import json

from nanovllm.llm import conversation_texts
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm.serve.messages import ChoiceDelta
from nanovllm.serve.protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionRequest,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    PromptTokensDetails,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from nanovllm.serve.reasoning import ReasoningStream, split_reasoning
from nanovllm.serve.tools import ToolCallStream, ToolMode, call_id, parse_tool_calls

# Fields passed to SamplingParams under the same name when the request sets them.
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                   "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
                   "skip_special_tokens", "allowed_token_ids", "bad_words")
MIN_LOGPROB = -9999.0  # JSON has no -inf: vLLM's floor
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def check_supported(request):
    """A 400 for a field the engine cannot honour, rather than an answer that ignores it."""
    if request.best_of is not None and request.best_of != request.n:
        raise APIError(400, "best_of other than n is not supported", "best_of")
    if getattr(request, "suffix", None):
        raise APIError(400, "suffix is not supported", "suffix")
    response_format = getattr(request, "response_format", None)
    if response_format and response_format.get("type", "text") not in RESPONSE_FORMATS:
        raise APIError(400, f"response_format type must be one of {', '.join(RESPONSE_FORMATS)}",
                       "response_format")


def sampling_params(request, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None,
                    tool_constraint: StructuredOutputsParams | None = None) -> SamplingParams:
    """The request's sampling fields as SamplingParams; its own checks raise TypeError or
    ValueError naming the field and the value (a 400). At most one constraint: vLLM's
    structured_outputs, response_format, or a tool choice's."""
    fields = {name: getattr(request, name) for name in SAMPLING_FIELDS
              if getattr(request, name) is not None}
    given = {"structured_outputs": vllm_structured_outputs(request.structured_outputs),
             "response_format": structured_outputs(getattr(request, "response_format", None)),
             "tool_choice": tool_constraint}
    given = {name: value for name, value in given.items() if value is not None}
    if len(given) > 1:
        raise APIError(400, f"{' and '.join(given)} each constrain the output: give one")
    structured = next(iter(given.values()), None)
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs, structured_outputs=structured,
                          logit_bias=logit_bias(request.logit_bias), **fields)


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, its token ids JSON's string keys, with int keys (SamplingParams checks
    the ids against the vocabulary and the biases against [-100, 100])."""
    if not bias:
        return None
    by_id = {}
    for key, value in bias.items():
        try:
            by_id[int(key)] = value
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}",
                           "logit_bias") from None
    return by_id


def vllm_structured_outputs(fields: dict | None) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs` request field: StructuredOutputsParams' fields as a dict."""
    if fields is None:
        return None
    known = [f.name for f in dataclasses.fields(StructuredOutputsParams)]
    if unknown := sorted(set(fields) - set(known)):
        raise APIError(400, f"structured_outputs: unknown fields {unknown}; the fields are "
                       f"{', '.join(known)}", "structured_outputs")
    return StructuredOutputsParams(**fields)


def completion_prompt_logprobs(request) -> int | None:
    """echo with logprobs: the prompt's tokens come back with their logprobs too (as vLLM)."""
    return request.logprobs if request.echo else None


def structured_outputs(response_format: dict | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format as structured outputs: json_object, or json_schema's
    {"json_schema": {"schema": {...}}}; text (or none) is None."""
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        return None
    schema = (response_format.get("json_schema") or {}).get("schema")
    if not isinstance(schema, dict):
        raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON schema "
                       "object", "response_format")
    return StructuredOutputsParams(json=schema)


def chat_logprobs_count(request: ChatCompletionRequest) -> int | None:
    """Chat's `logprobs` (a bool) and `top_logprobs` (how many) as SamplingParams.logprobs."""
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None


def chat_messages(request: ChatCompletionRequest) -> list[dict]:
    """The messages as {"role", "content": str} dicts for the chat template (text parts only),
    with an assistant's tool calls (their JSON arguments as objects, as templates read them)
    and a tool answer's call id."""
    messages = []
    for i, message in enumerate(request.messages):
        content = message.content
        if isinstance(content, list):
            if any(part.get("type") != "text" or not isinstance(part.get("text"), str)
                   for part in content):
                raise APIError(400, f"messages[{i}].content: only text parts "
                               "({'type': 'text', 'text': str}) are supported", "messages")
            content = "".join(part["text"] for part in content)
        entry = {"role": message.role, "content": content or ""}
        if message.tool_calls:
            entry["tool_calls"] = [_template_call(call) for call in message.tool_calls]
        for name in ("tool_call_id", "name"):
            if getattr(message, name) is not None:
                entry[name] = getattr(message, name)
        messages.append(entry)
    if not messages:
        raise APIError(400, "messages must not be empty", "messages")
    return messages


def _template_call(call: ToolCall) -> dict:
    entry = call.model_dump()
    try:
        entry["function"]["arguments"] = json.loads(call.function.arguments)
    except ValueError:
        pass  # not JSON: the template gets the text
    return entry


def chat_prompt(request, tokenizer) -> str:
    """The request's messages rendered by the chat template with its options (a chat completion
    or a /tokenize request); a 400 naming what the template or the options refused."""
    try:
        (text,) = conversation_texts(
            tokenizer, chat_messages(request), add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs,
            tools=[t.model_dump(exclude_none=True) for t in request.tools or ()] or None)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), "messages") from None
    except Exception as e:  # the template itself refused (jinja's raise_exception)
        raise APIError(400, f"the chat template failed: {e}", "messages") from None
    return text


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> Usage:
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                 total_tokens=num_prompt_tokens + num_completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens))


class TokenText:
    """Each token id's own text, as logprobs show it (decoded alone, cached)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def completion_logprobs(delta: ChoiceDelta, token_text: TokenText,
                        text_offset: int) -> CompletionLogprobs:
    """A delta's logprobs in the completions format, the echoed prompt's first when it has them
    (its first token's null: nothing precedes it); offsets count from `text_offset`."""
    result = CompletionLogprobs()
    if delta.prompt_logprobs is not None:
        prompt = delta.prompt_token_ids
        text_offset = _add_logprobs(result, prompt, [None, *delta.prompt_logprobs], token_text,
                                    text_offset)
    if delta.logprobs is not None:
        _add_logprobs(result, delta.token_ids, delta.logprobs, token_text, text_offset)
    return result


def _add_logprobs(result: CompletionLogprobs, token_ids: list[int],
                  logprobs: list[dict[int, float] | None], token_text: TokenText,
                  text_offset: int) -> int:
    """Append each token (its text, logprob, top logprobs by text and offset); the offset after."""
    for token_id, entries in zip(token_ids, logprobs):
        text = token_text(token_id)
        result.tokens.append(text)
        result.text_offset.append(text_offset)
        text_offset += len(text)
        if entries is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(max(entries[token_id], MIN_LOGPROB))
        result.top_logprobs.append({token_text(t): max(lp, MIN_LOGPROB)
                                    for t, lp in entries.items()})
    return text_offset


def chat_logprobs(delta: ChoiceDelta, token_text: TokenText, top: int) -> ChatLogprobs:
    """A delta's logprobs in the chat format: each token with its `top` most likely."""

    def entry(token_id: int, logprob: float) -> TopLogprob:
        text = token_text(token_id)
        return TopLogprob(token=text, logprob=max(logprob, MIN_LOGPROB),
                          bytes=list(text.encode("utf-8")))

    content = []
    for token_id, logprobs in zip(delta.token_ids, delta.logprobs):
        # The sampled token comes first; the rest are the top ones, by rank.
        best = sorted(logprobs.items(), key=lambda item: -item[1])[:top]
        sampled = entry(token_id, logprobs[token_id])
        content.append(TokenLogprob(**sampled.model_dump(),
                                    top_logprobs=[entry(t, lp) for t, lp in best]))
    return ChatLogprobs(content=content)


class ChoiceAccumulator:
    """A non-streamed response's choices, grown delta by delta."""

    def __init__(self, num_choices: int):
        self.text = [""] * num_choices
        self.token_ids: list[list[int]] = [[] for _ in range(num_choices)]
        self.logprobs: list[list[dict[int, float]] | None] = [None] * num_choices
        self.finish: list[tuple[str | None, int | str | None]] = [(None, None)] * num_choices
        self.prompts: list[tuple[list[int] | None, list | None]] = [(None, None)] * num_choices
        self.num_cached_tokens = 0

    def add(self, delta: ChoiceDelta):
        i = delta.index
        self.num_cached_tokens += delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompts[i] = (delta.prompt_token_ids, delta.prompt_logprobs)
        self.text[i] += delta.text
        self.token_ids[i] += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs[i] = (self.logprobs[i] or []) + delta.logprobs
        if delta.finish_reason is not None:
            self.finish[i] = (delta.finish_reason, delta.stop_reason)

    def whole(self, i: int) -> ChoiceDelta:
        """Choice i as one delta from its start."""
        return ChoiceDelta(i, self.text[i], self.token_ids[i], self.logprobs[i], *self.finish[i],
                           *self.prompts[i])

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)


class CompletionChoices:
    """One completion request's choices from its deltas: the echoed prompt first, logprobs with
    their text offsets, token ids when asked."""

    def __init__(self, request, prompts: list, tokenizer, token_text: TokenText):
        self.request, self.token_text = request, token_text
        self.n = request.n
        self.echo = None
        if request.echo:  # each prompt's text, once, ahead of its choices' first text
            self.echo = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
        self.started: set[int] = set()
        self.offsets: dict[int, int] = {}

    def choice(self, delta: ChoiceDelta) -> CompletionChoice:
        i = delta.index
        text = delta.text
        if self.echo is not None and i not in self.started:
            text = self.echo[i // self.n] + text
        self.started.add(i)
        logprobs = None
        if delta.logprobs is not None or delta.prompt_logprobs is not None:
            logprobs = completion_logprobs(delta, self.token_text, self.offsets.get(i, 0))
            if logprobs.tokens:
                self.offsets[i] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        token_ids = delta.token_ids if self.request.return_token_ids else None
        return CompletionChoice(index=i, text=text, logprobs=logprobs,
                                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                                token_ids=token_ids)


class ChatChoices:
    """One chat request's choices (whole) or chunk choices (deltas). With a reasoning parser
    (`thinking`: prompt_thinking's answer) the reasoning comes apart from the content; under a
    tool mode, the content is read as tool calls."""

    def __init__(self, request: ChatCompletionRequest, token_text: TokenText,
                 tool_mode: ToolMode | None = None, thinking: str | None = None):
        self.request, self.token_text = request, token_text
        self.tool_mode, self.thinking = tool_mode, thinking
        self.streams: dict[int, tuple[ReasoningStream | None, ToolCallStream | None]] = {}

    def _logprobs(self, delta: ChoiceDelta) -> ChatLogprobs | None:
        if delta.logprobs is None:
            return None
        return chat_logprobs(delta, self.token_text, self.request.top_logprobs or 0)

    def _token_ids(self, delta: ChoiceDelta) -> list[int] | None:
        return delta.token_ids if self.request.return_token_ids else None

    def _finish_reason(self, delta: ChoiceDelta, calls: list) -> str | None:
        """A call ends its choice with "tool_calls", as OpenAI's; a named function's with "stop"."""
        if calls and delta.finish_reason == "stop" and self.tool_mode.kind != "named":
            return "tool_calls"
        return delta.finish_reason

    def choice(self, delta: ChoiceDelta) -> ChatChoice:
        reasoning, content, calls = None, delta.text, []
        if self.thinking is not None:
            reasoning, content = split_reasoning(content, self.thinking)
            content = content or None
        if self.tool_mode is not None and content is not None:
            content, calls = parse_tool_calls(content, self.tool_mode)
        message = AssistantMessage(content=content, reasoning=reasoning, tool_calls=[
            ToolCall(id=call_id(), function=call) for call in calls] or None)
        return ChatChoice(index=delta.index, message=message, logprobs=self._logprobs(delta),
                          finish_reason=self._finish_reason(delta, calls),
                          stop_reason=delta.stop_reason, token_ids=self._token_ids(delta))

    @staticmethod
    def role_chunk_choice(index: int) -> ChatChunkChoice:
        """A choice's first chunk: the assistant's role, no text yet (as OpenAI)."""
        return ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))

    def chunk_choice(self, delta: ChoiceDelta) -> ChatChunkChoice:
        finished = delta.finish_reason is not None
        reasoning_stream, tool_stream = self.streams.setdefault(delta.index, (
            None if self.thinking is None else ReasoningStream(self.thinking),
            None if self.tool_mode is None else ToolCallStream(self.tool_mode)))
        reasoning, content, calls = None, delta.text, []
        if reasoning_stream is not None:
            reasoning, content = reasoning_stream.feed(content, finished)
        if tool_stream is not None:
            content, calls = tool_stream.feed(content, finished)
        tool_calls = [ToolCallDelta(index=k, id=call_id(), function=call)
                      for k, call in enumerate(calls)] or None
        return ChatChunkChoice(
            index=delta.index,
            delta=Delta(content=content, reasoning=reasoning or None, tool_calls=tool_calls),
            logprobs=self._logprobs(delta), finish_reason=self._finish_reason(delta, calls),
            stop_reason=delta.stop_reason, token_ids=self._token_ids(delta))
