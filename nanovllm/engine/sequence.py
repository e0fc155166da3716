"""A request's tokens and its place in the KV cache."""

from collections.abc import Iterable
from copy import copy
from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams

# Stands in token_ids for a token sampled by a step still running on the GPU (see Sequence.num_inflight).
PLACEHOLDER = -1


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int,
                 eos_token_ids: Iterable[int] = ()):
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = copy(token_ids)
        self.num_tokens = len(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.block_size = block_size
        self.num_cached_tokens = 0  # tokens whose KV is in the cache and valid
        self.num_scheduled_tokens = 0  # tokens this step computes, from num_cached_tokens on
        # Trailing PLACEHOLDERs in token_ids: tokens of launched steps whose results are not back yet.
        # They count in num_tokens (their KV slots are planned like any other) until resolved.
        self.num_inflight = 0
        self.block_table: list[int] = []
        # Sampling and stopping (rank 0 only: never pickled for the workers).
        self.sampling_params = sampling_params
        self.temperature = sampling_params.temperature
        self.max_tokens = sampling_params.max_tokens
        self.min_tokens = sampling_params.min_tokens
        self.ignore_eos = sampling_params.ignore_eos
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        # Ids the sampler suppresses until min_tokens tokens exist (vLLM masks EOS even with ignore_eos).
        self.min_tokens_stop_ids = sorted(self.stop_token_ids.union(eos_token_ids)) if self.min_tokens else []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.logprobs: list[dict[int, float]] = []  # per output token, when sampling_params.logprobs is set
        self.cumulative_logprob = 0.0
        self.only_temperature = sampling_params.uses_only_temperature  # the one-pass sampler will do
        self.token_history = None  # numpy copy of token_ids for penalties, grown by the sampler
        self.detokenizer = None  # IncrementalDetokenizer when stop strings or streaming need the text as it grows
        # Index into token_ids of token num_cached_tokens; nonzero only on worker ranks, which
        # receive just the tokens of the scheduled chunk.
        self._first_token_index = 0

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        """Generated tokens, those still in flight included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens whose values are known."""
        return self.num_completion_tokens - self.num_inflight

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:self.num_tokens - self.num_inflight]

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold every token so far."""
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def completes_prefill(self) -> bool:
        """True when the scheduled chunk reaches the last token, so this step yields a new token."""
        return self.num_cached_tokens + self.num_scheduled_tokens == self.num_tokens

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def scheduled_token_ids(self) -> list[int]:
        start = self.num_cached_tokens - self._first_token_index
        return self.token_ids[start:start + self.num_scheduled_tokens]

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)
        self.num_tokens += 1

    def append_placeholder(self):
        """A launched step will sample this sequence's next token."""
        self.append_token(PLACEHOLDER)
        self.num_inflight += 1

    def resolve_token(self, token_id: int):
        """The oldest in-flight token is `token_id` (steps complete in launch order)."""
        self.token_ids[self.num_tokens - self.num_inflight] = token_id
        self.num_inflight -= 1

    def drop_inflight(self):
        """Forget tokens still in flight (the sequence finished before they came back)."""
        self.num_tokens -= self.num_inflight
        del self.token_ids[self.num_tokens:]
        self.num_inflight = 0

    # Worker ranks need only the tokens this step computes: one during decode (possibly a PLACEHOLDER,
    # which every rank reads from the previous step's broadcast tokens), the chunk during (re-)prefill.
    # Everything else they need is counts and the block table.
    def __getstate__(self):
        return (self.seq_id, self.num_tokens, self.num_prompt_tokens, self.block_size, self.num_cached_tokens,
                self.num_scheduled_tokens, self.block_table, self.scheduled_token_ids())

    def __setstate__(self, state):
        (self.seq_id, self.num_tokens, self.num_prompt_tokens, self.block_size, self.num_cached_tokens,
         self.num_scheduled_tokens, self.block_table, self.token_ids) = state
        self._first_token_index = self.num_cached_tokens
