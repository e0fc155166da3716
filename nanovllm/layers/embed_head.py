"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from nanovllm.kernels.device import pdl_enabled
from nanovllm.layers.linear import _copy_checked, tp_rank_and_size


@triton.jit
def _embedding_kernel(ids_ptr, weight_ptr, out_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row per program: out[row] = weight[ids[row]] (the ids checked against the vocabulary upstream)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    token = tl.load(ids_ptr + row).to(tl.int64)
    tl.store(out_ptr + row * N + cols, tl.load(weight_ptr + token * N + cols, mask=mask), mask=mask)


def embedding_triton(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding(ids, weight) for 1-D ids by one Triton kernel: torch's gather of a decode step's 8 rows took
    6.5 µs, this kernel 1.3 (H200, BENCHMARKS.md, twenty-ninth session)."""
    rows, N = ids.numel(), weight.shape[1]
    out = torch.empty(rows, N, dtype=weight.dtype, device=weight.device)
    if rows:
        pdl = pdl_enabled(weight.device)
        _embedding_kernel[(rows,)](ids, weight, out, N, BLOCK=triton.next_power_of_2(N), PDL=pdl, num_warps=4,
                                   launch_pdl=pdl)
    return out


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.num_embeddings_per_rank = num_embeddings // self.tp_size
        self.vocab_start = self.num_embeddings_per_rank * self.tp_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        size = self.num_embeddings_per_rank
        _copy_checked(param, loaded.narrow(0, self.tp_rank * size, min(size, loaded.size(0))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return embedding_triton(x, self.weight) if x.is_cuda and x.dim() == 1 else F.embedding(x, self.weight)
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
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.tp_rank == 0 else None
