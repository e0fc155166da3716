"""A request's tokens and its place in the KV cache."""

from collections.abc import Iterable
from copy import copy
from dataclasses import replace
from enum import Enum, auto
from itertools import count

import numpy as np

from nanovllm.sampling_params import SamplingParams
from nanovllm.step import PLACEHOLDER, RequestSampling


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int,
                 eos_token_ids: Iterable[int] = (), banned_token_ids: tuple[int, ...] = ()):
        self.seq_id = next(Sequence._ids)
        self.request_id: str | None = None  # the request it samples for (engine.requests.Request)
        self.status = SequenceStatus.WAITING
        self.token_ids = copy(token_ids)
        self.num_tokens = len(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.block_size = block_size
        self.num_cached_tokens = 0
        # The prompt tokens the prefix cache held when it was first given blocks (vLLM's
        # RequestOutput.num_cached_tokens); None until then.
        self.num_prefix_hit_tokens: int | None = None
        self.num_scheduled_tokens = 0  # tokens this step computes, from num_cached_tokens on
        self.num_inflight = 0  # trailing PLACEHOLDERs, counted in num_tokens like any token
        self.block_table: list[int] = []
        self.sampling_params = sampling_params
        self.sampling = RequestSampling.of(sampling_params, len(token_ids), eos_token_ids,
                                           banned_token_ids)
        self.max_tokens = sampling_params.max_tokens
        self.min_tokens = sampling_params.min_tokens
        self.ignore_eos = sampling_params.ignore_eos
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Per generated token: {the sampled id: logprob, then the top N ids by rank: logprobs}
        # (a sampled id among the top N stays first), and the sampled id's rank.
        self.logprobs: list[dict[int, float]] = []
        self.logprob_ranks: list[int] = []
        # The same for prompt positions 1.. (SamplingParams.prompt_logprobs): the prompt token
        # first, then the top N.
        self.prompt_logprobs: list[dict[int, float]] = []
        self.prompt_logprob_ranks: list[int] = []
        self.cumulative_logprob = 0.0
        self.token_history: TokenHistory | None = None  # for penalties (token_array)
        self.detokenizer = None
        # Structured outputs: this sample's matcher (engine.grammar.GrammarState), which has
        # accepted exactly the known output tokens.
        self.grammar = None
        # Speculation: this sample's n-gram drafter (engine.speculative), and the draft it
        # proposed for the tokens known at the last step, which a step verifies once scheduled.
        self.drafter = None
        self.draft: list[int] = []
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
            # This sequence's masked stop ids hold the EOS ids: the child masks the same.
            child = Sequence(self.token_ids, replace(params, seed=seed), self.block_size,
                             self.sampling.stop_ids, self.sampling.banned_ids)
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
        return self.token_ids[self.num_cached_tokens:self.num_cached_tokens
                              + self.num_scheduled_tokens]

    @property
    def suppressed_stop_ids(self) -> tuple[int, ...]:
        """The stop ids the sampler masks now: all of them while short of min_tokens."""
        return self.suppressed_stop_ids_after(0)

    def suppressed_stop_ids_after(self, num_drafted: int) -> tuple[int, ...]:
        """The same for the token after `num_drafted` more tokens (a draft's)."""
        stop_ids = self.sampling.stop_ids
        if stop_ids and self.num_completion_tokens + num_drafted < self.min_tokens:
            return stop_ids
        return ()

    def token_array(self) -> np.ndarray:
        """The known token ids (prompt, then output; not those in flight) as int64, for
        penalties; each call converts only the tokens new since the last."""
        if self.token_history is None:
            self.token_history = TokenHistory()
        return self.token_history.update(self.token_ids, self.num_tokens - self.num_inflight)

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

    def drop_inflight(self, count: int | None = None):
        """Drop the last `count` in-flight tokens (default: all)."""
        count = self.num_inflight if count is None else count
        self.num_tokens -= count
        del self.token_ids[self.num_tokens:]
        self.num_inflight -= count


class TokenHistory:
    """A growing int64 copy of a sequence's token ids: each update converts only the new tokens."""

    def __init__(self):
        self.array = np.empty(0, dtype=np.int64)
        self.length = 0

    def update(self, token_ids: list[int], n: int) -> np.ndarray:
        if n > len(self.array):
            grown = np.empty(max(n, 2 * len(self.array)), dtype=np.int64)
            grown[:self.length] = self.array[:self.length]
            self.array = grown
        self.array[self.length:n] = token_ids[self.length:n]
        self.length = n
        return self.array[:n]
