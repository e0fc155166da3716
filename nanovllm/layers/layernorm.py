import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; with `residual`, adds it first and returns the new residual too."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _normalize(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        dtype = x.dtype
        if residual is None:
            return self._normalize(x.float(), dtype)
        x = x.float() + residual.float()
        residual = x.to(dtype)
        return self._normalize(x, dtype), residual
