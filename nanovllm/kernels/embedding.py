"""Embedding lookup (a gather of weight rows) in one Triton kernel."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.device import pdl_enabled


@triton.jit
def _embedding_kernel(ids_ptr, weight_ptr, out_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row per program: out[row] = weight[ids[row]] (ids checked upstream)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    token = tl.load(ids_ptr + row).to(tl.int64)
    tl.store(out_ptr + row * N + cols, tl.load(weight_ptr + token * N + cols, mask=mask), mask=mask)


def embedding_triton(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding(ids, weight): ids [rows] -> [rows, N], faster than torch's gather in decode."""
    rows, N = ids.numel(), weight.shape[1]
    out = torch.empty(rows, N, dtype=weight.dtype, device=weight.device)
    if rows:
        pdl = pdl_enabled(weight.device)
        _embedding_kernel[(rows,)](ids, weight, out, N, BLOCK=triton.next_power_of_2(N), PDL=pdl,
                                   num_warps=4, launch_pdl=pdl)
    return out
