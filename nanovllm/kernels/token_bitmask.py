"""Structured outputs' token masks on the logits: -inf where a row's grammar forbids the token."""

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program


@triton.jit
def _apply_bitmask_kernel(logits_ptr, logits_stride, rows_ptr, bitmask_ptr, bitmask_stride,
                          vocab_size, BLOCK: tl.constexpr):
    """Program (i, block): logits row rows[i], columns of the block; bit c of bitmask row i clear
    (word c // 32, bit c % 32) -> logit c = -inf."""
    i, block = tl.program_id(0), tl.program_id(1)
    row = tl.load(rows_ptr + i)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab_size
    words = tl.load(bitmask_ptr + i * bitmask_stride + cols // 32, mask=in_vocab, other=-1)
    forbidden = ((words >> (cols % 32)) & 1) == 0
    ptrs = logits_ptr + row.to(tl.int64) * logits_stride + cols
    tl.store(ptrs, tl.full([BLOCK], -float("inf"), logits_ptr.dtype.element_ty),
             mask=in_vocab & forbidden)


def apply_token_bitmask_triton(logits: torch.Tensor, rows: torch.Tensor,
                               bitmask: torch.Tensor) -> torch.Tensor:
    """In place: logits [n, vocab] (rows contiguous), rows [g] int64 indices into them, bitmask
    [g, ceil(vocab / 32)] int32 (1 = allowed); rows not listed are not read. Returns logits."""
    vocab_size = logits.shape[1]
    assert logits.stride(1) == 1 and bitmask.is_contiguous()
    if rows.numel():
        grid = (rows.numel(), triton.cdiv(vocab_size, BLOCK))
        _apply_bitmask_kernel[grid](logits, logits.stride(0), rows, bitmask, bitmask.stride(0),
                                    vocab_size, BLOCK=BLOCK)
    return logits
