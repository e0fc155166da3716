"""RMSNorm, computed in float32 and rounded as transformers rounds it. On CUDA one Triton kernel per
call (residual add included, and the sum of a skinny GEMM's split-K partials when given them);
elsewhere the torch ops, the reference the CPU tests compare with."""

import torch
import triton
import triton.language as tl
from torch import nn

from nanovllm.kernels.device import pdl_enabled
from nanovllm.kernels.gemm.split_k import SplitKSum, load_split_sum, on_kernel_path, split_operand, summed


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
def weighted_as_torch(h, inv_rms, weight, dtype: tl.constexpr):
    """weight * (h * inv_rms).to(dtype) in float32, as torch's rms_norm with a 16-bit weight computes it: the
    float32 product of two 16-bit values is exact, so rounding it to dtype once gives torch's result."""
    return weight.to(tl.float32) * (h * inv_rms).to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, N, eps, x_split_stride,
                     X_SPLITS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row per program: add_rms_norm (rms_norm without a residual) with the same roundings. x is
    loaded through load_split_sum (X_SPLITS, x_split_stride: skinny_gemm.split_operand)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0)  # no earlier kernel writes it: load before the wait
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = load_split_sum(x_ptr, row * N + cols, mask, x_split_stride, X_SPLITS, out_ptr.dtype.element_ty)
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(res_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * N + cols, h.to(x.dtype), mask=mask)
    inv_rms = tl.math.rsqrt(tl.sum(h * h, 0) / N + eps)
    normed = weighted_as_torch(h, inv_rms, weight, x.dtype)
    tl.store(out_ptr + row * N + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor | SplitKSum, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """rms_norm(x, weight, eps) when residual is None, else add_rms_norm(x, residual, weight, eps): one
    kernel over the rows of x [..., N] (x and residual contiguous, weight x's dtype). x may be a
    SplitKSum, summed as it is loaded."""
    assert weight.dtype == x.dtype, "the kernel rounds weight * x to x's dtype, as torch does for equal dtypes"
    data, splits, split_stride = split_operand(x)
    N = x.shape[-1]
    rows = x.shape.numel() // N
    out = torch.empty(x.shape, dtype=x.dtype, device=data.device)
    new_residual = torch.empty_like(out) if residual is not None else out
    if rows == 0:
        return out if residual is None else (out, new_residual)
    block = triton.next_power_of_2(N)
    pdl = pdl_enabled(data.device)
    # 16 warps: in decode a row's program is the chain's latency, and more warps issue its loads and sums in
    # fewer instructions each (H200, Qwen3-0.6B's 1,024 features, a step at batch 1: 93 µs at 8 warps, 108 at 4,
    # 210 at 2; single stream 1,251 tok/s at 16 warps, 1,213 at 8, 1,192 at 4; BENCHMARKS.md, twenty-second session).
    _rms_norm_kernel[(rows,)](data, residual if residual is not None else out, weight, out, new_residual, N, eps,
                              split_stride, X_SPLITS=splits, HAS_RESIDUAL=residual is not None, BLOCK=block,
                              PDL=pdl, num_warps=16, launch_pdl=pdl)
    return out if residual is None else (out, new_residual)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; with `residual`, adds it first and returns the new residual too."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor | SplitKSum, residual: torch.Tensor | None = None):
        if on_kernel_path(x) and (residual is None or residual.is_contiguous()) and self.weight.dtype == x.dtype:
            return rms_norm_triton(x, residual, self.weight, self.eps)
        x = summed(x)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
