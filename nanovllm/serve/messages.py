"""The messages between the server's process and its engine process, pickled over one pipe: the
server's commands one way; the start-up answer and then one message per step the other way."""

from dataclasses import dataclass

from nanovllm.config import Config
from nanovllm.engine.requests import Request, RequestLimits


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice (a prompt's sample) produced since its last delta."""

    index: int  # the choice: the prompt's position times n, plus the sample
    text: str | None  # None from the engine where the server detokenizes (no stop strings)
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # one {token_id: logprob} per token, sampled first
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The first delta of a choice whose request asked for prompt logprobs: the prompt's token ids
    # and, for each but the first, {token_id: logprob} (the prompt token first, then the top k).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, float]] | None = None
    # The prompt's tokens found in the prefix cache: on the first delta of its first sample only.
    num_cached_tokens: int = 0


# Server -> engine.


@dataclass(slots=True)
class AddRequests:
    """Queue one HTTP request's checked requests (make_requests) as stream `stream_id`."""

    stream_id: int
    requests: list[Request]


@dataclass(slots=True)
class AbortRequests:
    """Finish these streams' unfinished requests now; the server has stopped listening to them."""

    stream_ids: list[int]


@dataclass(slots=True)
class Shutdown:
    """Abort everything, exit the engine and end the process."""


# Engine -> server.


@dataclass(slots=True)
class EngineReady:
    """The engine has started: its config (the model, the tokenizer's options), its EOS ids and
    what a request must fit (the KV pool is sized only now)."""

    config: Config
    eos_token_ids: set[int]
    limits: RequestLimits


@dataclass(slots=True)
class EngineFailed:
    """The engine failed to start or to step; the process ends after sending this."""

    error: BaseException


@dataclass(slots=True)
class StepOutputs:
    """One step's news for every stream, as one message, and the engine's gauges after it."""

    # (stream id, then a ChoiceDelta's fields in their order) per choice with news: plain tuples
    # pickle about ten times faster than dataclasses, and a step carries one per running choice.
    deltas: list[tuple]
    finished: list[int]  # streams whose every choice has finished (after their deltas above)
    refused: list[tuple[int, str]]  # (stream id, why) for requests the engine would not add
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # the fraction of the KV pool's blocks in use
