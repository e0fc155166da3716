"""One step's sampling settings, from the step's sampling rows to device tensors (rank 0)."""

from collections.abc import Callable

import numpy as np
import torch

from nanovllm.runner.host_to_device import ToDevice, to_device_packed
from nanovllm.sampling.sampler import Penalties, SamplingMetadata
from nanovllm.sampling_params import MAX_LOGPROBS, SamplingParams
from nanovllm.step import RequestSampling, StepSampling

# The device tokens of sampling rows (their indices) whose last step is still in flight.
InflightTokens = Callable[[list[int]], torch.Tensor]

# Every control at once: the memory profile samples a batch with these settings.
ALL_CONTROLS = SamplingParams(top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                              presence_penalty=0.1, frequency_penalty=0.1, logprobs=MAX_LOGPROBS,
                              logit_bias={0: 1.0})


def every_control(num_rows: int) -> StepSampling:
    """`num_rows` rows of ALL_CONTROLS, each one token long: the sampler's largest footprint."""
    request = RequestSampling.of(ALL_CONTROLS, num_prompt_tokens=1)
    history = np.zeros(1, dtype=np.int64)
    return StepSampling([request] * num_rows, [1] * num_rows,
                        histories=dict.fromkeys(range(num_rows), history))


def noise_seed() -> int:
    """A step's noise seed (SamplingMetadata.seed), drawn by torch's default generator."""
    return torch.randint(2**31 - 1, ()).item()


def build_sampling_metadata(sampling: StepSampling, vocab_size: int, to_device: ToDevice,
                            inflight_tokens: InflightTokens | None = None,
                            num_rows: int | None = None,
                            seed: int | None = None) -> SamplingMetadata:
    """A row per sampling row; inflight_tokens: the device tokens of rows in flight (penalties);
    seed: None draws one; num_rows: pad to this many neutral rows and round the other sizes up to
    powers of two, so that few shapes recur for the sampler's CUDA graphs."""
    requests = sampling.requests
    shape = _Shape(len(requests), num_rows)
    host = {"temperatures": shape.rows([r.params.temperature for r in requests], 0, np.float32),
            "seed": np.array([noise_seed() if seed is None else seed], dtype=np.int64)}
    suppressed = [(row, token_id) for row, stop_ids in sampling.suppressed.items()
                  for token_id in stop_ids]
    if suppressed:  # padded with repeats of the first pair: suppressing it twice changes nothing
        suppressed += suppressed[:1] * (shape.size(len(suppressed)) - len(suppressed))
        host["suppressed"] = np.array(suppressed, dtype=np.int64).T.copy()
    max_top_k, top_p_within_top_k, num_logprobs, penalty_ids = None, True, None, None
    uses_controls = sampling.uses_controls
    if uses_controls:
        max_top_k, top_p_within_top_k, num_logprobs, penalty_ids = _control_arrays(
            sampling, vocab_size, shape, host)
    if sampling.bitmask is not None:
        host["grammar_rows"] = np.array(sampling.grammar_rows, dtype=np.int64)
        host["bitmask"] = sampling.bitmask
    bias = None
    if uses_controls and any(request.biased for request in requests):
        bias = to_device(_bias_rows(requests, vocab_size, shape))  # large: copied alone
    device = to_device_packed(host, to_device)
    penalties = None
    if penalty_ids is not None:  # [rows, width]: large, copied alone rather than packed
        penalties = Penalties(to_device(penalty_ids), device["prompt_lens"], device["repetition"],
                              device["frequency"], device["presence"])
        if "inflight" in device:
            rows, positions = device["inflight"]
            penalties.ids[rows, positions] = inflight_tokens(host["inflight"][0].tolist())
    suppressed = tuple(device["suppressed"]) if "suppressed" in device else None
    grammar = (device["grammar_rows"], device["bitmask"]) if "bitmask" in device else None
    return SamplingMetadata(device["temperatures"], device["seed"], top_k=device.get("top_k"),
                            top_p=device.get("top_p"), max_top_k=max_top_k,
                            top_p_within_top_k=top_p_within_top_k, min_p=device.get("min_p"),
                            penalties=penalties, row_seeds=device.get("row_seeds"),
                            suppressed=suppressed, bias=bias, grammar=grammar,
                            num_logprobs=num_logprobs,
                            only_temperature=not uses_controls)


def _control_arrays(sampling: StepSampling, vocab_size: int, shape: "_Shape",
                    host: dict[str, np.ndarray]) -> tuple:
    """The used controls' arrays into `host`; the other fields of the metadata, and penalty ids."""
    params = [request.params for request in sampling.requests]
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
    if sampling.histories:
        penalty_ids, penalty_arrays = _penalty_arrays(sampling, vocab_size, shape)
        host.update(penalty_arrays)
    if any(p.seed is not None for p in params):
        keys = [-1 if p.seed is None else seed_key(p.seed, position)
                for p, position in zip(params, sampling.positions)]
        host["row_seeds"] = shape.rows(keys, -1, np.int64)
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    if wanted:
        num_logprobs = max(wanted)
    return max_top_k, top_p_within_top_k, num_logprobs, penalty_ids


def _bias_rows(requests: list[RequestSampling], vocab_size: int, shape: "_Shape") -> np.ndarray:
    """[rows, vocab] float32 added to the logits: logit_bias, -inf outside allowed_token_ids and at
    the bad words' ids, 0 elsewhere (and on padding rows)."""
    bias = np.zeros((shape.num_rows, vocab_size), dtype=np.float32)
    for row, request in enumerate(requests):
        params = request.params
        if params.allowed_token_ids:
            allowed = bias[row, params.allowed_token_ids].copy()
            bias[row] = -np.inf
            bias[row, params.allowed_token_ids] = allowed
        if params.logit_bias:
            bias[row, list(params.logit_bias)] += list(params.logit_bias.values())
        if request.banned_ids:
            bias[row, list(request.banned_ids)] = -np.inf
    return bias


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


def _penalty_arrays(sampling: StepSampling, vocab_size: int,
                    shape: _Shape) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """ids [rows, width] padded with vocab_size, and the small arrays ("inflight": [2, n], the
    (row, position) of each token in flight, filled in on the device)."""
    requests, positions = sampling.requests, sampling.positions
    width = shape.size(max(positions[row] for row in sampling.histories))
    ids = np.full((shape.num_rows, width), vocab_size, dtype=np.int64)
    prompt_lens = np.zeros((shape.num_rows, 1), dtype=np.int64)
    inflight = []
    for row, history in sampling.histories.items():
        ids[row, :len(history)] = history
        inflight += [(row, position) for position in range(len(history), positions[row])]
        prompt_lens[row] = requests[row].num_prompt_tokens
    params = [request.params for request in requests]
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
