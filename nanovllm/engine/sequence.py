"""A request's tokens and its place in the KV cache."""

from collections.abc import Iterable
from copy import copy
from dataclasses import replace
from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams

PLACEHOLDER = -1  # in token_ids: a token sampled by a step still running on the GPU


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int,
                 eos_token_ids: Iterable[int] = ()):
        self.seq_id = next(Sequence._ids)
        self.request_id: str | None = None  # the request it samples for (engine.requests.Request)
        self.status = SequenceStatus.WAITING
        self.token_ids = copy(token_ids)
        self.num_tokens = len(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.block_size = block_size
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0  # tokens this step computes, from num_cached_tokens on
        self.num_inflight = 0  # trailing PLACEHOLDERs, counted in num_tokens like any token
        self.block_table: list[int] = []
        self.sampling_params = sampling_params
        self.temperature = sampling_params.temperature
        self.max_tokens = sampling_params.max_tokens
        self.min_tokens = sampling_params.min_tokens
        self.ignore_eos = sampling_params.ignore_eos
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        # The sampler masks these until min_tokens (as vLLM: EOS too, even with ignore_eos).
        stop_ids = self.stop_token_ids.union(eos_token_ids)
        self.min_tokens_stop_ids = sorted(stop_ids) if self.min_tokens else []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0
        self.only_temperature = sampling_params.uses_only_temperature
        self.token_history = None  # token_ids as numpy, for penalties, grown by the sampler
        self.detokenizer = None
        # Where token num_cached_tokens is in token_ids: workers receive only the step's tokens.
        self._first_token_index = 0
        # SamplingParams.n: sample 0 is the parent; samples 1.. wait in its `forks`, in no queue,
        # until the step that completes its prompt forks them (Scheduler._fork).
        self.sample_index = 0
        self.parent: Sequence | None = None
        self.forks: list[Sequence] = []

    def make_samples(self) -> list["Sequence"]:
        """This sequence and its n - 1 forks; with a seed, sample i draws with seed + i (vLLM)."""
        params = self.sampling_params
        for i in range(1, params.n):
            seed = None if params.seed is None else (params.seed + i) % 2**64
            child = Sequence(self.token_ids, replace(params, seed=seed), self.block_size)
            child.min_tokens_stop_ids = self.min_tokens_stop_ids
            child.sample_index, child.parent = i, self
            self.forks.append(child)
        return [self, *self.forks]

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens whose values are known (not in flight)."""
        return self.num_completion_tokens - self.num_inflight

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:self.num_tokens - self.num_inflight]

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def completes_prefill(self) -> bool:
        """The scheduled chunk reaches the last token, so the step samples a new one."""
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
        self.append_token(PLACEHOLDER)
        self.num_inflight += 1

    def resolve_token(self, token_id: int):
        """The oldest in-flight token is `token_id` (steps complete in launch order)."""
        self.token_ids[self.num_tokens - self.num_inflight] = token_id
        self.num_inflight -= 1

    def drop_inflight(self):
        self.num_tokens -= self.num_inflight
        del self.token_ids[self.num_tokens:]
        self.num_inflight = 0

    # Workers get counts, the block table and the step's tokens (in decode, maybe a PLACEHOLDER).
    def __getstate__(self):
        return (self.seq_id, self.num_tokens, self.num_prompt_tokens, self.block_size,
                self.num_cached_tokens, self.num_scheduled_tokens, self.block_table,
                self.scheduled_token_ids())

    def __setstate__(self, state):
        (self.seq_id, self.num_tokens, self.num_prompt_tokens, self.block_size,
         self.num_cached_tokens, self.num_scheduled_tokens, self.block_table,
         self.token_ids) = state
        self._first_token_index = self.num_cached_tokens
