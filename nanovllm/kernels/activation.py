"""SiLU-and-mul (SwiGLU's activation) in one Triton kernel, each op rounded as torch rounds it."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.device import pdl_enabled
from nanovllm.kernels.gemm.skinny import silu_and_mul_as_torch


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Grid (M, cdiv(N, BLOCK)): out[m, n] = silu(x[m, n]) * x[m, N + n]."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * 2 * N + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * N + N + cols, mask=mask, other=0.0).to(tl.float32)
    out = silu_and_mul_as_torch(gate, up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + cols, out, mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Contiguous [..., 2 * N] (gate, up) -> [..., N] silu(gate) * up."""
    N = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    rows = x.numel() // (2 * N) if N else 0
    if rows:
        block = min(1024, triton.next_power_of_2(N))
        pdl = pdl_enabled(x.device)
        _silu_and_mul_kernel[(rows, triton.cdiv(N, block))](x, out, N, BLOCK=block, PDL=pdl,
                                                            num_warps=4, launch_pdl=pdl)
    return out
