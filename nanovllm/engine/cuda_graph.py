"""CUDA graphs of the decode forward, one per batch-size bucket, replayed from static buffers."""

import torch

from nanovllm.layers.attention import AttentionMetadata


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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self._capture_all()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(is_prefill=False, slot_mapping=self.slot_mapping[:bs],
                                 context_lens=self.context_lens[:bs], block_tables=self.block_tables[:bs])

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
        self.graphs[graph_bs].replay()
        return self.outputs[graph_bs][:bs]

    def release(self):
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
