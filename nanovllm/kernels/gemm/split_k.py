"""Split-K partials [splits, M, N] of a GEMM's y: summed by reduce_splits, or handed on unsummed
(SplitKSum) to the next kernel, which sums them in split order as it loads y (load_split_sum)."""

import dataclasses

import torch
import triton
import triton.language as tl

from nanovllm.kernels.device import pdl_enabled


@dataclasses.dataclass(frozen=True, slots=True)
class SplitKSum:
    """y [M, N] = parts [splits, M, N] (float32, contiguous) summed in split order, as dtype."""

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
    """silu_and_mul(y.sum()) [M, N] of a gate/up projection's y [M, 2N], for skinny_linear."""

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
    """Whether kernels loading through load_split_sum take x: a SplitKSum or contiguous on CUDA."""
    return isinstance(x, SplitKSum) or (x.is_cuda and x.is_contiguous())


def summed(x: "torch.Tensor | SplitKSum") -> torch.Tensor:
    return x.sum() if isinstance(x, SplitKSum) else x


def split_operand(x: "torch.Tensor | SplitKSum") -> tuple[torch.Tensor, int, int]:
    """(tensor, splits, split stride) of an operand that may be a SplitKSum; 0 splits: a tensor."""
    if isinstance(x, SplitKSum):
        return x.parts, x.parts.shape[0], x.parts.stride(0)
    return x, 0, 0


@triton.jit
def _load(ptrs, mask):
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
    """An operand from split_operand at ptr + offs: loaded, or its SplitKSum summed to dtype; 0
    where mask (None: no mask) is False."""
    if SPLITS == 0:
        x = _load(ptr + offs, mask)
    else:
        x = sum_splits(ptr, offs, mask, split_stride, SPLITS).to(dtype)
    return x


@triton.jit
def _split_k_reduce_kernel(part_ptr, b_ptr, y_ptr, M, N, stride_ym, HAS_BIAS: tl.constexpr,
                           BLOCK: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
    """Grid (M, cdiv(N, BLOCK)): y[m, n] = sum of partials [SPLIT_K, M, N] (+ bias[n])."""
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
    """y [M, N] (contiguous) = the sum of float32 partials [splits, M, N] (+ bias)."""
    splits, M, N = parts.shape
    block = 1024
    pdl = pdl_enabled(y.device)
    _split_k_reduce_kernel[(M, triton.cdiv(N, block))](
        parts, bias if bias is not None else parts, y, M, N, y.stride(0),
        HAS_BIAS=bias is not None, BLOCK=block, SPLIT_K=splits, PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )
