"""Token sampling: greedy rows by argmax, the others by an exponential race over the tempered softmax.

argmax_v p_v / E_v with E_v ~ Exp(1) draws v with probability p_v; in log space that is
argmax_v logit_v / T + G_v with Gumbel noise G_v = -log(-log U_v). On CUDA one Triton kernel does it
in a single pass over the logits (no softmax, no float32 copy, no host sync per sequence); when the
rows are fewer than the SMs, it splits each row over several programs and a tiny pass picks the best
of each row's chunks. A batch in
which some row uses top-k / top-p / min-p, penalties, a seed or logprobs takes the general path: the
same race after batched logits processing (`logits_processor.py`), still one call for the whole batch.
"""

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from torch import nn

from nanovllm.layers.logits_processor import apply_min_p, apply_penalties, apply_top_k_top_p
from nanovllm.utils.device import num_sms


@triton.jit
def _uniforms(seed, first_group, BLOCK: tl.constexpr):
    """[BLOCK] uniforms in [0, 1) for BLOCK consecutive columns starting at a multiple of 4: column 4j + i
    takes output i of the Philox call at counter first_group + j, four draws per call (tl.rand makes one).
    The interleave keeps each column's draw independent of how the row is blocked or split."""
    r0, r1, r2, r3 = tl.rand4x(seed, first_group + tl.arange(0, BLOCK // 4))
    return tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK])


# A fresh seed every step: Triton must not specialize on its value (divisible by 16 or not, equal to
# 1), or a new variant compiles mid-run the first time each kind of seed comes up.
@triton.jit(do_not_specialize=["seed"])
def _sample_kernel(logits_ptr, logits_stride, temperatures_ptr, scores_ptr, tokens_ptr, seed, vocab_size, chunk_size,
                   BLOCK: tl.constexpr):
    """Program (row, chunk): the best score of the chunk's columns and its token, into [rows, chunks]."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0
    inv_temperature = 1.0 / tl.where(greedy, 1.0, temperature)
    begin = chunk * chunk_size
    end = tl.minimum(begin + chunk_size, vocab_size)
    best_score = -float("inf")
    best_token = begin
    groups_per_row = tl.cdiv(vocab_size, 4)
    for start in range(begin, end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < end
        logits = tl.load(logits_ptr + row * logits_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        # The noise depends on (seed, row, column) only: the token drawn does not depend on the split.
        uniform = _uniforms(seed, row * groups_per_row + start // 4, BLOCK)
        gumbel = -tl.log(-tl.log(uniform))
        scores = tl.where(greedy, logits, logits * inv_temperature + gumbel)
        scores = tl.where(mask, scores, -float("inf"))
        block_best, block_token = tl.max(scores, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = block_best > best_score  # strict: the earliest maximum wins, as torch.argmax
        best_token = tl.where(better, start + block_token, best_token)
        best_score = tl.where(better, block_best, best_score)
    out = row * tl.num_programs(1) + chunk
    tl.store(scores_ptr + out, best_score)
    tl.store(tokens_ptr + out, best_token)


CHUNK_BLOCK = 1024  # columns per block, and the smallest chunk, when rows are split


def sample_triton(logits: torch.Tensor, temperatures: torch.Tensor, seed: int,
                  num_chunks: int | None = None) -> torch.Tensor:
    """logits: [rows, vocab] -> [rows] int64. One program per row, in one pass, once the rows fill the GPU;
    with fewer rows than SMs each row's vocabulary is split over up to `num_chunks` programs (by default
    about two programs per SM; one chunk on CPU) and a second pass takes each row's best chunk, the
    earliest on ties. The tokens are the same for any split."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1
    if num_chunks is None:
        num_chunks = max(1, 2 * num_sms(logits.device) // num_rows) if logits.is_cuda else 1
    if num_chunks == 1:
        block, num_warps, chunk_size = 4096, 8, vocab_size
    else:  # chunks of whole blocks, at least one block each
        block, num_warps = CHUNK_BLOCK, 4
        chunk_size = triton.cdiv(triton.cdiv(vocab_size, num_chunks), block) * block
        num_chunks = triton.cdiv(vocab_size, chunk_size)
    scores = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    tokens = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=logits.device)
    _sample_kernel[(num_rows, num_chunks)](logits, logits.stride(0), temperatures, scores, tokens, seed, vocab_size,
                                           chunk_size, BLOCK=block, num_warps=num_warps)
    if num_chunks == 1:
        return tokens.squeeze(1)
    return tokens.gather(1, scores.argmax(dim=1, keepdim=True)).squeeze(1)  # argmax: the earliest best chunk


def exponential_race(logits: torch.Tensor, generators: dict[int, torch.Generator] | None = None) -> torch.Tensor:
    """A draw per row from softmax(logits): argmax_v p_v / E_v with E_v ~ Exp(1). The rows in `generators`
    take their noise from their own generator. logits: [rows, vocab] float32 -> [rows] int64."""
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for row, generator in (generators or {}).items():
        noise[row].exponential_(generator=generator)
    return probs.div_(noise.clamp_min_(1e-10)).argmax(dim=-1)


def sample_torch(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    greedy = temperatures == 0
    sampled = exponential_race(logits / torch.where(greedy, 1.0, temperatures).unsqueeze(1))
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


@dataclass(slots=True)
class Penalties:
    prompt_ids: torch.Tensor  # [rows, max_len] int64, padded with vocab_size
    output_ids: torch.Tensor  # [rows, max_len] int64, padded with vocab_size
    repetition: torch.Tensor  # [rows] float32, 1 = off
    frequency: torch.Tensor  # [rows] float32, 0 = off
    presence: torch.Tensor  # [rows] float32, 0 = off


@dataclass(slots=True)
class SamplingMetadata:
    """One step's sampling settings on the device, a row per sampled sequence. A control that no row
    uses is None (or empty), so a temperature-only batch keeps the one-pass kernel."""

    temperatures: torch.Tensor  # [rows] float32, 0 = greedy
    top_k: torch.Tensor | None = None  # [rows] int64, vocab_size = off
    top_p: torch.Tensor | None = None  # [rows] float32, 1 = off
    # The largest k, set when every row with top_p < 1 also has a top_k: then both filters work on
    # each row's largest num_top_candidates logits instead of a full sort.
    num_top_candidates: int | None = None
    min_p: torch.Tensor | None = None  # [rows] float32, 0 = off
    penalties: Penalties | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> its request's seeded generator
    suppressed: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) [n] each: never sampled
    num_logprobs: int | None = None  # top-N log-probabilities for every row (the largest N any row asks for)

    @property
    def only_temperature(self) -> bool:
        return (self.top_k is None and self.top_p is None and self.min_p is None and self.penalties is None
                and not self.generators and self.num_logprobs is None)


@dataclass(slots=True)
class SamplerOutput:
    """One step's results, a row per sampled sequence: on the device as the Sampler returns them, on
    the host after `to_host`."""

    token_ids: torch.Tensor  # [rows] int64
    # When logprobs were asked for: the sampled id, then the top N ids of each row ([rows, 1 + N]), and
    # their log-probabilities (float32).
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None

    def to_host(self) -> "SamplerOutput":
        """Copies in host memory, pinned and queued without waiting when on CUDA: read them only once
        the stream has passed this point."""
        def copy(tensor):
            if tensor is None or not tensor.is_cuda:
                return tensor
            return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor, non_blocking=True)

        return SamplerOutput(copy(self.token_ids), copy(self.logprob_token_ids), copy(self.logprobs))


def sample_with_controls(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The general path, vLLM's order: penalties, greedy argmax, temperature, min-p, top-k / top-p,
    then the exponential race (per-request generators for seeded rows). logits: [rows, vocab] -> [rows]."""
    logits = logits.to(torch.float32, copy=True)  # [rows, vocab], processed in place
    if meta.penalties is not None:
        p = meta.penalties
        apply_penalties(logits, p.prompt_ids, p.output_ids, p.repetition, p.frequency, p.presence)
    greedy = meta.temperatures == 0
    greedy_tokens = logits.argmax(dim=-1)
    logits.div_(torch.where(greedy, 1.0, meta.temperatures).unsqueeze(1))
    if meta.min_p is not None:
        apply_min_p(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.num_top_candidates)
    return torch.where(greedy, greedy_tokens, exponential_race(logits, meta.generators))


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [rows, vocab] (modified in place) -> a token per row, plus log-probabilities if asked,
        on the device: nothing here waits for the GPU."""
        # Log-probabilities of the model's raw logits, before penalties, temperature and filtering, as
        # vLLM returns by default (logprobs_mode="raw_logprobs").
        logprobs = None if meta.num_logprobs is None else torch.log_softmax(logits.float(), dim=-1)
        if meta.suppressed is not None:
            logits[meta.suppressed] = -float("inf")
        if not meta.only_temperature:
            tokens = sample_with_controls(logits, meta)
        elif logits.is_cuda:
            # The kernel's noise seed comes from torch's CPU generator: torch.manual_seed reproduces runs.
            tokens = sample_triton(logits, meta.temperatures, int(torch.randint(2**31 - 1, ()).item()))
        else:
            tokens = sample_torch(logits, meta.temperatures)
        if logprobs is None:
            return SamplerOutput(tokens)
        ids = torch.cat([tokens.unsqueeze(1), logprobs.topk(meta.num_logprobs, dim=-1).indices], dim=1)  # [rows, 1+N]
        return SamplerOutput(tokens, ids, logprobs.gather(1, ids))
