"""The messages of one step: what the engine hands the runner (`ScheduledStep`) and what the runner
gives back (`StepOutput`). Plain data, by rows: the runner and the sampler read these and never the
engine's sequences, so that a rank that is not the engine's needs nothing else."""

from dataclasses import dataclass, field

import numpy as np

from nanovllm.sampling_params import SamplingParams

PLACEHOLDER = -1  # a token sampled by a step still running on the device: read there, not sent


@dataclass(frozen=True, slots=True)
class RequestSampling:
    """A request's sampling settings as the sampler reads them, built once per request."""

    params: SamplingParams
    num_prompt_tokens: int  # penalties: the history's first tokens are the prompt
    # Masked while the request is short of min_tokens: stop_token_ids and EOS (as vLLM, EOS even
    # with ignore_eos); empty without min_tokens.
    stop_ids: tuple[int, ...]
    only_temperature: bool  # params.uses_only_temperature, read every step
    uses_penalties: bool  # params.uses_penalties
    banned_ids: tuple[int, ...] = ()  # never sampled: the ids of params.bad_words

    @classmethod
    def of(cls, params: SamplingParams, num_prompt_tokens: int, eos_token_ids=(),
           banned_ids: tuple[int, ...] = ()) -> "RequestSampling":
        stop_ids = set(params.stop_token_ids).union(eos_token_ids) if params.min_tokens else ()
        return cls(params, num_prompt_tokens, tuple(sorted(stop_ids)),
                   params.uses_only_temperature and not banned_ids, params.uses_penalties,
                   banned_ids)

    @property
    def biased(self) -> bool:
        """Some logits move before sampling: logit_bias, allowed_token_ids or bad words."""
        p = self.params
        return bool(p.logit_bias or p.allowed_token_ids or self.banned_ids)


@dataclass(slots=True)
class StepSampling:
    """Rank 0 only: one entry per sampling row of the step, in row order; the per-step facts next
    to each request's constant settings."""

    requests: list[RequestSampling]
    positions: list[int]  # the position of the token sampled now: seeded draws are keyed by it
    # row -> the stop ids masked this step (the request is short of min_tokens); rows absent mask
    # nothing.
    suppressed: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # row -> the known token ids (prompt, then output; int64), for rows whose request uses
    # penalties. The row's tokens in flight are the positions from len(history) to positions[row].
    histories: dict[int, np.ndarray] = field(default_factory=dict)
    # The rows with a grammar (structured outputs), and their allowed tokens: bitmask
    # [len(grammar_rows), ceil(vocab / 32)] int32, bit t of a row set = token t allowed. The step
    # is launched without it (ModelRunner.run stops at the logits) and sampled once the engine has
    # filled it (ModelRunner.sample_masked), after the previous step's tokens are known.
    grammar_rows: list[int] = field(default_factory=list)
    bitmask: np.ndarray | None = None

    @property
    def uses_controls(self) -> bool:
        """Some row draws with more than a temperature: the sampler's general path."""
        return not all(request.only_temperature for request in self.requests)

    @property
    def only_temperature(self) -> bool:
        """Every row draws by temperature alone and masks nothing: the one-pass sampler, whole."""
        return not self.suppressed and not self.uses_controls and not self.grammar_rows


@dataclass(frozen=True, slots=True)
class PromptLogprobRows:
    """A prefill row's prompt logprobs: its chunk's positions from `first` on (an offset into the
    chunk) predict `targets`, the prompt's next tokens; `num_top` most likely tokens too."""

    first: int
    targets: list[int]
    num_top: int


@dataclass(slots=True)
class ScheduledStep:
    """One step, by rows: all prefill or all decode. A row computes num_scheduled_tokens[row] tokens
    from position num_computed_tokens[row] on (its KV below that is cached). A fork (a sample of an
    `n`-sample prompt) computes none: it samples from the last position of the row it names in
    `forks` and holds a copy of that row's last block. Workers receive it without `sampling`."""

    is_prefill: bool
    seq_ids: list[int] = field(default_factory=list)
    # The rows' scheduled tokens, concatenated; a decode row's one token may be a PLACEHOLDER.
    token_ids: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)  # the step samples a token for the row
    forks: dict[int, int] = field(default_factory=dict)  # fork row -> its prompt's row
    sampling: StepSampling | None = None  # rank 0: the sampling rows' settings
    # prefill row -> the prompt logprobs it computes (every rank runs their lm_head).
    prompt_logprobs: dict[int, PromptLogprobRows] = field(default_factory=dict)
    # Some row has a grammar: `run` computes the logits, `sample_masked` samples (every rank).
    masked: bool = False
    # Decode: some sequence has several rows (a draft verified, its positions in a row).
    verify: bool = False

    def __len__(self) -> int:
        return len(self.seq_ids)

    @property
    def sampled_seq_ids(self) -> list[int]:
        """The sampling rows' sequence ids, in row order (a decode step samples every row)."""
        if not self.is_prefill:
            return self.seq_ids
        return [seq_id for seq_id, samples in zip(self.seq_ids, self.samples) if samples]

    def __reduce__(self):
        # Workers never sample: what they receive holds counts, block tables and the step's tokens.
        return ScheduledStep, (self.is_prefill, self.seq_ids, self.token_ids,
                               self.num_scheduled_tokens, self.num_computed_tokens,
                               self.block_tables, self.samples, self.forks, None,
                               self.prompt_logprobs, self.masked, self.verify)


@dataclass(slots=True)
class StepOutput:
    """A step's sampled tokens on the host, one per sampling row in row order: token_ids [rows];
    with logprobs, ids [rows, 1 + N] (the sampled token, then the top N) and their logprobs. The
    arrays may view host memory that the step's copies fill: read them once the step is done."""

    token_ids: np.ndarray
    logprob_token_ids: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    logprob_ranks: np.ndarray | None = None  # [rows]: the sampled token's rank, 1 = most likely
    # prefill row -> its PromptLogprobRows' results: the targets' logprobs [m] and ranks [m], the
    # top ids and logprobs [m, num_top].
    prompt_logprobs: dict[int, tuple[np.ndarray, ...]] = field(default_factory=dict)
