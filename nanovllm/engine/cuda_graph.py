"""CUDA graphs of the decode forward, one per batch-size bucket, and of the sampler's general path,
replayed from static buffers."""

import copy

import torch

from nanovllm.engine.host_to_device import ToDevice
from nanovllm.engine.sampling_metadata import InflightTokens, build_sampling_metadata
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.attention import AttentionMetadata
from nanovllm.layers.sampler import Sampler, SamplerOutput, SamplingMetadata


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, always including max_num_seqs itself."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return buckets + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, max_blocks_per_seq: int):
        self.model = runner.model
        self.buckets = batch_buckets(max_num_seqs)
        self.max_batch_size = max_num_seqs
        device = runner.device
        n = max_num_seqs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        # The Triton backend's decode order (AttentionMetadata.decode_order); padding rows keep their own place.
        self.rows = torch.arange(n, dtype=torch.int32, device=device)
        self.decode_order = self.rows.clone() if runner.config.attention_backend == "triton" else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self._capture_all()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(is_prefill=False, slot_mapping=self.slot_mapping[:bs],
                                 context_lens=self.context_lens[:bs], block_tables=self.block_tables[:bs],
                                 decode_order=None if self.decode_order is None else self.decode_order[:bs])

    @torch.inference_mode()
    def _capture_all(self):
        # Largest first, so smaller graphs fit in the memory pool the largest one reserved.
        for bs in reversed(self.buckets):
            args = (self.input_ids[:bs], self.positions[:bs], self._meta(bs))
            self.model(*args)  # warm-up (kernel selection, autotuning) outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                self.outputs[bs] = self.model(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        bs = input_ids.size(0)
        graph_bs = next(b for b in self.buckets if b >= bs)
        self.input_ids[:bs] = input_ids
        self.positions[:bs] = positions
        self.slot_mapping[:bs] = meta.slot_mapping
        self.slot_mapping[bs:graph_bs] = -1  # padding rows write nothing to the cache...
        self.context_lens[:bs] = meta.context_lens
        self.context_lens[bs:graph_bs] = 0  # ...and read nothing from it
        self.block_tables[:bs, :meta.block_tables.size(1)] = meta.block_tables
        if self.decode_order is not None:
            self.decode_order[:bs] = meta.decode_order
            self.decode_order[bs:graph_bs] = self.rows[bs:graph_bs]
        self.graphs[graph_bs].replay()
        return self.outputs[graph_bs][:bs]

    def release(self):
        self.graphs.clear()
        self.outputs.clear()
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

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], to_device: ToDevice,
                 inflight_tokens: InflightTokens | None = None) -> SamplerOutput:
        """A token per sequence (see build_sampling_metadata for the arguments): eagerly for a
        temperature-only batch or one larger than the buckets, else by the graph of its shape. The
        graph's output tensors are views of its static buffers, valid until its next replay."""
        num_rows, vocab_size = logits.shape
        if num_rows > self.max_batch_size or all(seq.only_temperature for seq in seqs):
            return self.sampler(logits, build_sampling_metadata(seqs, vocab_size, to_device, inflight_tokens))
        graph_rows = next(b for b in self.buckets if b >= num_rows)
        meta = build_sampling_metadata(seqs, vocab_size, to_device, inflight_tokens, num_rows=graph_rows)
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
