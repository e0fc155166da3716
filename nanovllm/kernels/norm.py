"""RMSNorm in one Triton kernel per call (residual add and split-K partial sum included)."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.device import pdl_enabled
from nanovllm.kernels.gemm.split_k import SplitKSum, load_split_sum, split_operand


@triton.jit
def weighted_as_torch(h, inv_rms, weight, dtype: tl.constexpr):
    """torch's weight * (h * inv_rms).to(dtype) for 16-bit weights: the float32 product is exact."""
    return weight.to(tl.float32) * (h * inv_rms).to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, N, eps, x_split_stride,
                     X_SPLITS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0)  # no earlier kernel writes it
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = load_split_sum(x_ptr, row * N + cols, mask, x_split_stride, X_SPLITS,
                       out_ptr.dtype.element_ty)
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(res_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * N + cols, h.to(x.dtype), mask=mask)
    inv_rms = tl.math.rsqrt(tl.sum(h * h, 0) / N + eps)
    normed = weighted_as_torch(h, inv_rms, weight, x.dtype)
    tl.store(out_ptr + row * N + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor | SplitKSum, residual: torch.Tensor | None,
                    weight: torch.Tensor, eps: float):
    """rms_norm, or add_rms_norm given a residual, of contiguous x [..., N] or a SplitKSum."""
    assert weight.dtype == x.dtype, "the kernel rounds weight * x to x's dtype, as torch does"
    data, splits, split_stride = split_operand(x)
    N = x.shape[-1]
    rows = x.shape.numel() // N
    out = torch.empty(x.shape, dtype=x.dtype, device=data.device)
    new_residual = torch.empty_like(out) if residual is not None else out
    if rows == 0:
        return out if residual is None else (out, new_residual)
    pdl = pdl_enabled(data.device)
    # 16 warps: a decode step's row is on its critical path (docs/kernels.md)
    _rms_norm_kernel[(rows,)](data, residual if residual is not None else out, weight, out,
                              new_residual, N, eps, split_stride, X_SPLITS=splits,
                              HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(N),
                              PDL=pdl, num_warps=16, launch_pdl=pdl)
    return out if residual is None else (out, new_residual)
