"""Gather one step's sampling settings from the sequences into device tensors for the Sampler (rank 0).

Host work is a few passes over the rows; a control no row uses costs nothing beyond the check, so a
temperature-only batch pays what it did before the other controls existed.
"""

from collections.abc import Callable

import numpy as np
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.runner.host_to_device import ToDevice, to_device_packed
from nanovllm.sampling.sampler import Penalties, SamplingMetadata
from nanovllm.sampling_params import MAX_LOGPROBS, SamplingParams

InflightTokens = Callable[[list[Sequence]], torch.Tensor]

# Every control at once: the memory profile samples a batch with these settings.
ALL_CONTROLS = SamplingParams(top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.1,
                              frequency_penalty=0.1, logprobs=MAX_LOGPROBS)


def noise_seed() -> int:
    """A step's noise seed (SamplingMetadata.seed), drawn on the host by torch's default generator."""
    return torch.randint(2**31 - 1, ()).item()


def build_sampling_metadata(seqs: list[Sequence], vocab_size: int, to_device: ToDevice,
                            inflight_tokens: InflightTokens | None = None, num_rows: int | None = None,
                            seed: int | None = None) -> SamplingMetadata:
    """`seqs`: the sequences that sample this step, one row each; `to_device` copies a host array to
    the device (the model runner's pinned, non-blocking copy), called with the small arrays packed into
    one; `inflight_tokens` gives the last tokens of sequences whose previous step has not reached
    the host yet, on the device (penalties count them); `seed`: the step's noise seed (StepInputs.seed;
    None draws one).

    num_rows: pad to this many rows (greedy, with every control off) and round the other sizes up to
    powers of two (top-k candidates, penalised token ids, suppressed ids), so that a few shapes recur
    from step to step, as CUDA graphs of the sampler need (sampling.graphs.SamplerGraphs)."""
    shape = _Shape(len(seqs), num_rows)
    host = {"temperatures": shape.rows([seq.temperature for seq in seqs], 0, np.float32),
            "seed": np.array([noise_seed() if seed is None else seed], dtype=np.int64)}
    suppressed = [(row, token_id) for row, seq in enumerate(seqs) if suppresses_stop_ids(seq)
                  for token_id in seq.min_tokens_stop_ids]
    if suppressed:  # padded with repeats of the first pair: suppressing it twice changes nothing
        suppressed += suppressed[:1] * (shape.size(len(suppressed)) - len(suppressed))
        host["suppressed"] = np.array(suppressed, dtype=np.int64).T.copy()  # [2, n]: rows, token ids
    max_top_k, top_p_within_top_k, num_logprobs, penalty_ids = None, True, None, None
    if not all(seq.only_temperature for seq in seqs):
        params = [seq.sampling_params for seq in seqs]
        if any(p.top_k > 0 for p in params):
            host["top_k"] = shape.rows([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params],
                                       vocab_size, np.int64)
            max_top_k = min(shape.size(max(min(p.top_k, vocab_size) for p in params if p.top_k > 0)), vocab_size)
        if any(p.top_p < 1 for p in params):
            host["top_p"] = shape.rows([p.top_p for p in params], 1, np.float32)
        top_p_within_top_k = all(p.top_k > 0 for p in params if p.top_p < 1)
        if any(p.min_p > 0 for p in params):
            host["min_p"] = shape.rows([p.min_p for p in params], 0, np.float32)
        if any(p.uses_penalties for p in params):
            penalty_ids, penalty_arrays = _penalty_arrays(seqs, vocab_size, shape)
            host.update(penalty_arrays)
        if any(p.seed is not None for p in params):
            # len(seq): the position of the token sampled now (tokens still in flight included).
            host["row_seeds"] = shape.rows([-1 if p.seed is None else seed_key(p.seed, len(seq))
                                            for p, seq in zip(params, seqs)], -1, np.int64)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            num_logprobs = max(wanted)
    device = to_device_packed(host, to_device)
    penalties = None
    if penalty_ids is not None:  # [rows, width]: large, copied alone rather than packed
        penalties = Penalties(to_device(penalty_ids), device["prompt_lens"], device["repetition"], device["frequency"],
                              device["presence"])
        if "inflight" in device:  # fill in the tokens whose values are still on the device
            rows, positions = device["inflight"]
            penalties.ids[rows, positions] = inflight_tokens([seqs[row] for row in host["inflight"][0]])
    return SamplingMetadata(device["temperatures"], device["seed"], top_k=device.get("top_k"),
                            top_p=device.get("top_p"), max_top_k=max_top_k, top_p_within_top_k=top_p_within_top_k,
                            min_p=device.get("min_p"), penalties=penalties, row_seeds=device.get("row_seeds"),
                            suppressed=tuple(device["suppressed"]) if "suppressed" in device else None,
                            num_logprobs=num_logprobs)


def suppresses_stop_ids(seq: Sequence) -> bool:
    """Whether the sampler keeps `seq` from drawing its EOS and stop ids this step: it is short of min_tokens."""
    return bool(seq.min_tokens_stop_ids) and seq.num_completion_tokens < seq.min_tokens


def only_temperature(seqs: list[Sequence]) -> bool:
    """Whether one pass of the temperature sampler draws every token of `seqs`: no control, no suppressed id."""
    return all(seq.only_temperature and not suppresses_stop_ids(seq) for seq in seqs)


class _Shape:
    """The metadata's sizes: exact, or padded (see build_sampling_metadata's num_rows)."""

    def __init__(self, num_seqs: int, num_rows: int | None):
        self.num_seqs = num_seqs
        self.num_rows = num_seqs if num_rows is None else num_rows
        self.padded = num_rows is not None

    def rows(self, values: list, neutral, dtype) -> np.ndarray:
        """A row per sequence, then `neutral` in the padding rows."""
        array = np.full(self.num_rows, neutral, dtype=dtype)
        array[:self.num_seqs] = values
        return array

    def size(self, n: int) -> int:
        return 1 << (n - 1).bit_length() if self.padded else n


def _penalty_arrays(seqs: list[Sequence], vocab_size: int, shape: _Shape) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Token ids [rows, width] of the penalised rows (prompt, then output), padded with vocab_size (the
    other rows are all padding), and the small arrays: the prompts' lengths, the penalties (neutral in
    the other rows) and "inflight", [2, n] (row, position) of the tokens still on the device, left as
    padding in the ids."""
    params = [seq.sampling_params for seq in seqs]
    penalised = [row for row, p in enumerate(params) if p.uses_penalties]
    ids = np.full((shape.num_rows, shape.size(max(len(seqs[row]) for row in penalised))), vocab_size, dtype=np.int64)
    prompt_lens = np.zeros((shape.num_rows, 1), dtype=np.int64)
    inflight = []
    for row in penalised:
        seq = seqs[row]
        if seq.token_history is None:
            seq.token_history = TokenHistory()
        known = len(seq) - seq.num_inflight
        ids[row, :known] = seq.token_history.update(seq.token_ids, known)
        inflight += [(row, position) for position in range(known, len(seq))]
        prompt_lens[row] = seq.num_prompt_tokens
    arrays = dict(prompt_lens=prompt_lens,
                  repetition=shape.rows([p.repetition_penalty for p in params], 1, np.float32),
                  frequency=shape.rows([p.frequency_penalty for p in params], 0, np.float32),
                  presence=shape.rows([p.presence_penalty for p in params], 0, np.float32))
    if inflight:
        arrays["inflight"] = np.array(inflight, dtype=np.int64).T.copy()
    return ids, arrays


MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit ints that scatters nearby inputs."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def seed_key(seed: int, position: int) -> int:
    """The Philox key (63 bits, >= 0) of a seeded request's draw for the token at `position`: a function
    of the two alone, so the request draws the same tokens in any batch, and a new key at every token."""
    return _mix64((_mix64(seed) + position * 0x9E3779B97F4A7C15) & MASK64) >> 1


class TokenHistory:
    """A growing int64 copy of a sequence's token ids: each step converts only the new tokens."""

    def __init__(self):
        self.array = np.empty(0, dtype=np.int64)
        self.length = 0

    def update(self, token_ids: list[int], n: int) -> np.ndarray:
        """The first n of token_ids (all known: no placeholder)."""
        if n > len(self.array):
            grown = np.empty(max(n, 2 * len(self.array)), dtype=np.int64)
            grown[:self.length] = self.array[:self.length]
            self.array = grown
        self.array[self.length:n] = token_ids[self.length:n]
        self.length = n
        return self.array[:n]
