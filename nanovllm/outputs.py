"""What `LLM.generate` returns, with vLLM's names: a RequestOutput per prompt, holding a
CompletionOutput per sample, with Logprob entries where logprobs were asked for."""

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """A token's log-probability, its rank among the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: {token id: Logprob}, the sampled token and the top N.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: the same, None for the first (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One sample of a prompt: `index` among its n, the text and token ids it generated."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


# nano-vllm's outputs were dicts: these keys still read the first completion.
_FIRST_COMPLETION_KEYS = ("text", "token_ids", "finish_reason", "stop_reason", "logprobs",
                          "cumulative_logprob")


@dataclass
class RequestOutput:
    """One prompt's outputs: its prompt (text, if it was given as text), token ids and prompt
    logprobs (if asked for), and its n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None
    metrics: object = field(default=None, repr=False)
    lora_request: object = field(default=None, repr=False)

    def __getitem__(self, key: str):
        """`output["text"]` and the other nano-vllm keys: the first completion's field."""
        if key not in _FIRST_COMPLETION_KEYS:
            raise KeyError(f"{key!r}: a RequestOutput reads {', '.join(_FIRST_COMPLETION_KEYS)} "
                           "of its first completion; use its attributes for the rest")
        return getattr(self.outputs[0], key)

    __iter__ = None  # not a sequence: its samples are `outputs`

    def __contains__(self, key: str) -> bool:
        if key in ("logprobs", "cumulative_logprob"):
            return self.outputs[0].logprobs is not None
        return key in _FIRST_COMPLETION_KEYS
