"""Token sampling: greedy rows by argmax, the others by the race argmax_v logit_v / T + G_v, with
Gumbel noise G_v = -log(-log U_v): a draw from softmax(logit / T). U is counter-based Philox noise
keyed by (seed, column), so a seeded row draws the same token in any batch and any split."""

from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.kernels.sampling import sample_triton
from nanovllm.kernels.token_bitmask import apply_token_bitmask_triton
from nanovllm.sampling.filters import filter_thresholds
from nanovllm.sampling.logits_processor import (
    apply_min_p,
    apply_penalties,
    apply_token_bitmask,
    apply_top_k_top_p,
)


def exponential_race(logits: torch.Tensor,
                     generators: dict[int, torch.Generator] | None = None) -> torch.Tensor:
    """A draw per row from softmax(logits) [rows, vocab]: argmax_v p_v / E_v, E_v ~ Exp(1)."""
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for row, generator in (generators or {}).items():
        noise[row].exponential_(generator=generator)
    return probs.div_(noise.clamp_min_(1e-10)).argmax(dim=-1)


def sample_torch(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    greedy = temperatures == 0
    if bool(greedy.all()):  # no noise to draw
        return logits.argmax(dim=-1)
    logits = logits.float()
    sampled = exponential_race(logits / torch.where(greedy, 1.0, temperatures).unsqueeze(1))
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


@dataclass(slots=True)
class Penalties:
    """ids [rows, width]: prompt then output ids, padded with vocab_size; prompt_lens [rows, 1];
    the penalties [rows] float32 (off: repetition 1, frequency and presence 0)."""

    ids: torch.Tensor
    prompt_lens: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor


@dataclass(slots=True)
class SamplingMetadata:
    """One step's settings on the device, [rows] tensors; a control no row uses is None. Off values:
    temperature 0 (greedy), top_k vocab_size, top_p 1, min_p 0, row_seeds -1 (else seed_key). seed
    [1]: the other rows' noise seed; max_top_k: at least every k; suppressed: (rows, token ids)."""

    temperatures: torch.Tensor
    seed: torch.Tensor
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    max_top_k: int | None = None
    top_p_within_top_k: bool = True  # every row with top_p < 1 has a top_k
    min_p: torch.Tensor | None = None
    penalties: Penalties | None = None
    row_seeds: torch.Tensor | None = None
    suppressed: tuple[torch.Tensor, torch.Tensor] | None = None
    # [rows, vocab] float32 added to the logits first: logit_bias, -inf outside allowed_token_ids
    # and at bad words' ids; 0 for rows without them.
    bias: torch.Tensor | None = None
    # Structured outputs: (rows [g] int64, bitmask [g, ceil(vocab / 32)] int32), the rows with a
    # grammar and their allowed tokens; the other rows are not touched.
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None
    num_logprobs: int | None = None
    # No row uses a control (StepSampling.uses_controls): the one-pass sampler draws every row.
    only_temperature: bool = True

    def tensors(self) -> list[torch.Tensor]:
        tensors = [self.temperatures, self.seed, self.top_k, self.top_p, self.min_p,
                   self.row_seeds, *(self.suppressed or ()), self.bias, *(self.grammar or ())]
        if self.penalties is not None:
            p = self.penalties
            tensors += [p.ids, p.prompt_lens, p.repetition, p.frequency, p.presence]
        return [t for t in tensors if t is not None]

    def shape_key(self) -> tuple:
        """A CUDA graph of a sampling call replays for any metadata with the same key."""
        fields = (self.top_k, self.top_p, self.min_p, self.penalties, self.row_seeds,
                  self.suppressed, self.bias, self.grammar)
        return (tuple(field is None for field in fields), tuple(t.shape for t in self.tensors()),
                self.max_top_k, self.top_p_within_top_k, self.num_logprobs)


def to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A pinned host copy, queued without waiting: read it once the stream has passed here."""
    if tensor is None or not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


@dataclass(slots=True)
class SamplerOutput:
    """token_ids [rows]; with logprobs, [rows, 1 + N] ids (sampled, then top N), their logprobs
    (or logits, by the logprobs mode) and the sampled token's rank [rows] (1: the most likely)."""

    token_ids: torch.Tensor
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    logprob_ranks: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.token_ids, self.logprob_token_ids, self.logprobs, self.logprob_ranks]

    def to_host(self) -> "SamplerOutput":
        return SamplerOutput(*map(to_host, self.tensors()))

    def first_rows(self, num_rows: int) -> "SamplerOutput":
        return SamplerOutput(*(None if t is None else t[:num_rows] for t in self.tensors()))


def penalized(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """A float32 copy of logits [rows, vocab] with the penalties applied: greedy rows' argmax."""
    logits = logits.to(torch.float32, copy=True)
    if meta.penalties is not None:
        p = meta.penalties
        apply_penalties(logits, p.ids, p.prompt_lens, p.repetition, p.frequency, p.presence)
    return logits


def filtered(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """In place, after the penalties, in vLLM's order: temperature (not for greedy rows), min-p,
    top-k / top-p (-inf for what they drop)."""
    greedy = meta.temperatures == 0
    logits.div_(torch.where(greedy, 1.0, meta.temperatures).unsqueeze(1))
    if meta.min_p is not None:
        apply_min_p(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        num_candidates = meta.max_top_k if meta.top_p_within_top_k else None
        apply_top_k_top_p(logits, meta.top_k, meta.top_p, num_candidates)
    return logits


def processed_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """float32 [rows, vocab]: what a row draws from (vLLM's processed logits)."""
    return filtered(penalized(logits, meta), meta)


def sample_with_controls_torch(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The CPU reference: greedy rows by argmax after the penalties, the others by a race over
    processed_logits."""
    logits = penalized(logits, meta)
    greedy = meta.temperatures == 0
    greedy_tokens = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return greedy_tokens
    filtered(logits, meta)
    keys = [] if meta.row_seeds is None else meta.row_seeds.tolist()
    generators = {row: torch.Generator(logits.device).manual_seed(key)
                  for row, key in enumerate(keys) if key >= 0}
    return torch.where(greedy, greedy_tokens, exponential_race(logits, generators))


def sample_with_controls_triton(logits: torch.Tensor, meta: SamplingMetadata,
                                out: torch.Tensor | None = None) -> torch.Tensor:
    if meta.penalties is not None:
        p = meta.penalties
        logits = apply_penalties(logits.to(torch.float32, copy=True), p.ids, p.prompt_lens,
                                 p.repetition, p.frequency, p.presence)
    thresholds = None
    if meta.top_k is not None or meta.top_p is not None or meta.min_p is not None:
        thresholds = filter_thresholds(logits, meta.temperatures, meta.top_k, meta.top_p,
                                       meta.min_p, meta.max_top_k, not meta.top_p_within_top_k)
    return sample_triton(logits, meta.temperatures, meta.seed, thresholds=thresholds,
                         row_seeds=meta.row_seeds, out=out)


class Sampler(nn.Module):
    """use_triton: sample with the Triton kernels (None: on CUDA); else with the torch reference.
    logprobs_mode (vLLM's): what logprobs report, the raw logits or those the draw is from
    (processed_logits), as logits or normalized log-probabilities."""

    def __init__(self, use_triton: bool | None = None, logprobs_mode: str = "raw_logprobs"):
        super().__init__()
        self.use_triton = use_triton
        self.logprobs_mode = logprobs_mode

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata,
                out: torch.Tensor | None = None) -> SamplerOutput:
        """logits [rows, vocab] -> [rows] tokens; nothing waits for the GPU. The logits are
        modified in place (suppressed ids) unless logprobs are asked for."""
        raw = logits
        if meta.bias is not None:
            logits = logits.float() + meta.bias
        if meta.suppressed is not None:
            if logits is raw and meta.num_logprobs is not None:
                logits = logits.clone()  # raw logprobs read the logits before any control
            logits.index_put_(meta.suppressed, logits.new_full((), -float("inf")))
        use_triton = logits.is_cuda if self.use_triton is None else self.use_triton
        if meta.grammar is not None:
            if logits is raw and meta.num_logprobs is not None:
                logits = logits.clone()
            apply = apply_token_bitmask_triton if use_triton else apply_token_bitmask
            apply(logits, *meta.grammar)
        if use_triton:
            if meta.only_temperature:
                tokens = sample_triton(logits, meta.temperatures, meta.seed, out=out)
            else:
                tokens = sample_with_controls_triton(logits, meta, out=out)
        else:
            if meta.only_temperature:
                tokens = sample_torch(logits, meta.temperatures)
            else:
                tokens = sample_with_controls_torch(logits, meta)
            if out is not None:
                tokens = out.copy_(tokens)
        if meta.num_logprobs is None:
            return SamplerOutput(tokens)
        return self._logprobs(raw, logits, meta, tokens)

    def _logprobs(self, raw: torch.Tensor, logits: torch.Tensor, meta: SamplingMetadata,
                  tokens: torch.Tensor) -> SamplerOutput:
        """The sampled token's and the top N's values, by the logprobs mode, and its rank."""
        if self.logprobs_mode.startswith("raw"):
            values = raw
        else:
            values = processed_logits(logits, meta)
        top = values.topk(meta.num_logprobs, dim=-1)
        sampled = values.gather(1, tokens.unsqueeze(1))
        ranks = (values > sampled).sum(dim=-1) + 1
        ids = torch.cat([tokens.unsqueeze(1), top.indices], dim=1)
        chosen = torch.cat([sampled, top.values], dim=1).float()
        if self.logprobs_mode.endswith("logprobs"):
            chosen -= torch.logsumexp(values.float(), dim=-1, keepdim=True)
        return SamplerOutput(tokens, ids, chosen, ranks)
