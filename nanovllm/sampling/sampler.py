"""Token sampling: greedy rows by argmax, the others by the race argmax_v logit_v / T + G_v, with
Gumbel noise G_v = -log(-log U_v): a draw from softmax(logit / T). U is counter-based Philox noise
keyed by (seed, column), so a seeded row draws the same token in any batch and any split."""

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
    """[BLOCK] uniforms for BLOCK columns from a multiple of 4: column 4j + i is output i of Philox
    counter first_group + j, so a column's draw does not depend on how the row is blocked."""
    r0, r1, r2, r3 = tl.rand4x(seed, first_group + tl.arange(0, BLOCK // 4))
    return tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK])


@triton.jit
def _gumbel(uniform, FAST_LOG: tl.constexpr):
    if FAST_LOG:
        gumbel = -libdevice.fast_logf(-libdevice.fast_logf(uniform))
    else:
        gumbel = -tl.log(-tl.log(uniform))
    return gumbel


@triton.jit
def _sample_kernel(logits_ptr, logits_stride, temperatures_ptr, thresholds_ptr, row_seeds_ptr,
                   scores_ptr, tokens_ptr, arrivals_ptr, out_ptr, seed_ptr, vocab_size, chunk_size,
                   FILTERED: tl.constexpr, ROW_SEEDS: tl.constexpr, BLOCK: tl.constexpr,
                   MAX_CHUNKS: tl.constexpr, FAST_LOG: tl.constexpr):
    """Program (row, chunk): the chunk's best score and token into [rows, chunks] partials; the
    row's last program (arrivals [rows]) writes the best chunk's token. MAX_CHUNKS 1: one chunk."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    seed = tl.load(seed_ptr)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0
    inv_temperature = 1.0 / tl.where(greedy, 1.0, temperature)
    first_group = row * tl.cdiv(vocab_size, 4)
    if ROW_SEEDS:  # a seeded row (key >= 0) draws from its key alone, wherever it is in the batch
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
        logits = tl.load(logits_ptr + row * logits_stride + cols, mask=mask,
                         other=-float("inf")).to(tl.float32)
        gumbel = _gumbel(_uniforms(seed, first_group + start // 4, BLOCK), FAST_LOG)
        scores = tl.where(greedy, logits, logits * inv_temperature + gumbel)
        scores = tl.where(mask & (logits >= threshold), scores, -float("inf"))
        block_best, block_token = tl.max(scores, axis=0, return_indices=True,
                                         return_indices_tie_break_left=True)
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
        # Every thread's stores come before the count (one thread's atomic releases them).
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel", scope="gpu") == num_chunks - 1:
            chunks = tl.arange(0, MAX_CHUNKS)
            # .cg: the other programs' partials from L2, past this SM's L1
            scores = tl.load(scores_ptr + row * num_chunks + chunks, mask=chunks < num_chunks,
                             other=-float("inf"), cache_modifier=".cg")
            _, best_chunk = tl.max(scores, axis=0, return_indices=True,
                                   return_indices_tie_break_left=True)
            token = tl.load(tokens_ptr + row * num_chunks + best_chunk, cache_modifier=".cg")
            tl.store(out_ptr + row, token)
            tl.store(arrivals_ptr + row, 0)


CHUNK_BLOCK = 1024  # columns per block, and the smallest chunk, when rows are split


def sample_triton(logits: torch.Tensor, temperatures: torch.Tensor, seed: int | torch.Tensor,
                  num_chunks: int | None = None, thresholds: torch.Tensor | None = None,
                  row_seeds: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [rows, vocab] -> [rows] int64, each row over `num_chunks` programs; thresholds [rows]:
    the smallest logit each row keeps; row_seeds [rows]: Philox keys, -1 for rows drawing `seed`."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1
    if isinstance(seed, int):
        seed = torch.tensor([seed], dtype=torch.int64, device=logits.device)
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_chunks is None:
        num_chunks = max(1, 8 * num_sms(logits.device) // num_rows) if logits.is_cuda else 1
    if num_chunks == 1:
        block = min(4096, max(16, triton.next_power_of_2(vocab_size)))
        num_warps, chunk_size = 8, vocab_size
    else:
        block, num_warps = CHUNK_BLOCK, 4
        chunk_size = triton.cdiv(triton.cdiv(vocab_size, num_chunks), block) * block
        num_chunks = triton.cdiv(vocab_size, chunk_size)
    if num_chunks == 1:
        scores = tokens = arrivals = out
    else:
        scores = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
        tokens = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=logits.device)
        arrivals = arrival_counts("sampler chunks", num_rows, logits.device)
    _sample_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), temperatures, thresholds, row_seeds, scores, tokens, arrivals,
        out, seed, vocab_size, chunk_size, FILTERED=thresholds is not None,
        ROW_SEEDS=row_seeds is not None, BLOCK=block, MAX_CHUNKS=triton.next_power_of_2(num_chunks),
        FAST_LOG=logits.is_cuda, num_warps=num_warps)
    return out


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
    num_logprobs: int | None = None

    @property
    def only_temperature(self) -> bool:
        return (self.top_k is None and self.top_p is None and self.min_p is None
                and self.penalties is None and self.row_seeds is None
                and self.num_logprobs is None)

    def tensors(self) -> list[torch.Tensor]:
        tensors = [self.temperatures, self.seed, self.top_k, self.top_p, self.min_p,
                   self.row_seeds, *(self.suppressed or ())]
        if self.penalties is not None:
            p = self.penalties
            tensors += [p.ids, p.prompt_lens, p.repetition, p.frequency, p.presence]
        return [t for t in tensors if t is not None]

    def shape_key(self) -> tuple:
        """A CUDA graph of a sampling call replays for any metadata with the same key."""
        fields = (self.top_k, self.top_p, self.min_p, self.penalties, self.row_seeds,
                  self.suppressed)
        return (tuple(field is None for field in fields), tuple(t.shape for t in self.tensors()),
                self.max_top_k, self.top_p_within_top_k, self.num_logprobs)


@dataclass(slots=True)
class SamplerOutput:
    """token_ids [rows]; with logprobs, [rows, 1 + N] ids (sampled, then top N) and logprobs."""

    token_ids: torch.Tensor
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None

    def to_host(self) -> "SamplerOutput":
        """Pinned host copies, queued without waiting: read them once the stream has passed here."""
        def copy(tensor):
            if tensor is None or not tensor.is_cuda:
                return tensor
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return host.copy_(tensor, non_blocking=True)

        return SamplerOutput(copy(self.token_ids), copy(self.logprob_token_ids),
                             copy(self.logprobs))

    def first_rows(self, num_rows: int) -> "SamplerOutput":
        def rows(tensor):
            return None if tensor is None else tensor[:num_rows]

        return SamplerOutput(rows(self.token_ids), rows(self.logprob_token_ids),
                             rows(self.logprobs))


def sample_with_controls_torch(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The CPU reference, in vLLM's order: penalties, temperature, min-p, top-k / top-p, race."""
    logits = logits.to(torch.float32, copy=True)
    if meta.penalties is not None:
        p = meta.penalties
        apply_penalties(logits, p.ids, p.prompt_lens, p.repetition, p.frequency, p.presence)
    greedy = meta.temperatures == 0
    greedy_tokens = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return greedy_tokens
    logits.div_(torch.where(greedy, 1.0, meta.temperatures).unsqueeze(1))
    if meta.min_p is not None:
        apply_min_p(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        num_candidates = meta.max_top_k if meta.top_p_within_top_k else None
        apply_top_k_top_p(logits, meta.top_k, meta.top_p, num_candidates)
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
    """use_triton: sample with the Triton kernels (None: on CUDA); else with the torch reference."""

    def __init__(self, use_triton: bool | None = None):
        super().__init__()
        self.use_triton = use_triton

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata,
                out: torch.Tensor | None = None) -> SamplerOutput:
        """logits [rows, vocab], modified in place -> [rows] tokens; nothing waits for the GPU."""
        # vLLM's raw logprobs: logit - logsumexp(row), before penalties, temperature and filters.
        if meta.num_logprobs is not None:
            top = logits.topk(meta.num_logprobs, dim=-1)
            log_normalizer = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
        if meta.suppressed is not None:
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
        sampled = logits.gather(1, tokens.unsqueeze(1))
        ids = torch.cat([tokens.unsqueeze(1), top.indices], dim=1)
        logprobs = torch.cat([sampled, top.values], dim=1).float() - log_normalizer
        return SamplerOutput(tokens, ids, logprobs)
