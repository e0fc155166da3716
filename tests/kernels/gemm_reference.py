"""The float32 reference the GEMM tests compare their kernels with."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(M, N, K, dtype, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(N, K, generator=gen) / K ** 0.5).to(DEVICE, dtype)
    b = torch.randn(N, generator=gen).to(DEVICE, dtype) if bias else None
    return x, weight, b


def reference(x, weight, bias):
    y = x.float() @ weight.float().T
    return y if bias is None else y + bias.float()


def check(y, x, weight, bias):
    """y is the reference up to its rounding to 16 bits and the float32 summation order."""
    assert y.shape == (x.shape[0], weight.shape[0]) and y.dtype == x.dtype
    torch.testing.assert_close(y.float(), reference(x, weight, bias), rtol=2e-3, atol=2e-3)
