"""The structured-outputs mask kernel against the torch reference (Triton's interpreter on CPU):
-inf exactly at the listed rows' forbidden tokens, the other rows untouched."""

import pytest
import torch

from nanovllm.kernels.token_bitmask import apply_token_bitmask_triton
from nanovllm.sampling.logits_processor import apply_token_bitmask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("vocab", [32, 320, 2500])  # 2500: a ragged last word and block
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen).to(DEVICE, dtype)
    rows = torch.tensor([3, 0], device=DEVICE)
    allowed = torch.rand(2, vocab, generator=gen) < 0.3
    words = -(-vocab // 32)
    bits = torch.zeros(2, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    packed = (bits.view(2, words, 32) * weights).sum(-1)
    bitmask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).to(DEVICE)
    expected = apply_token_bitmask(logits.clone(), rows, bitmask)
    got = apply_token_bitmask_triton(logits.clone(), rows, bitmask)
    assert torch.equal(got, expected)
    for i, row in enumerate(rows.tolist()):
        assert torch.equal(torch.isinf(expected[row]).cpu(), ~allowed[i])
    for row in (1, 2, 4):
        assert torch.equal(expected[row], logits[row])


def test_no_rows_is_a_no_op():
    logits = torch.randn(2, 64, device=DEVICE)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    out = apply_token_bitmask_triton(logits.clone(), empty,
                                     torch.empty(0, 2, dtype=torch.int32, device=DEVICE))
    assert torch.equal(out, logits)
