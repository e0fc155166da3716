"""SiLU-and-mul (SwiGLU's activation): one Triton kernel on CUDA, the torch ops elsewhere."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from nanovllm.layers.skinny_gemm import (
    SplitKSum,
    load_split_sum,
    on_kernel_path,
    silu_and_mul_as_torch,
    split_operand,
)
from nanovllm.utils.device import pdl_enabled


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, N, x_split_stride, X_SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    """Grid (M, cdiv(N, BLOCK)): out[m, n] = silu(x[m, n]) * x[m, N + n], each op rounded as in torch. x is
    loaded through load_split_sum (X_SPLITS, x_split_stride: skinny_gemm.split_operand)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    gate = load_split_sum(x_ptr, row * 2 * N + cols, mask, x_split_stride, X_SPLITS, dtype)
    up = load_split_sum(x_ptr, row * 2 * N + N + cols, mask, x_split_stride, X_SPLITS, dtype)
    tl.store(out_ptr + row * N + cols, silu_and_mul_as_torch(gate.to(tl.float32), up.to(tl.float32), dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate, up) -> [..., d] silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_triton(x: torch.Tensor | SplitKSum) -> torch.Tensor:
    """silu_and_mul as one kernel, for x contiguous or a SplitKSum (summed as it is loaded)."""
    data, splits, split_stride = split_operand(x)
    N = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=data.device)
    rows = x.shape.numel() // (2 * N) if N else 0
    if rows:
        block = min(1024, triton.next_power_of_2(N))
        pdl = pdl_enabled(data.device)
        _silu_and_mul_kernel[(rows, triton.cdiv(N, block))](data, out, N, split_stride, X_SPLITS=splits, BLOCK=block,
                                                            PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


class SiluAndMul(nn.Module):
    """[..., 2 * d] (gate, up) -> [..., d] silu(gate) * up: the Triton kernel on CUDA (also for a
    SplitKSum), torch elsewhere."""

    def forward(self, x: torch.Tensor | SplitKSum) -> torch.Tensor:
        if on_kernel_path(x):
            return silu_and_mul_triton(x)
        return silu_and_mul(x)
