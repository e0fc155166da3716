"""A request's answer: whole (after its last delta) or as server-sent events, each choice's deltas
as they come, then the usage chunk when asked, then `data: [DONE]`."""

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel

from nanovllm.serve.engine_client import EngineStopped, RequestStream
from nanovllm.serve.protocol import (
    APIError,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from nanovllm.serve.responses import ChatChoices, ChoiceAccumulator, CompletionChoices, usage

DONE = "data: [DONE]\n\n"


def _event(body: BaseModel | dict) -> str:
    data = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)
    return f"data: {data}\n\n"


def _num_choices(stream: RequestStream) -> int:
    return sum(r.params.n for r in stream.requests)


def completion_response(state, body: CompletionRequest, stream: RequestStream,
                        results: ChoiceAccumulator, prompts: list) -> CompletionResponse:
    choices = CompletionChoices(body, prompts, state.engine.tokenizer, state.token_text)
    return CompletionResponse(
        id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=state.model_name,
        choices=[choices.choice(results.whole(i)) for i in range(_num_choices(stream))],
        usage=usage(stream.num_prompt_tokens, results.num_completion_tokens,
                    results.num_cached_tokens))


def chat_response(state, stream: RequestStream, results: ChoiceAccumulator,
                  choices: ChatChoices) -> ChatCompletionResponse:
    return ChatCompletionResponse(
        id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=state.model_name,
        choices=[choices.choice(results.whole(i)) for i in range(_num_choices(stream))],
        usage=usage(stream.num_prompt_tokens, results.num_completion_tokens,
                    results.num_cached_tokens))


async def completion_events(state, body: CompletionRequest, stream: RequestStream,
                            prompts: list) -> AsyncIterator[str]:
    """A completion's server-sent events: one chunk per choice's delta."""
    choices = CompletionChoices(body, prompts, state.engine.tokenizer, state.token_text)
    chunk = functools.partial(CompletionResponse, id=f"cmpl-{uuid.uuid4().hex}",
                              created=int(time.time()), model=state.model_name)
    async for event in _events(state, body, stream, chunk, choices.choice):
        yield event


async def chat_events(state, stream: RequestStream, choices: ChatChoices) -> AsyncIterator[str]:
    """A chat completion's server-sent events: each choice's role, then its content deltas (and
    its tool calls with its last)."""
    chunk = functools.partial(ChatCompletionChunk, id=f"chatcmpl-{uuid.uuid4().hex}",
                              created=int(time.time()), model=state.model_name)
    roles = chunk(choices=[choices.role_chunk_choice(i) for i in range(_num_choices(stream))])
    async for event in _events(state, choices.request, stream, chunk, choices.chunk_choice,
                               roles):
        yield event


async def _events(state, body, stream: RequestStream, chunk: Callable[..., BaseModel],
                  choice: Callable, first: BaseModel | None = None) -> AsyncIterator[str]:
    """`first`, a chunk per delta, the usage chunk when asked, then DONE; an engine that stops
    sends OpenAI's 503 error body instead."""
    num_tokens = num_cached = 0
    try:
        if first is not None:
            yield _event(first)
        while deltas := await stream.next_deltas():
            for delta in deltas:
                num_tokens += len(delta.token_ids)
                num_cached += delta.num_cached_tokens
                yield _event(chunk(choices=[choice(delta)]))
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _event(chunk(choices=[], usage=usage(stream.num_prompt_tokens, num_tokens,
                                                       num_cached)))
    except EngineStopped as e:
        yield _event(APIError(503, str(e)).body())
    finally:  # a client that left, or a cancelled task, aborts what is unfinished
        state.engine.abort(stream)
    yield DONE
