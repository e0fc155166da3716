"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.embedding import embedding_triton
from nanovllm.layers.linear import _copy_checked, tp_rank_and_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.num_embeddings_per_rank = num_embeddings // self.tp_size
        self.vocab_start = self.num_embeddings_per_rank * self.tp_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        size = self.num_embeddings_per_rank
        _copy_checked(param, loaded.narrow(0, self.tp_rank * size, min(size, loaded.size(0))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            if x.is_cuda and x.dim() == 1:
                return embedding_triton(x, self.weight)
            return F.embedding(x, self.weight)
        # Tokens outside this rank's slice embed as zeros; the all-reduce fills them in.
        in_range = (x >= self.vocab_start) & (x < self.vocab_end)
        y = F.embedding(in_range * (x - self.vocab_start), self.weight) * in_range.unsqueeze(-1)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Logits [num_rows, vocab] on rank 0 (None on other ranks)."""
        logits = F.linear(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        parts = None
        if self.tp_rank == 0:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.tp_rank == 0 else None
