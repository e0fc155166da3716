"""Decode attention split over the context: each split's partial softmax, and their merge.

A split of a (sequence, head) leaves its running max m of the logits (log2 domain), the sum l of exp2(logit - m)
and its unnormalized output acc. The head's output is the splits' acc weighted by exp2(m - max m), over the same
weighting of l. One function computes that merge (merge_splits) for every kernel that merges: the decode
kernel's last split, the merge kernel, and the skinny GEMM of o_proj, which merges decode attention's output as
it loads it (SplitSoftmax; load_merged_tile), one kernel fewer a layer in decode.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from nanovllm.kernels.device import pdl_enabled


@dataclasses.dataclass(frozen=True, slots=True)
class SplitSoftmax:
    """Decode attention's output, as o_proj's input [B, H * D], not yet merged: float32 partials of NUM_SPLITS
    splits, acc [B, H, NUM_SPLITS, D], m and l [B, H, NUM_SPLITS], contiguous; `dtype` that of the merged
    output. The skinny GEMM merges them as it loads x (skinny_linear); other code calls `merge()`."""

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
        """The merged output [B, H, D] (into out, if given)."""
        B, H, splits, D = self.acc.shape
        out = torch.empty(B, H, D, dtype=self.dtype, device=self.device) if out is None else out
        if B:
            pdl = pdl_enabled(self.device)
            # One warp a head. H200, batch 1 (then 32 splits): 1.5 against 2.1 µs a layer with 4 warps, 2.6 with 2
            # (BENCHMARKS.md, twenty-second session, when the merge summed its splits by a reduction of the block).
            _merge_kernel[(B, H)](self.acc, self.m, self.l, out, out.stride(0), out.stride(1), D=D,
                                  NUM_SPLITS=splits, PDL=pdl, num_warps=1, launch_pdl=pdl)
        return out


@triton.jit
def _load(ptrs, mask, PAST_L1: tl.constexpr):
    """tl.load of ptrs, 0 where mask is False; PAST_L1: from L2 (.cg)."""
    if PAST_L1:
        x = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def merge_splits(acc_ptr, m_ptr, l_ptr, rows, mask, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 PAST_L1: tl.constexpr):
    """[R, D] float32: the merged outputs of R (sequence, head) pairs, rows [R] the partial rows of their split 0
    (m at m_ptr + rows + split, acc at acc_ptr + (rows + split) * D). Zeros where mask [R] is False, or where no
    split saw a key (l all 0). PAST_L1: load from L2 (.cg), for partials that other programs of the same kernel
    stored."""
    m_max = _load(m_ptr + rows, mask, PAST_L1)
    for s in tl.static_range(1, NUM_SPLITS):
        m_max = tl.maximum(m_max, _load(m_ptr + rows + s, mask, PAST_L1))
    d = tl.arange(0, D)[None, :]
    w = tl.exp2(_load(m_ptr + rows, mask, PAST_L1) - m_max)  # the largest weight is 1
    denom = w * _load(l_ptr + rows, mask, PAST_L1)
    acc = w[:, None] * _load(acc_ptr + rows[:, None] * D + d, mask[:, None], PAST_L1)
    for s in tl.static_range(1, NUM_SPLITS):
        w = tl.exp2(_load(m_ptr + rows + s, mask, PAST_L1) - m_max)
        denom += w * _load(l_ptr + rows + s, mask, PAST_L1)
        acc += w[:, None] * _load(acc_ptr + (rows + s)[:, None] * D + d, mask[:, None], PAST_L1)
    return acc / tl.where(denom == 0.0, 1.0, denom)[:, None]


@triton.jit
def load_merged_tile(acc_ptr, m_ptr, l_ptr, M, k, H, D: tl.constexpr, NUM_SPLITS: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """x[:ROWS, k:k + BLOCK_K] of a SplitSoftmax's x [M, H * D] (k a multiple of BLOCK_K, itself of D), merged
    and rounded to dtype as merge() would store it; 0 in rows >= M and past the last head."""
    HEADS: tl.constexpr = BLOCK_K // D
    r = tl.arange(0, ROWS * HEADS)  # (row, head) pairs of the tile, row-major
    row = r // HEADS
    head = k // D + r % HEADS
    merged = merge_splits(acc_ptr, m_ptr, l_ptr, (row * H + head) * NUM_SPLITS, (row < M) & (head < H), D,
                          NUM_SPLITS, False)
    return tl.reshape(merged.to(dtype), [ROWS, BLOCK_K])


@triton.jit
def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, stride_ob, stride_oh, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  PDL: tl.constexpr):
    """Grid (B, H): out[seq, head] = the merge of that (sequence, head)'s NUM_SPLITS partials."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    one = tl.arange(0, 1)
    merged = merge_splits(acc_ptr, m_ptr, l_ptr, (seq * tl.num_programs(1) + head) * NUM_SPLITS + one, one == 0, D,
                          NUM_SPLITS, False)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + tl.arange(0, D)[None, :],
             merged.to(out_ptr.dtype.element_ty))
