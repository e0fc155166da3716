"""RMSNorm, computed in float32 and rounded as transformers rounds it. On CUDA one Triton kernel per
call (residual add included); elsewhere the torch ops, the reference the CPU tests compare with."""

import torch
import triton
import triton.language as tl
from torch import nn

from nanovllm.utils.device import pdl_enabled


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


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, N, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row per program: add_rms_norm (rms_norm without a residual) with the same roundings."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0)  # no earlier kernel writes it: load before the wait
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(res_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * N + cols, h.to(x.dtype), mask=mask)
    inv_rms = tl.math.rsqrt(tl.sum(h * h, 0) / N + eps)
    # weight * x.to(dtype): the float32 product of two 16-bit values is exact, so one rounding is torch's
    normed = weight.to(tl.float32) * (h * inv_rms).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * N + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """rms_norm(x, weight, eps) when residual is None, else add_rms_norm(x, residual, weight, eps): one
    kernel over the rows of x [..., N] (x and residual contiguous, weight x's dtype)."""
    assert weight.dtype == x.dtype, "the kernel rounds weight * x to x's dtype, as torch does for equal dtypes"
    N = x.shape[-1]
    rows = x.numel() // N
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else x
    if rows == 0:
        return out if residual is None else (out, new_residual)
    block = triton.next_power_of_2(N)
    pdl = pdl_enabled(x.device)
    _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, new_residual, N, eps,
                              HAS_RESIDUAL=residual is not None, BLOCK=block, PDL=pdl,
                              num_warps=min(16, max(4, block // 1024)), launch_pdl=pdl)
    return out if residual is None else (out, new_residual)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; with `residual`, adds it first and returns the new residual too."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda and x.is_contiguous() and (residual is None or residual.is_contiguous()) \
                and self.weight.dtype == x.dtype:
            return rms_norm_triton(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
