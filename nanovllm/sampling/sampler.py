"""Token sampling: greedy rows by argmax, the others by an exponential race over the tempered softmax.

argmax_v p_v / E_v with E_v ~ Exp(1) draws v with probability p_v; in log space that is
argmax_v logit_v / T + G_v with Gumbel noise G_v = -log(-log U_v). On CUDA one Triton kernel does it
in a single pass over the logits (no softmax, no float32 copy, no host sync per sequence); when the
rows are fewer than eight per SM, it splits each row over several programs, and the last of a row's
programs to finish picks the best of its chunks.

A batch in which some row uses top-k / top-p / min-p, penalties, a seed or logprobs takes the general
path, still one call for the whole batch. On CUDA: penalties on a float32 copy (`logits_processor.py`,
sparse), the filters as one threshold per row found without a sort (`sampling_filters.py`), then the
same race, which skips the logits under each row's threshold. A seeded row's noise is keyed by its
request's seed and the token's position alone. On CPU the torch reference does the same with sorts and
per-row generators.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn
from triton.language.extra import libdevice

from nanovllm.kernels.device import arrival_counts, num_sms
from nanovllm.sampling.filters import filter_thresholds
from nanovllm.sampling.logits_processor import apply_min_p, apply_penalties, apply_top_k_top_p


@triton.jit
def _uniforms(seed, first_group, BLOCK: tl.constexpr):
    """[BLOCK] uniforms in [0, 1) for BLOCK consecutive columns starting at a multiple of 4: column 4j + i
    takes output i of the Philox call at counter first_group + j, four draws per call (tl.rand makes one).
    The interleave keeps each column's draw independent of how the row is blocked or split."""
    r0, r1, r2, r3 = tl.rand4x(seed, first_group + tl.arange(0, BLOCK // 4))
    return tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK])


@triton.jit
def _gumbel(uniform, FAST_LOG: tl.constexpr):
    """-log(-log(uniform)). FAST_LOG (compiled for the GPU): each log from the GPU's approximate log2 unit,
    one instruction, against a ~12-FMA polynomial each for tl.log, which made the sampler compute-bound;
    its error (~2^-22 relative) only perturbs the noise. The interpreter has no fast_logf."""
    if FAST_LOG:
        gumbel = -libdevice.fast_logf(-libdevice.fast_logf(uniform))
    else:
        gumbel = -tl.log(-tl.log(uniform))
    return gumbel


@triton.jit
def _sample_kernel(logits_ptr, logits_stride, temperatures_ptr, thresholds_ptr, row_seeds_ptr, scores_ptr, tokens_ptr,
                   arrivals_ptr, out_ptr, seed_ptr, vocab_size, chunk_size, FILTERED: tl.constexpr,
                   ROW_SEEDS: tl.constexpr, BLOCK: tl.constexpr, MAX_CHUNKS: tl.constexpr, FAST_LOG: tl.constexpr):
    """Program (row, chunk): the best score of the chunk's columns and its token. With one chunk a row
    (MAX_CHUNKS 1) that is the row's token, into out [rows]. Else it goes into [rows, chunks] partials, and
    the last of the row's programs to finish (counted in arrivals [rows], which it sets back to 0 for the next
    launch) writes the token of the best chunk, the earliest on ties, as torch.argmax would pick it.
    The noise is keyed by the step's seed (read from the device: a CUDA graph replays with a new one).
    FILTERED: logits below the row's threshold are out. ROW_SEEDS: a row with a seed key (>= 0) draws
    its noise from that key alone, so its token does not depend on the row's place in the batch."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    seed = tl.load(seed_ptr)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0
    inv_temperature = 1.0 / tl.where(greedy, 1.0, temperature)
    groups_per_row = tl.cdiv(vocab_size, 4)
    # The noise depends on (seed, first_group + column) only: the token drawn does not depend on the split.
    first_group = row * groups_per_row
    if ROW_SEEDS:
        row_seed = tl.load(row_seeds_ptr + row)
        first_group = tl.where(row_seed >= 0, 0, first_group)
        seed = tl.where(row_seed >= 0, row_seed, seed)
    threshold = tl.load(thresholds_ptr + row) if FILTERED else -float("inf")
    begin = chunk * chunk_size
    end = tl.minimum(begin + chunk_size, vocab_size)
    best_score = -float("inf")
    best_token = begin
    for start in range(begin, end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < end
        logits = tl.load(logits_ptr + row * logits_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        uniform = _uniforms(seed, first_group + start // 4, BLOCK)
        gumbel = _gumbel(uniform, FAST_LOG)
        scores = tl.where(greedy, logits, logits * inv_temperature + gumbel)
        scores = tl.where(mask & (logits >= threshold), scores, -float("inf"))
        block_best, block_token = tl.max(scores, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = block_best > best_score  # strict: the earliest maximum wins, as torch.argmax
        best_token = tl.where(better, start + block_token, best_token)
        best_score = tl.where(better, block_best, best_score)
    if MAX_CHUNKS == 1:
        tl.store(out_ptr + row, best_token)
    else:
        num_chunks = tl.num_programs(1)
        partial = row * num_chunks + chunk
        tl.store(scores_ptr + partial, best_score)
        tl.store(tokens_ptr + partial, best_token)
        # Every thread's stores come before the count (one thread's atomic, releasing them at GPU scope).
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel", scope="gpu") == num_chunks - 1:
            chunks = tl.arange(0, MAX_CHUNKS)
            # the other programs' partials from L2 (.cg), past this SM's L1
            scores = tl.load(scores_ptr + row * num_chunks + chunks, mask=chunks < num_chunks, other=-float("inf"),
                             cache_modifier=".cg")
            _, best_chunk = tl.max(scores, axis=0, return_indices=True, return_indices_tie_break_left=True)
            tl.store(out_ptr + row, tl.load(tokens_ptr + row * num_chunks + best_chunk, cache_modifier=".cg"))
            tl.store(arrivals_ptr + row, 0)


CHUNK_BLOCK = 1024  # columns per block, and the smallest chunk, when rows are split


def sample_triton(logits: torch.Tensor, temperatures: torch.Tensor, seed: int | torch.Tensor,
                  num_chunks: int | None = None, thresholds: torch.Tensor | None = None,
                  row_seeds: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [rows, vocab] -> [rows] int64 (into out, if given). One program per row, in one pass, once the
    rows fill the GPU; with fewer than eight rows per SM each row's vocabulary is split over up to `num_chunks`
    programs (by default about eight programs per SM; one chunk on CPU), the last of which to finish takes the
    row's best chunk, the earliest on ties. The tokens are the same for any split. (H200, Qwen3's vocabulary:
    80 us at 128 rows against 102 us with two programs per SM, 48.7 against 58.2 at 64 rows; BENCHMARKS.md.)

    thresholds: [rows] float32, the smallest logit each row keeps (see sampling_filters).
    row_seeds: [rows] int64 Philox keys of the seeded rows, -1 for rows drawing from `seed`."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1
    if isinstance(seed, int):
        seed = torch.tensor([seed], dtype=torch.int64, device=logits.device)
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_chunks is None:
        num_chunks = max(1, 8 * num_sms(logits.device) // num_rows) if logits.is_cuda else 1
    if num_chunks == 1:
        block, num_warps, chunk_size = min(4096, max(16, triton.next_power_of_2(vocab_size))), 8, vocab_size
    else:  # chunks of whole blocks, at least one block each
        block, num_warps = CHUNK_BLOCK, 4
        chunk_size = triton.cdiv(triton.cdiv(vocab_size, num_chunks), block) * block
        num_chunks = triton.cdiv(vocab_size, chunk_size)
    if num_chunks == 1:
        scores = tokens = arrivals = out  # unused
    else:
        scores = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
        tokens = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=logits.device)
        arrivals = arrival_counts("sampler chunks", num_rows, logits.device)
    _sample_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), temperatures, thresholds, row_seeds, scores, tokens, arrivals, out, seed,
        vocab_size, chunk_size, FILTERED=thresholds is not None, ROW_SEEDS=row_seeds is not None, BLOCK=block,
        MAX_CHUNKS=triton.next_power_of_2(num_chunks), FAST_LOG=logits.is_cuda, num_warps=num_warps)
    return out


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
    ids: torch.Tensor  # [rows, width] int64: the prompt's then the output's token ids, padded with vocab_size
    prompt_lens: torch.Tensor  # [rows, 1] int64
    repetition: torch.Tensor  # [rows] float32, 1 = off
    frequency: torch.Tensor  # [rows] float32, 0 = off
    presence: torch.Tensor  # [rows] float32, 0 = off


@dataclass(slots=True)
class SamplingMetadata:
    """One step's sampling settings on the device, a row per sampled sequence. A control that no row
    uses is None (or empty), so a temperature-only batch keeps the one-pass kernel."""

    temperatures: torch.Tensor  # [rows] float32, 0 = greedy
    # [1] int64: the noise seed of the rows without a seed of their own (the Triton race; the torch reference
    # draws from torch's generator), drawn on the host by torch's generator (sampling_metadata.noise_seed), so
    # that torch.manual_seed reproduces runs and a CUDA graph of the sampler holds no random-number op.
    seed: torch.Tensor
    top_k: torch.Tensor | None = None  # [rows] int64, vocab_size = off
    top_p: torch.Tensor | None = None  # [rows] float32, 1 = off
    max_top_k: int | None = None  # the largest k of the rows with top-k, or more (candidates of top-k)
    # Whether every row with top_p < 1 also has a top_k: then both filters work on each row's largest
    # max_top_k logits, else a full sort (torch) or a search (Triton) serves the rows without one.
    top_p_within_top_k: bool = True
    min_p: torch.Tensor | None = None  # [rows] float32, 0 = off
    penalties: Penalties | None = None
    # [rows] int64: the Philox key of each seeded row's draw (sampling_metadata.seed_key), -1 for the others.
    row_seeds: torch.Tensor | None = None
    suppressed: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) [n] each: never sampled
    num_logprobs: int | None = None  # top-N log-probabilities for every row (the largest N any row asks for)

    @property
    def only_temperature(self) -> bool:
        return (self.top_k is None and self.top_p is None and self.min_p is None and self.penalties is None
                and self.row_seeds is None and self.num_logprobs is None)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor, in a fixed order."""
        tensors = [self.temperatures, self.seed, self.top_k, self.top_p, self.min_p, self.row_seeds,
                   *(self.suppressed or ())]
        if self.penalties is not None:
            p = self.penalties
            tensors += [p.ids, p.prompt_lens, p.repetition, p.frequency, p.presence]
        return [t for t in tensors if t is not None]

    def shape_key(self) -> tuple:
        """What a sampling call's work depends on besides the tensors' values: a CUDA graph of the call
        replays for any metadata with the same key."""
        fields = (self.top_k, self.top_p, self.min_p, self.penalties, self.row_seeds, self.suppressed)
        return (tuple(field is None for field in fields), tuple(t.shape for t in self.tensors()), self.max_top_k,
                self.top_p_within_top_k, self.num_logprobs)


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

    def first_rows(self, num_rows: int) -> "SamplerOutput":
        def rows(tensor):
            return None if tensor is None else tensor[:num_rows]

        return SamplerOutput(rows(self.token_ids), rows(self.logprob_token_ids), rows(self.logprobs))


def sample_with_controls_torch(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The general path in torch (the CPU reference), vLLM's order: penalties, greedy argmax,
    temperature, min-p, top-k / top-p, then the exponential race; a seeded row draws its noise from a
    generator seeded with its key. logits: [rows, vocab] -> [rows]."""
    logits = logits.to(torch.float32, copy=True)  # [rows, vocab], processed in place
    if meta.penalties is not None:
        p = meta.penalties
        apply_penalties(logits, p.ids, p.prompt_lens, p.repetition, p.frequency, p.presence)
    greedy = meta.temperatures == 0
    greedy_tokens = logits.argmax(dim=-1)
    logits.div_(torch.where(greedy, 1.0, meta.temperatures).unsqueeze(1))
    if meta.min_p is not None:
        apply_min_p(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.max_top_k if meta.top_p_within_top_k else None)
    keys = [] if meta.row_seeds is None else meta.row_seeds.tolist()  # on the host: this path is for the CPU
    generators = {row: torch.Generator(logits.device).manual_seed(key) for row, key in enumerate(keys) if key >= 0}
    return torch.where(greedy, greedy_tokens, exponential_race(logits, generators))


def sample_with_controls_triton(logits: torch.Tensor, meta: SamplingMetadata,
                                out: torch.Tensor | None = None) -> torch.Tensor:
    """The general path with Triton kernels, in the same order: penalties (on a float32 copy), then the
    filters as one threshold per row (sampling_filters), then the one-pass race, which skips logits
    under the threshold and keys each seeded row's noise on its own Philox key (the others' on meta.seed)."""
    if meta.penalties is not None:
        p = meta.penalties
        logits = apply_penalties(logits.to(torch.float32, copy=True), p.ids, p.prompt_lens, p.repetition,
                                 p.frequency, p.presence)
    thresholds = None
    if meta.top_k is not None or meta.top_p is not None or meta.min_p is not None:
        thresholds = filter_thresholds(logits, meta.temperatures, meta.top_k, meta.top_p, meta.min_p, meta.max_top_k,
                                       not meta.top_p_within_top_k)
    return sample_triton(logits, meta.temperatures, meta.seed, thresholds=thresholds, row_seeds=meta.row_seeds,
                         out=out)


class Sampler(nn.Module):
    """use_triton: sample with the Triton kernels (None: on CUDA); else with the torch reference."""

    def __init__(self, use_triton: bool | None = None):
        super().__init__()
        self.use_triton = use_triton

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata, out: torch.Tensor | None = None) -> SamplerOutput:
        """logits: [rows, vocab] (modified in place) -> a token per row (into out [rows] int64, if given), plus
        log-probabilities if asked, on the device: nothing here waits for the GPU."""
        # Log-probabilities of the model's raw logits, before penalties, temperature and filtering, as
        # vLLM returns by default (logprobs_mode="raw_logprobs"): logit - logsumexp(row), the top N
        # taken from the raw logits, whose order is the log-softmax's (no [rows, vocab] log-softmax).
        if meta.num_logprobs is not None:
            top = logits.topk(meta.num_logprobs, dim=-1)
            log_normalizer = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
        if meta.suppressed is not None:  # (a -inf filled on the device: no host copy in a CUDA graph)
            logits.index_put_(meta.suppressed, logits.new_full((), -float("inf")))
        use_triton = logits.is_cuda if self.use_triton is None else self.use_triton
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
        sampled = logits.gather(1, tokens.unsqueeze(1))  # still the raw logit: a suppressed token is never drawn
        ids = torch.cat([tokens.unsqueeze(1), top.indices], dim=1)  # [rows, 1 + N]
        return SamplerOutput(tokens, ids, torch.cat([sampled, top.values], dim=1).float() - log_normalizer)
