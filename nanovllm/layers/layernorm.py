"""RMSNorm in float32, rounded as transformers rounds it: one Triton kernel on CUDA, torch elsewhere
(the reference the CPU tests compare with)."""

import torch
from torch import nn

from nanovllm.kernels.gemm.split_k import SplitKSum, on_kernel_path, summed
from nanovllm.kernels.norm import rms_norm_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    dtype = x.dtype
    x = x.float() + residual.float()
    residual = x.to(dtype)
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x.to(dtype), residual


class RMSNorm(nn.Module):
    """With `residual`, adds it first and returns the new residual too."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor | SplitKSum, residual: torch.Tensor | None = None):
        contiguous = residual is None or residual.is_contiguous()
        if on_kernel_path(x) and contiguous and self.weight.dtype == x.dtype:
            return rms_norm_triton(x, residual, self.weight, self.eps)
        x = summed(x)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
