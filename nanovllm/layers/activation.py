import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.compile import compiled_on_cuda


@compiled_on_cuda
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """[..., 2 * d] (gate, up) -> [..., d] silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
