"""CUDA graphs of the decode forward (and its temperature sampling), one per batch-size bucket."""

import dataclasses

import numpy as np
import torch

from nanovllm.kernels.gemm.skinny import SKINNY_MAX_ROWS
from nanovllm.layers.attention import AttentionMetadata
from nanovllm.runner.host_to_device import ALIGNMENT, pinned, to_device_packed
from nanovllm.sampling.sampler import Sampler, SamplingMetadata
from nanovllm.step import ScheduledStep


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, always including max_num_seqs itself."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return buckets + [max_num_seqs]


def smallest_bucket(buckets: list[int], rows: int) -> int:
    return next(b for b in buckets if b >= rows)


def decode_inputs_bytes(max_num_seqs: int, max_blocks_per_seq: int) -> int:
    """The most StepInputs.prepare_decode packs: ten arrays, each padded to ALIGNMENT."""
    # A row: 3 int64, 3 4-byte values, its block table, 2 int64 in-flight indices; then the seed.
    return max_num_seqs * (3 * 8 + 3 * 4 + 4 * max_blocks_per_seq + 2 * 8) + 8 + 10 * ALIGNMENT


class DecodeGraphs:
    """Each bucket's graph reads its inputs where the step's packed copy puts them, in `inputs`.
    With a `sampler` (rank 0 of one GPU), each bucket also has a head graph: lm_head and the
    one-pass temperature sampler, seeded like the eager one, writing `tokens`. With `verify`
    (speculation), the buckets up to SKINNY_MAX_ROWS rows also have a graph for verify steps,
    whose rows store their K/V before attending (AttentionMetadata.rows_share_sequences);
    larger buckets take that path in their one graph."""

    def __init__(self, runner, max_num_seqs: int, max_blocks_per_seq: int,
                 sampler: Sampler | None = None, verify: bool = False):
        self.model = runner.model
        self.sampler = sampler
        self.buckets = batch_buckets(max_num_seqs)
        self.max_batch_size = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.inputs = torch.zeros(decode_inputs_bytes(max_num_seqs, max_blocks_per_seq),
                                  dtype=torch.uint8, device=runner.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.head_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.verify_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.verify_outputs: dict[int, torch.Tensor] = {}
        self.verify = verify
        # Outside the graphs' pool, so that the tokens stay valid as the next step's in-flight ones.
        self.tokens = None
        if sampler:
            self.tokens = torch.zeros(max_num_seqs, dtype=torch.int64, device=runner.device)
        self.pool = None
        self._capture_all(runner)

    def bucket(self, num_seqs: int) -> int:
        return smallest_bucket(self.buckets, num_seqs)

    def to_device(self, packed: np.ndarray) -> torch.Tensor:
        inputs = self.inputs[:packed.nbytes]
        inputs.copy_(pinned(packed).view(torch.uint8), non_blocking=True)
        return inputs

    @torch.inference_mode()
    def _capture_all(self, runner):
        # Largest first, so smaller graphs fit in the memory pool the largest one reserved.
        for bs in reversed(self.buckets):
            host = runner.inputs.decode_rows(ScheduledStep(False), bs, self.max_blocks_per_seq)
            rows = to_device_packed(host, self.to_device)
            meta = AttentionMetadata(is_prefill=False, slot_mapping=rows["slot_mapping"],
                                     context_lens=rows["context_lens"],
                                     block_tables=rows["block_tables"],
                                     decode_order=rows.get("decode_order"))
            args = (rows["input_ids"], rows["positions"], meta)
            self.graphs[bs], self.outputs[bs] = self._capture(args)
            if self.sampler is not None:
                self.head_graphs[bs] = self._capture_head(self.outputs[bs], rows["temperatures"],
                                                          rows["seed"])
            if self.verify and bs <= SKINNY_MAX_ROWS:
                meta = dataclasses.replace(meta, rows_share_sequences=True)
                self.verify_graphs[bs], self.verify_outputs[bs] = self._capture(args[:2] + (meta,))
            torch.cuda.synchronize()

    def _capture(self, args: tuple) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.model(*args)  # warm-up (autotuning) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.pool):
            output = self.model(*args)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, output

    def _capture_head(self, hidden: torch.Tensor, temperatures: torch.Tensor,
                      seed: torch.Tensor) -> torch.cuda.CUDAGraph:
        meta, tokens = SamplingMetadata(temperatures, seed), self.tokens[:len(hidden)]
        self.sampler(self.model.compute_logits(hidden), meta, out=tokens)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.pool):
            self.sampler(self.model.compute_logits(hidden), meta, out=tokens)
        return graph

    def replay(self, meta: AttentionMetadata, num_seqs: int) -> torch.Tensor:
        graph_bs = meta.context_lens.size(0)
        if meta.rows_share_sequences and graph_bs in self.verify_graphs:
            self.verify_graphs[graph_bs].replay()
            return self.verify_outputs[graph_bs][:num_seqs]
        self.graphs[graph_bs].replay()
        return self.outputs[graph_bs][:num_seqs]

    def samples(self, step: ScheduledStep) -> bool:
        """Whether the head graph samples the step: on one GPU, every row by temperature alone,
        after the main graph (a verify step's graph has no head graph)."""
        return (self.sampler is not None and step.sampling.only_temperature
                and not (step.verify and self.bucket(len(step)) in self.verify_graphs))

    def sample(self, meta: AttentionMetadata, num_seqs: int) -> torch.Tensor:
        """The tokens [num_seqs] of the step just replayed: a view valid until the next sample."""
        self.head_graphs[meta.context_lens.size(0)].replay()
        return self.tokens[:num_seqs]

    def release(self):
        self.graphs.clear()
        self.outputs.clear()
        self.head_graphs.clear()
        self.verify_graphs.clear()
        self.verify_outputs.clear()
        self.pool = None
