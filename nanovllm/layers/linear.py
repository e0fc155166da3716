"""Linear layers, tensor-parallel in vLLM's vocabulary: column-parallel layers split the output
features across ranks, row-parallel ones the input features (then all-reduce). On CUDA, decode rows
go through the skinny GEMM, up to TILED_MAX_ROWS through the tiled GEMM, the rest through F.linear.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.attention.split_softmax import SplitSoftmax
from nanovllm.kernels.gemm.skinny import SKINNY_MAX_ROWS, skinny_linear
from nanovllm.kernels.gemm.split_k import SplitKSum, SwiGLUSplitKSum
from nanovllm.kernels.gemm.tiled import tiled_applies, tiled_linear


def tp_rank_and_size() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def skinny_applies(x: torch.Tensor) -> bool:
    """Whether the skinny GEMM takes x: [M <= SKINNY_MAX_ROWS, K] 16-bit rows on CUDA (decode)."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS and x.stride(1) == 1
            and x.dtype in (torch.bfloat16, torch.float16))


def linear(x: torch.Tensor | SplitSoftmax | SwiGLUSplitKSum, weight: torch.Tensor,
           bias: torch.Tensor | None = None, defer_sum: bool = False) -> torch.Tensor | SplitKSum:
    """F.linear(x, weight, bias) by the skinny or tiled GEMM where they apply; with defer_sum maybe
    a SplitKSum. A SplitSoftmax or SwiGLUSplitKSum x always goes to the skinny GEMM."""
    if isinstance(x, (SplitSoftmax, SwiGLUSplitKSum)) or skinny_applies(x):
        return skinny_linear(x, weight, bias, defer_sum=defer_sum)
    if tiled_applies(x, weight):
        return tiled_linear(x, weight, bias, defer_sum=defer_sum)
    return F.linear(x, weight, bias)


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor):
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: this rank expects {tuple(param.shape)}, the checkpoint "
                         f"gives {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.tp_dim = tp_dim
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _shard(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's equal slice of `loaded` along `dim`."""
        size = loaded.size(dim) // self.tp_size
        return loaded.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        if self.tp_dim is not None and param.dim() > self.tp_dim:  # a row-parallel bias isn't split
            loaded = self._shard(loaded, self.tp_dim)
        _copy_checked(param, loaded)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, tp_dim=None)

    def forward(self, x: torch.Tensor, defer_sum: bool = False) -> torch.Tensor | SplitKSum:
        return linear(x, self.weight, self.bias, defer_sum)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        _, tp_size = tp_rank_and_size()
        super().__init__(input_size, output_size // tp_size, bias, tp_dim=0)

    def forward(self, x: torch.Tensor, defer_sum: bool = False) -> torch.Tensor | SplitKSum:
        return linear(x, self.weight, self.bias, defer_sum)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (gate_proj + up_proj -> gate_up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int):
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        if loaded.size(0) != self.output_sizes[shard_id]:
            raise ValueError(f"shape mismatch for shard {shard_id}: expected "
                             f"{self.output_sizes[shard_id]} rows, checkpoint has "
                             f"{tuple(loaded.shape)}")
        _copy_checked(param.data.narrow(0, offset, size), self._shard(loaded, 0))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix, split across ranks by heads (KV heads too)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        _, tp_size = tp_rank_and_size()
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = num_kv_heads // tp_size
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str):
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        shards = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        offset, size = shards[shard_id]
        if loaded.size(0) != size * self.tp_size:
            raise ValueError(f"shape mismatch for {shard_id}_proj: expected "
                             f"{size * self.tp_size} rows, checkpoint has {tuple(loaded.shape)}")
        _copy_checked(param.data.narrow(0, offset, size), self._shard(loaded, 0))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        _, tp_size = tp_rank_and_size()
        super().__init__(input_size // tp_size, output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor | SplitSoftmax | SwiGLUSplitKSum,
                defer_sum: bool = False) -> torch.Tensor | SplitKSum:
        if self.tp_size == 1:
            return linear(x, self.weight, self.bias, defer_sum)
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None)  # the bias added once
        dist.all_reduce(y)
        return y
