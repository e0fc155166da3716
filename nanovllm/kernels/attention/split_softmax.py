"""Decode attention's splits each leave a max logit m (log2 units), sum l of exp2(logit - m) and
output acc; merge_splits weighs them by exp2(m - max m) (in decode, _merge_kernel, or o_proj)."""

import dataclasses

import torch
import triton
import triton.language as tl

from nanovllm.kernels.device import pdl_enabled


@dataclasses.dataclass(frozen=True, slots=True)
class SplitSoftmax:
    """Decode attention's output as o_proj's input [B, H * D], not merged: float32 partials acc
    [B, H, splits, D], m and l [B, H, splits]; `dtype` that of the merged output."""

    acc: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 (the softmax's l, as in the kernels)
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        B, H, _, D = self.acc.shape
        return torch.Size((B, H * D))

    @property
    def device(self) -> torch.device:
        return self.acc.device

    def merge(self, out: torch.Tensor | None = None) -> torch.Tensor:
        B, H, splits, D = self.acc.shape
        out = torch.empty(B, H, D, dtype=self.dtype, device=self.device) if out is None else out
        if B:
            pdl = pdl_enabled(self.device)
            _merge_kernel[(B, H)](self.acc, self.m, self.l, out, out.stride(0), out.stride(1), D=D,
                                  NUM_SPLITS=splits, PDL=pdl, num_warps=1, launch_pdl=pdl)
        return out


@triton.jit
def _load(ptrs, mask, PAST_L1: tl.constexpr):
    if PAST_L1:
        x = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def merge_splits(acc_ptr, m_ptr, l_ptr, rows, mask, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 PAST_L1: tl.constexpr):
    """[R, D]: the merged outputs of the R pairs whose split-0 partial rows are `rows` (0 where
    mask is False or no split saw a key). PAST_L1: load from L2, as other programs stored them."""
    m_max = _load(m_ptr + rows, mask, PAST_L1)
    for s in tl.static_range(1, NUM_SPLITS):
        m_max = tl.maximum(m_max, _load(m_ptr + rows + s, mask, PAST_L1))
    d = tl.arange(0, D)[None, :]
    w = tl.exp2(_load(m_ptr + rows, mask, PAST_L1) - m_max)
    denom = w * _load(l_ptr + rows, mask, PAST_L1)
    acc = w[:, None] * _load(acc_ptr + rows[:, None] * D + d, mask[:, None], PAST_L1)
    for s in tl.static_range(1, NUM_SPLITS):
        w = tl.exp2(_load(m_ptr + rows + s, mask, PAST_L1) - m_max)
        denom += w * _load(l_ptr + rows + s, mask, PAST_L1)
        acc += w[:, None] * _load(acc_ptr + (rows + s)[:, None] * D + d, mask[:, None], PAST_L1)
    return acc / tl.where(denom == 0.0, 1.0, denom)[:, None]


@triton.jit
def load_merged_tile(acc_ptr, m_ptr, l_ptr, M, k, H, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """x[:ROWS, k:k + BLOCK_K] of a SplitSoftmax's x [M, H * D] as merge() stores it (0 past)."""
    HEADS: tl.constexpr = BLOCK_K // D
    r = tl.arange(0, ROWS * HEADS)
    row = r // HEADS
    head = k // D + r % HEADS
    merged = merge_splits(acc_ptr, m_ptr, l_ptr, (row * H + head) * NUM_SPLITS,
                          (row < M) & (head < H), D, NUM_SPLITS, False)
    return tl.reshape(merged.to(dtype), [ROWS, BLOCK_K])


@triton.jit
def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, stride_ob, stride_oh, D: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, PDL: tl.constexpr):
    """Grid (B, H): out[seq, head] = the merge of that pair's NUM_SPLITS partials."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    one = tl.arange(0, 1)
    merged = merge_splits(acc_ptr, m_ptr, l_ptr,
                          (seq * tl.num_programs(1) + head) * NUM_SPLITS + one, one == 0, D,
                          NUM_SPLITS, False)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + tl.arange(0, D)[None, :],
             merged.to(out_ptr.dtype.element_ty))
