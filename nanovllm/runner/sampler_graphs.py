"""CUDA graphs of the sampler's general path, one per shape of its inputs."""

import copy

import torch

from nanovllm.runner.cuda_graph import batch_buckets, smallest_bucket
from nanovllm.runner.host_to_device import ToDevice
from nanovllm.runner.sampling_metadata import InflightTokens, build_sampling_metadata
from nanovllm.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata
from nanovllm.step import StepSampling

Captured = tuple[torch.cuda.CUDAGraph, SamplingMetadata, SamplerOutput]


class SamplerGraphs:
    """A graph per shape, captured at its first use; rows padded to the decode buckets."""

    def __init__(self, sampler: Sampler, max_num_seqs: int):
        self.sampler = sampler
        self.buckets = batch_buckets(max_num_seqs)
        self.max_batch_size = max_num_seqs
        self.logits = None
        self.captured: dict[tuple, Captured] = {}
        self.pool = None

    def applies(self, sampling: StepSampling) -> bool:
        """Not for a temperature-only batch (one kernel), nor one larger than the buckets, nor one
        with a grammar (its rows and masks vary every step: the sampler runs eagerly)."""
        return (len(sampling.requests) <= self.max_batch_size and sampling.uses_controls
                and not sampling.grammar_rows)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, sampling: StepSampling, to_device: ToDevice,
                 inflight_tokens: InflightTokens | None = None,
                 seed: int | None = None) -> SamplerOutput:
        """A token per row, as views of the graph's buffers, valid until its next replay."""
        num_rows, vocab_size = logits.shape
        graph_rows = smallest_bucket(self.buckets, num_rows)
        meta = build_sampling_metadata(sampling, vocab_size, to_device, inflight_tokens,
                                       num_rows=graph_rows, seed=seed)
        if self.logits is None:
            self.logits = logits.new_zeros(self.max_batch_size, vocab_size)
        key = meta.shape_key()
        if key not in self.captured:
            self.captured[key] = self._capture(meta)
        graph, static_meta, output = self.captured[key]
        self.logits[:num_rows].copy_(logits)  # padding rows keep older logits: greedy, dropped
        for static, tensor in zip(static_meta.tensors(), meta.tensors()):
            static.copy_(tensor)
        graph.replay()
        return output.first_rows(num_rows)

    @torch.inference_mode()
    def _capture(self, meta: SamplingMetadata) -> Captured:
        static_meta = copy.deepcopy(meta)
        logits = self.logits[:len(meta.temperatures)]
        self.sampler(logits.clone(), static_meta)  # compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.pool):
            output = self.sampler(logits, static_meta)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, static_meta, output

    def release(self):
        self.captured.clear()
        self.logits = self.pool = None
