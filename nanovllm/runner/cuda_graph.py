"""CUDA graphs of the decode forward, one per batch-size bucket (and of its temperature sampling),
replayed from static buffers."""


import numpy as np
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.attention import AttentionMetadata
from nanovllm.runner.host_to_device import ALIGNMENT, pinned, to_device_packed
from nanovllm.sampling.metadata import only_temperature
from nanovllm.sampling.sampler import Sampler, SamplingMetadata


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
