"""One step's sampling settings, from the sequences to device tensors (rank 0)."""

from collections.abc import Callable

import numpy as np
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.runner.host_to_device import ToDevice, to_device_packed
from nanovllm.sampling.sampler import Penalties, SamplingMetadata
from nanovllm.sampling_params import MAX_LOGPROBS, SamplingParams

InflightTokens = Callable[[list[Sequence]], torch.Tensor]

# Every control at once: the memory profile samples a batch with these settings.
ALL_CONTROLS = SamplingParams(top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                              presence_penalty=0.1, frequency_penalty=0.1, logprobs=MAX_LOGPROBS)


def noise_seed() -> int:
    """A step's noise seed (SamplingMetadata.seed), drawn by torch's default generator."""
    return torch.randint(2**31 - 1, ()).item()


def build_sampling_metadata(seqs: list[Sequence], vocab_size: int, to_device: ToDevice,
                            inflight_tokens: InflightTokens | None = None,
                            num_rows: int | None = None,
                            seed: int | None = None) -> SamplingMetadata:
    """A row per sequence; inflight_tokens: the device tokens of sequences in flight (penalties);
    seed: None draws one; num_rows: pad to this many neutral rows and round the other sizes up to
    powers of two, so that few shapes recur for the sampler's CUDA graphs."""
    shape = _Shape(len(seqs), num_rows)
    host = {"temperatures": shape.rows([seq.temperature for seq in seqs], 0, np.float32),
            "seed": np.array([noise_seed() if seed is None else seed], dtype=np.int64)}
    suppressed = [(row, token_id) for row, seq in enumerate(seqs) if suppresses_stop_ids(seq)
                  for token_id in seq.min_tokens_stop_ids]
    if suppressed:  # padded with repeats of the first pair: suppressing it twice changes nothing
        suppressed += suppressed[:1] * (shape.size(len(suppressed)) - len(suppressed))
        host["suppressed"] = np.array(suppressed, dtype=np.int64).T.copy()
    max_top_k, top_p_within_top_k, num_logprobs, penalty_ids = None, True, None, None
    if not all(seq.only_temperature for seq in seqs):
        max_top_k, top_p_within_top_k, num_logprobs, penalty_ids = _control_arrays(
            seqs, vocab_size, shape, host)
    device = to_device_packed(host, to_device)
    penalties = None
    if penalty_ids is not None:  # [rows, width]: large, copied alone rather than packed
        penalties = Penalties(to_device(penalty_ids), device["prompt_lens"], device["repetition"],
                              device["frequency"], device["presence"])
        if "inflight" in device:
            rows, positions = device["inflight"]
            inflight_seqs = [seqs[row] for row in host["inflight"][0]]
            penalties.ids[rows, positions] = inflight_tokens(inflight_seqs)
    suppressed = tuple(device["suppressed"]) if "suppressed" in device else None
    return SamplingMetadata(device["temperatures"], device["seed"], top_k=device.get("top_k"),
                            top_p=device.get("top_p"), max_top_k=max_top_k,
                            top_p_within_top_k=top_p_within_top_k, min_p=device.get("min_p"),
                            penalties=penalties, row_seeds=device.get("row_seeds"),
                            suppressed=suppressed, num_logprobs=num_logprobs)


def _control_arrays(seqs: list[Sequence], vocab_size: int, shape: "_Shape",
                    host: dict[str, np.ndarray]) -> tuple:
    """The used controls' arrays into `host`; the other fields of the metadata, and penalty ids."""
    params = [seq.sampling_params for seq in seqs]
    max_top_k, num_logprobs, penalty_ids = None, None, None
    if any(p.top_k > 0 for p in params):
        top_ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        host["top_k"] = shape.rows(top_ks, vocab_size, np.int64)
        largest = max(k for k, p in zip(top_ks, params) if p.top_k > 0)
        max_top_k = min(shape.size(largest), vocab_size)
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
        keys = [-1 if p.seed is None else seed_key(p.seed, len(seq))
                for p, seq in zip(params, seqs)]
        host["row_seeds"] = shape.rows(keys, -1, np.int64)
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    if wanted:
        num_logprobs = max(wanted)
    return max_top_k, top_p_within_top_k, num_logprobs, penalty_ids


def suppresses_stop_ids(seq: Sequence) -> bool:
    """Whether `seq` is short of min_tokens: the sampler keeps it from drawing its stop ids."""
    return bool(seq.min_tokens_stop_ids) and seq.num_completion_tokens < seq.min_tokens


def only_temperature(seqs: list[Sequence]) -> bool:
    """Whether the one-pass temperature sampler draws every token of `seqs`."""
    return all(seq.only_temperature and not suppresses_stop_ids(seq) for seq in seqs)


class _Shape:
    def __init__(self, num_seqs: int, num_rows: int | None):
        self.num_seqs = num_seqs
        self.num_rows = num_seqs if num_rows is None else num_rows
        self.padded = num_rows is not None

    def rows(self, values: list, neutral, dtype) -> np.ndarray:
        array = np.full(self.num_rows, neutral, dtype=dtype)
        array[:self.num_seqs] = values
        return array

    def size(self, n: int) -> int:
        return 1 << (n - 1).bit_length() if self.padded else n


def _penalty_arrays(seqs: list[Sequence], vocab_size: int,
                    shape: _Shape) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """ids [rows, width] padded with vocab_size, and the small arrays ("inflight": [2, n])."""
    params = [seq.sampling_params for seq in seqs]
    penalised = [row for row, p in enumerate(params) if p.uses_penalties]
    width = shape.size(max(len(seqs[row]) for row in penalised))
    ids = np.full((shape.num_rows, width), vocab_size, dtype=np.int64)
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
    """The 63-bit Philox key of a seeded request's draw at `position`: the same in any batch."""
    return _mix64((_mix64(seed) + position * 0x9E3779B97F4A7C15) & MASK64) >> 1


class TokenHistory:
    """A growing int64 copy of a sequence's token ids: each step converts only the new tokens."""

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
