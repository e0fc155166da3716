"""SiLU-and-mul (SwiGLU's activation): one Triton kernel on CUDA, the torch ops elsewhere."""

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from nanovllm.layers.skinny_gemm import SplitKSum, load_operand, on_kernel_path, split_operand
from nanovllm.utils.device import pdl_enabled


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, N, x_split_stride, X_SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    """Grid (M, cdiv(N, BLOCK)): out[m, n] = silu(x[m, n]) * x[m, N + n], each op rounded as in torch. x is
    loaded through load_operand (X_SPLITS, x_split_stride: skinny_gemm.split_operand)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    out = load_operand(x_ptr, row * 2 * N + cols, mask, x_split_stride, N, X_SPLITS, True, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate, up) -> [..., d] silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_triton(x: torch.Tensor | SplitKSum) -> torch.Tensor:
    """silu_and_mul as one kernel, for x contiguous or a SplitKSum (summed as it is loaded)."""
    assert not (isinstance(x, SplitKSum) and x.silu_and_mul), "already activated"
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
    """[..., 2 * d] (gate, up) -> [..., d] silu(gate) * up: the Triton kernel on CUDA, torch elsewhere.

    A SplitKSum (a skinny gate_up GEMM's partials, decode) comes back as a SplitKSum again, with
    silu_and_mul set: the skinny GEMM that reads it next (down_proj) activates it as it loads it, so no
    kernel runs here; `.sum()` gives the tensor."""

    def forward(self, x: torch.Tensor | SplitKSum) -> torch.Tensor | SplitKSum:
        if isinstance(x, SplitKSum):
            return dataclasses.replace(x, silu_and_mul=True)
        if on_kernel_path(x):
            return silu_and_mul_triton(x)
        return silu_and_mul(x)
