"""Split-K partial sums: a GEMM's float32 partials [splits, M, N] handed on unsummed (SplitKSum), so that the
kernel that reads y next sums them as it loads (load_split_sum), or summed by _split_k_reduce_kernel."""

import dataclasses

import torch
import triton
import triton.language as tl

from nanovllm.kernels.device import pdl_enabled


@dataclasses.dataclass(frozen=True, slots=True)
class SplitKSum:
    """A skinny GEMM's output y [M, N] not yet summed: its float32 split-K partials `parts` [splits, M, N]
    (contiguous); y = their sum in split order, rounded to `dtype` (no bias). Kernels that read y sum it
    as they load (load_split_sum); other code calls `sum()`."""

    parts: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    def sum(self) -> torch.Tensor:
        splits, M, N = self.parts.shape
        y = torch.empty(M, N, dtype=self.dtype, device=self.parts.device)
        reduce_splits(self.parts, None, y)
        return y


@dataclasses.dataclass(frozen=True, slots=True)
class SwiGLUSplitKSum:
    """SwiGLU's activation silu(gate) * up [M, N] of a gate/up projection y = [gate | up] [M, 2N] not yet summed
    (`y`, its SplitKSum), each value rounded as silu_and_mul(y.sum()) rounds it. Only the skinny GEMM reads it
    (down_proj, skinny_linear): it sums and activates each tile of x as it loads it."""

    y: SplitKSum

    @property
    def shape(self) -> torch.Size:
        M, two_n = self.y.shape
        return torch.Size((M, two_n // 2))

    @property
    def dtype(self) -> torch.dtype:
        return self.y.dtype

    @property
    def device(self) -> torch.device:
        return self.y.parts.device


def on_kernel_path(x: "torch.Tensor | SplitKSum") -> bool:
    """Whether a kernel that loads through load_split_sum takes x: a SplitKSum or a contiguous CUDA tensor."""
    return isinstance(x, SplitKSum) or (x.is_cuda and x.is_contiguous())


def summed(x: "torch.Tensor | SplitKSum") -> torch.Tensor:
    """x as a tensor: a SplitKSum summed, a tensor as it is."""
    return x.sum() if isinstance(x, SplitKSum) else x


def split_operand(x: "torch.Tensor | SplitKSum") -> tuple[torch.Tensor, int, int]:
    """(tensor, splits, split stride) of a kernel operand that may be a SplitKSum; splits 0: a plain tensor."""
    if isinstance(x, SplitKSum):
        return x.parts, x.parts.shape[0], x.parts.stride(0)
    return x, 0, 0


@triton.jit
def _load(ptrs, mask):
    """tl.load of ptrs, 0 where mask is False; mask may be None (no mask)."""
    if mask is None:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def sum_splits(ptr, offs, mask, split_stride, SPLITS: tl.constexpr):
    """The float32 sum, in split order, of SPLITS partials at ptr + s * split_stride + offs."""
    acc = _load(ptr + offs, mask)
    for s in tl.static_range(1, SPLITS):
        acc += _load(ptr + s * split_stride + offs, mask)
    return acc


@triton.jit
def load_split_sum(ptr, offs, mask, split_stride, SPLITS: tl.constexpr, dtype: tl.constexpr):
    """Loads an operand that split_operand gave as (ptr, SPLITS, split_stride): with SPLITS == 0 the values
    at ptr + offs, else their SplitKSum, rounded to dtype: the values SplitKSum.sum() would hold. 0 where
    mask (None: all) is False."""
    if SPLITS == 0:
        x = _load(ptr + offs, mask)
    else:
        x = sum_splits(ptr, offs, mask, split_stride, SPLITS).to(dtype)
    return x


@triton.jit
def _split_k_reduce_kernel(part_ptr, b_ptr, y_ptr, M, N, stride_ym,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
    """Grid (M, cdiv(N, BLOCK)): y[m, n] = sum over splits of partials [SPLIT_K, M, N] (+ bias[n])."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs_n < N
    acc = sum_splits(part_ptr + m.to(tl.int64) * N, offs_n, mask, M * N, SPLIT_K)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask)


def reduce_splits(parts: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor):
    """y [M, N] (contiguous) = the sum of float32 partials [splits, M, N] (+ bias), by _split_k_reduce_kernel."""
    splits, M, N = parts.shape
    block = 1024
    pdl = pdl_enabled(y.device)
    _split_k_reduce_kernel[(M, triton.cdiv(N, block))](
        parts, bias if bias is not None else parts, y, M, N, y.stride(0),
        HAS_BIAS=bias is not None, BLOCK=block, SPLIT_K=splits, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
