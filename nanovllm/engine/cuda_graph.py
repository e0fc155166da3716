"""CUDA graphs of the decode forward, one per batch-size bucket (and of its temperature sampling), and of
the sampler's general path, replayed from static buffers."""

import copy

import numpy as np
import torch

from nanovllm.engine.host_to_device import ALIGNMENT, ToDevice, pinned, to_device_packed
from nanovllm.engine.sampling_metadata import InflightTokens, build_sampling_metadata, only_temperature
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.attention import AttentionMetadata
from nanovllm.layers.sampler import Sampler, SamplerOutput, SamplingMetadata


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, always including max_num_seqs itself."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return buckets + [max_num_seqs]


def smallest_bucket(buckets: list[int], rows: int) -> int:
    """The batch size of the graph that runs `rows` rows: the smallest bucket that holds them."""
    return next(b for b in buckets if b >= rows)


def decode_inputs_bytes(max_num_seqs: int, max_blocks_per_seq: int) -> int:
    """What StepInputs.prepare_decode packs at most: per row, the row arrays (token id, position and slot in
    int64; context length and decode order in int32; temperature in float32), the block-table row and the two
    int64 in-flight arrays; the noise seed (int64); each of the ten arrays padded to ALIGNMENT."""
    return max_num_seqs * (3 * 8 + 3 * 4 + 4 * max_blocks_per_seq + 2 * 8) + 8 + 10 * ALIGNMENT


class DecodeGraphs:
    """A graph per batch-size bucket reads its per-row inputs (token ids, positions, slots, context lengths,
    decode order) where the step's one packed host-to-device copy puts them: the start of `inputs`, at the
    offsets host_to_device.to_device_packed gives arrays of the bucket's row count (StepInputs.decode_rows
    pads them; the block tables at their widest, max_blocks_per_seq).

    With a `sampler` (rank 0 of a single-GPU engine, whose StepInputs pack decode_temperatures and the step's
    noise seed) each bucket also has a graph of the step's head: lm_head and the one-pass temperature sampler,
    seeded by the step's inputs as the eager sampler is, its tokens written into `tokens`. A step whose rows
    sample by temperature alone (`samples`) launches it (`sample`) instead of lm_head and the sampler: ~250 µs
    less host work a step, which on a slow host set the pace of a single stream (BENCHMARKS.md, twenty-second
    session)."""

    def __init__(self, runner, max_num_seqs: int, max_blocks_per_seq: int, sampler: Sampler | None = None):
        self.model = runner.model
        self.sampler = sampler
        self.buckets = batch_buckets(max_num_seqs)
        self.max_batch_size = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.inputs = torch.zeros(decode_inputs_bytes(max_num_seqs, max_blocks_per_seq), dtype=torch.uint8,
                                  device=runner.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.head_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # The head graphs' tokens, outside the graphs' pool: no other graph's replay overwrites them, so they
        # stay valid as the next step's in-flight tokens (StepInputs.keep_sampled) until a head graph replays.
        self.tokens = torch.zeros(max_num_seqs, dtype=torch.int64, device=runner.device) if sampler else None
        self.pool = None
        self._capture_all(runner)

    def bucket(self, num_seqs: int) -> int:
        return smallest_bucket(self.buckets, num_seqs)

    def to_device(self, packed: np.ndarray) -> torch.Tensor:
        """A step's packed inputs copied to the start of `inputs` (a ToDevice for to_device_packed)."""
        inputs = self.inputs[:packed.nbytes]
        inputs.copy_(pinned(packed).view(torch.uint8), non_blocking=True)
        return inputs

    @torch.inference_mode()
    def _capture_all(self, runner):
        # Largest first, so smaller graphs fit in the memory pool the largest one reserved.
        for bs in reversed(self.buckets):
            # Padding rows only, their block tables as wide as a step's will be
            rows = to_device_packed(runner.inputs.decode_rows([], bs, self.max_blocks_per_seq), self.to_device)
            meta = AttentionMetadata(is_prefill=False, slot_mapping=rows["slot_mapping"],
                                     context_lens=rows["context_lens"], block_tables=rows["block_tables"],
                                     decode_order=rows.get("decode_order"))
            args = (rows["input_ids"], rows["positions"], meta)
            self.model(*args)  # warm-up (kernel selection, autotuning) outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                self.outputs[bs] = self.model(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            if self.sampler is not None:
                self.head_graphs[bs] = self._capture_head(self.outputs[bs], rows["temperatures"], rows["seed"])
            torch.cuda.synchronize()

    def _capture_head(self, hidden: torch.Tensor, temperatures: torch.Tensor,
                      seed: torch.Tensor) -> torch.cuda.CUDAGraph:
        """A graph of lm_head over `hidden` and the temperature sampler, its tokens into self.tokens."""
        meta, tokens = SamplingMetadata(temperatures, seed), self.tokens[:len(hidden)]
        self.sampler(self.model.compute_logits(hidden), meta, out=tokens)  # warm-up (compiles) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.pool):
            self.sampler(self.model.compute_logits(hidden), meta, out=tokens)
        return graph

    def replay(self, meta: AttentionMetadata, num_seqs: int) -> torch.Tensor:
        """The hidden states [num_seqs] of a step whose inputs StepInputs.prepare_decode copied to `inputs`
        (padded to its bucket's rows)."""
        graph_bs = meta.context_lens.size(0)
        self.graphs[graph_bs].replay()
        return self.outputs[graph_bs][:num_seqs]

    def samples(self, seqs: list[Sequence]) -> bool:
        """Whether the head graphs sample the step of `seqs`: every row by its temperature alone."""
        return self.sampler is not None and only_temperature(seqs)

    def sample(self, meta: AttentionMetadata, num_seqs: int) -> torch.Tensor:
        """The tokens [num_seqs] of the step just replayed (same meta), by its bucket's head graph: a view of
        self.tokens, valid until the next head graph replays."""
        self.head_graphs[meta.context_lens.size(0)].replay()
        return self.tokens[:num_seqs]

    def release(self):
        self.graphs.clear()
        self.outputs.clear()
        self.head_graphs.clear()
        self.pool = None


class SamplerGraphs:
    """The sampler's general path (any control beyond temperature) takes some 50-100 small kernels, whose
    launches would cost the host more than the GPU's work at small batches. It runs as a CUDA graph, one
    per shape of its inputs, captured the first time that shape comes up. The rows are padded to the
    decode buckets and the other sizes rounded up (build_sampling_metadata's num_rows), so that few
    shapes recur. A temperature-only batch needs no graph: it is one kernel."""

    def __init__(self, sampler: Sampler, max_num_seqs: int):
        self.sampler = sampler
        self.buckets = batch_buckets(max_num_seqs)
        self.max_batch_size = max_num_seqs
        self.logits = None  # [max_num_seqs, vocab], allocated at the first call
        self.captured: dict[tuple, tuple[torch.cuda.CUDAGraph, SamplingMetadata, SamplerOutput]] = {}
        self.pool = None

    def applies(self, seqs: list[Sequence]) -> bool:
        """Whether a graph samples `seqs`: not for a temperature-only batch, nor one larger than the buckets."""
        return len(seqs) <= self.max_batch_size and not all(seq.only_temperature for seq in seqs)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], to_device: ToDevice,
                 inflight_tokens: InflightTokens | None = None, seed: int | None = None) -> SamplerOutput:
        """A token per sequence of a batch the graphs apply to (see build_sampling_metadata for the
        arguments), by the graph of its shape. The graph's output tensors are views of its static
        buffers, valid until its next replay."""
        num_rows, vocab_size = logits.shape
        graph_rows = smallest_bucket(self.buckets, num_rows)
        meta = build_sampling_metadata(seqs, vocab_size, to_device, inflight_tokens, num_rows=graph_rows, seed=seed)
        if self.logits is None:
            self.logits = logits.new_zeros(self.max_batch_size, vocab_size)
        key = meta.shape_key()
        if key not in self.captured:
            self.captured[key] = self._capture(meta)
        graph, static_meta, output = self.captured[key]
        self.logits[:num_rows].copy_(logits)  # the padding rows keep older logits: greedy, and dropped
        for static, tensor in zip(static_meta.tensors(), meta.tensors()):
            static.copy_(tensor)
        graph.replay()
        return output.first_rows(num_rows)

    @torch.inference_mode()
    def _capture(self, meta: SamplingMetadata) -> tuple[torch.cuda.CUDAGraph, SamplingMetadata, SamplerOutput]:
        static_meta = copy.deepcopy(meta)
        logits = self.logits[:len(meta.temperatures)]
        self.sampler(logits.clone(), static_meta)  # warm-up (compiles the kernels) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.pool):
            output = self.sampler(logits, static_meta)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, static_meta, output

    def release(self):
        self.captured.clear()
        self.logits = self.pool = None
