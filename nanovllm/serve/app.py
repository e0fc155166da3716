"""The OpenAI-compatible HTTP app: /v1/models, /v1/completions, /v1/chat/completions, /health,
/metrics and vLLM's /tokenize, /detokenize and /tokenizer_info, over one engine in a process of
its own (an EngineClient)."""

import asyncio
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers

from nanovllm.serve import tokenization
from nanovllm.serve.engine_client import EngineClient, EngineStopped, RequestStream
from nanovllm.serve.metrics import ServerMetrics
from nanovllm.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    parse_request,
)
from nanovllm.serve.reasoning import prompt_thinking
from nanovllm.serve.responses import (
    ChatChoices,
    ChoiceAccumulator,
    TokenText,
    chat_logprobs_count,
    chat_prompt,
    check_supported,
    completion_prompt_logprobs,
    sampling_params,
)
from nanovllm.serve.streams import (
    chat_events,
    chat_response,
    completion_events,
    completion_response,
)
from nanovllm.serve.tools import tool_constraint, tool_mode


@dataclass
class ServerState:
    """What every handler shares: the engine, the names and the metrics."""

    engine: EngineClient
    model_name: str
    api_key: str | None = None
    metrics: ServerMetrics = None
    tool_parser: str | None = None  # tool_choice "auto" reads calls in this format
    reasoning_parser: str | None = None  # a thinking model's reasoning comes apart
    draining: bool = False  # set on SIGTERM: new requests get 503
    created: int = field(default_factory=lambda: int(time.time()))
    token_text: TokenText = None

    def __post_init__(self):
        self.metrics = self.metrics or ServerMetrics(self.model_name)
        self.token_text = TokenText(self.engine.tokenizer)

    @property
    def unavailable(self) -> str | None:
        """Why /v1 answers 503 now (shutting down, or the engine failed); None while serving."""
        if self.engine.error is not None:
            return self.engine.error
        if self.draining or not self.engine.alive:
            return "the server is shutting down"
        return None


def build_app(engine: EngineClient, model_name: str, api_key: str | None = None,
              tokenizer_info: bool = False, tool_parser: str | None = None,
              reasoning_parser: str | None = None, chat_template: str | None = None,
              cors: dict | None = None) -> FastAPI:
    """The app over a started engine: the app's lifespan hands it the event loop, and its end
    stops the engine (the process exits). GET /tokenizer_info only with `tokenizer_info` (as
    vLLM: it shows the chat template); tool_choice "auto" only with a `tool_parser`; the
    reasoning apart from the content only with a `reasoning_parser`; chats rendered with
    `chat_template` in place of the tokenizer's; `cors`: CORSMiddleware's arguments."""
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template  # the server renders every chat
    state = ServerState(engine, model_name, api_key, tool_parser=tool_parser,
                        reasoning_parser=reasoning_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.attach(state.metrics)
        try:
            yield
        finally:
            state.draining = True
            await engine.shutdown()

    app = FastAPI(title="nanovllm", lifespan=lifespan)
    app.state.server = state
    _add_guards(app, state)
    if cors is not None:  # outside the guard: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, **cors)
    _add_routes(app, state)
    _add_tokenizer_routes(app, state, tokenizer_info)
    return app


class Guard:
    """/v1 needs the bearer key (when one is set) and a server that is not shutting down. Plain
    ASGI, so streamed chunks pass straight through (Starlette's @app.middleware("http") relays
    each one through a memory stream and a task switch)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            error = None
            if self.state.api_key is not None and not _authorized(Headers(scope=scope),
                                                                   self.state.api_key):
                error = APIError(401, "invalid or missing API key: send the header "
                                      "'Authorization: Bearer <key>'", code="invalid_api_key")
            elif (why := self.state.unavailable) is not None:
                error = APIError(503, why)
            if error is not None:
                await _error(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _add_guards(app: FastAPI, state: ServerState):
    app.add_middleware(Guard, state=state)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return _error(error)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        return _error(APIError(500, f"internal error: {type(error).__name__}: {error}"))


def _authorized(headers: Headers, api_key: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(),
                                                                 api_key.encode())


def _error(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _add_routes(app: FastAPI, state: ServerState):
    @app.get("/health")
    async def health():
        return Response(status_code=503 if state.unavailable else 200)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.exposition(), media_type=ServerMetrics.CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        card = ModelCard(id=state.model_name, created=state.created,
                         max_model_len=state.engine.limits.max_model_len)
        return ModelList(data=[card])

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_request(CompletionRequest, await request.body())
        # On a thread: a new grammar compiles there, and the event loop goes on streaming.
        prompts, requests = await asyncio.to_thread(_completion_requests, state, body)
        stream = _submit(state, requests)
        if body.stream:
            return _event_stream(completion_events(state, body, stream, prompts))
        results = await _collect(request, state, stream)
        return completion_response(state, body, stream, results, prompts)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_request(ChatCompletionRequest, await request.body())
        choices, requests = await asyncio.to_thread(_chat_requests, state, body)
        stream = _submit(state, requests)
        if body.stream:
            return _event_stream(chat_events(state, stream, choices))
        results = await _collect(request, state, stream)
        return chat_response(state, stream, results, choices)


def _add_tokenizer_routes(app: FastAPI, state: ServerState, info: bool):
    tokenizer, limits = state.engine.tokenizer, state.engine.limits

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = tokenization.parse_tokenize(await request.body())
        _check_model(state, body.model)
        return tokenization.tokenize(body, tokenizer, limits)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = parse_request(DetokenizeRequest, await request.body())
        _check_model(state, body.model)
        return tokenization.detokenize(body, tokenizer, limits)

    if info:
        @app.get("/tokenizer_info")
        async def tokenizer_info():
            return JSONResponse(tokenization.tokenizer_info(tokenizer))


def _check_model(state: ServerState, model: str | None):
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{state.model_name!r}", "model", "model_not_found")


def _as_prompt_list(prompt) -> list:
    """A completion's prompt as a list of prompts (text or token ids)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    return list(prompt)


def _completion_requests(state: ServerState, body: CompletionRequest) -> tuple[list, list]:
    """Tokenize and check a completion request: (its prompts, its requests)."""
    _check_model(state, body.model)
    check_supported(body)
    prompts = _as_prompt_list(body.prompt)
    try:
        tokenizer = state.engine.tokenizer
        token_lists = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = _rest_of_context(state, max(map(len, token_lists)))
        params = sampling_params(body, max_tokens, body.logprobs,
                                 completion_prompt_logprobs(body))
        requests = state.engine.make_requests(token_lists, params)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e)) from None
    return prompts, requests


def _chat_requests(state: ServerState, body: ChatCompletionRequest) -> tuple[ChatChoices, list]:
    """Render, tokenize and check a chat request: (how its choices read, its requests)."""
    _check_model(state, body.model)
    check_supported(body)
    mode = tool_mode(body, state.tool_parser)
    prompt = chat_prompt(body, state.engine.tokenizer)
    # The chat template places the special tokens, so encoding adds none (as vLLM).
    token_ids = state.engine.tokenizer.encode(prompt, add_special_tokens=False)
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        max_tokens = _rest_of_context(state, len(token_ids))
    try:
        params = sampling_params(body, max_tokens, chat_logprobs_count(body),
                                 tool_constraint=tool_constraint(body, mode))
        requests = state.engine.make_requests([token_ids], params)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e)) from None
    thinking = prompt_thinking(prompt) if state.reasoning_parser else None
    return ChatChoices(body, state.token_text, mode, thinking), requests


def _rest_of_context(state: ServerState, num_prompt_tokens: int) -> int:
    """max_tokens left unset: as many as the context and the KV pool leave (at least 1, so that
    a prompt that already fills them gets the engine's own error)."""
    limits = state.engine.limits
    pool = limits.num_blocks * limits.block_size + 1  # the last token needs no KV slot
    return max(1, min(limits.max_model_len, pool) - num_prompt_tokens)


def _submit(state: ServerState, requests) -> RequestStream:
    try:
        return state.engine.submit(requests)
    except EngineStopped as e:
        raise APIError(503, str(e)) from None


def _event_stream(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _disconnected(request: Request):
    """Returns once the client has gone (the body is read: only a disconnect comes next)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, state: ServerState,
                   stream: RequestStream) -> ChoiceAccumulator:
    """Every delta of a non-streamed request; a client that leaves, or a cancelled handler,
    aborts the request (its blocks return at the next step)."""
    results = ChoiceAccumulator(sum(r.params.n for r in stream.requests))

    async def consume():
        while deltas := await stream.next_deltas():
            for delta in deltas:
                results.add(delta)

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        consumer.cancel()
        watcher.cancel()
        state.engine.abort(stream)
    if not consumer.done() or consumer.cancelled():
        raise APIError(400, "the client disconnected")  # nobody reads this answer
    if isinstance(consumer.exception(), EngineStopped):
        raise APIError(503, str(consumer.exception()))
    consumer.result()
    return results
