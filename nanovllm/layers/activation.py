"""SiLU-and-mul (SwiGLU's activation): one Triton kernel on CUDA, torch elsewhere."""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.activation import silu_and_mul_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate, up) -> [..., d] silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.is_contiguous():
            return silu_and_mul_triton(x)
        return silu_and_mul(x)
