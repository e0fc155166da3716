"""CUDA graphs of the sampler's general path, one per shape of its inputs."""

import copy

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.runner.cuda_graph import batch_buckets, smallest_bucket
from nanovllm.runner.host_to_device import ToDevice
from nanovllm.sampling.metadata import InflightTokens, build_sampling_metadata
from nanovllm.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata


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
