"""The RMSNorm, SiLU-and-mul and embedding kernels against the torch ops (the CPU reference), under
Triton's interpreter on CPU. Up to one ulp apart, rarely: the norm's float32 sum of squares is
reduced in another order (the new residual is exact), the kernel's exp is not torch's."""

import dataclasses

import pytest
import torch

from nanovllm.kernels.activation import silu_and_mul_triton
from nanovllm.kernels.embedding import embedding_triton
from nanovllm.kernels.gemm.split_k import SplitKSum, summed
from nanovllm.kernels.norm import rms_norm_triton
from nanovllm.layers.activation import SiluAndMul, silu_and_mul
from nanovllm.layers.layernorm import RMSNorm, add_rms_norm, rms_norm
from tests.conftest import needs_cuda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the 16-bit spacing at b (so 1 = one rounding step)."""
    spacing = torch.finfo(b.dtype).eps * b.float().abs().clamp(min=torch.finfo(b.dtype).tiny)
    return (a.float() - b.float()).abs() / spacing


def inputs(rows, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, residual = (3 * torch.randn(2, rows, n, generator=gen)).to(DEVICE, dtype)
    weight = (0.5 + torch.rand(n, generator=gen)).to(DEVICE, dtype)
    return x, residual, weight


@pytest.mark.parametrize("rows, n", [(1, 64), (5, 1000), (3, 1024)])  # n not a power of two: masked
def test_rms_norm_matches_torch(rows, n):
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    x, residual, weight = inputs(rows, n, dtype)
    out, new_residual = rms_norm_triton(x, residual, weight, 1e-6)
    expected, expected_residual = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, expected_residual)
    assert ulps_apart(out, expected).max() <= 1
    assert (out != expected).float().mean() <= 0.01
    alone = rms_norm_triton(x, None, weight, 1e-6)
    assert alone.shape == x.shape and ulps_apart(alone, rms_norm(x, weight, 1e-6)).max() <= 1


def test_rms_norm_three_dims_and_no_rows():
    x, residual, weight = inputs(6, 32, torch.float16)
    out, new_residual = rms_norm_triton(x.view(2, 3, 32), residual.view(2, 3, 32), weight, 1e-6)
    expected, expected_residual = add_rms_norm(x, residual, weight, 1e-6)
    assert out.shape == (2, 3, 32) and torch.equal(new_residual.view(6, 32), expected_residual)
    assert ulps_apart(out.view(6, 32), expected).max() <= 1
    empty = x[:0]
    assert rms_norm_triton(empty, None, weight, 1e-6).shape == (0, 32)


@pytest.mark.parametrize("rows, n", [(1, 64), (4, 1500), (2, 3072)])  # 1500: a ragged second block
def test_silu_and_mul_matches_torch(rows, n):
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(rows)
    x = (4 * torch.randn(rows, 2 * n, generator=gen)).to(DEVICE, dtype)
    out = silu_and_mul_triton(x)
    expected = silu_and_mul(x)
    assert out.shape == (rows, n) and ulps_apart(out, expected).max() <= 1
    assert (out != expected).float().mean() <= 0.01


@pytest.mark.parametrize("splits", [1, 4])
def test_norm_sums_split_k_partials(splits):
    """Given split-K partials the norm kernel returns exactly what it does given their sum;
    RMSNorm's torch path (another weight dtype) sums them first."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(splits)
    partial = SplitKSum(torch.randn(splits, 3, 1000, generator=gen).to(DEVICE), dtype)
    x = partial.sum()
    _, residual, weight = inputs(3, 1000, dtype)
    assert all(map(torch.equal, rms_norm_triton(partial, residual, weight, 1e-6),
                   rms_norm_triton(x, residual, weight, 1e-6)))
    assert torch.equal(rms_norm_triton(partial, None, weight, 1e-6),
                       rms_norm_triton(x, None, weight, 1e-6))
    norm = RMSNorm(1000).to(DEVICE)  # float32 weight: not the kernel's case
    expected = add_rms_norm(x, residual, norm.weight, norm.eps)
    assert all(map(torch.equal, norm(partial, residual), expected))


def test_modules_use_torch_on_cpu():
    """On CPU the modules run the torch reference, which the CPU tests compare with transformers."""
    x, residual, weight = inputs(3, 64, torch.float32, seed=1)
    x, residual = x.cpu(), residual.cpu()
    norm = RMSNorm(64)
    norm.weight.data.copy_(weight.cpu())
    assert torch.equal(norm(x, residual)[0], add_rms_norm(x, residual, norm.weight, norm.eps)[0])
    gate_up = torch.cat([x, residual], -1)
    assert torch.equal(SiluAndMul()(gate_up), silu_and_mul(gate_up))


@needs_cuda
def test_modules_use_the_kernels_on_cuda(monkeypatch):
    from nanovllm.layers import activation, layernorm

    calls = []  # patched where the modules look the kernels up
    monkeypatch.setattr(layernorm, "rms_norm_triton",
                        lambda *a: calls.append("norm") or rms_norm(a[0], a[2], a[3]))
    monkeypatch.setattr(activation, "silu_and_mul_triton",
                        lambda x: calls.append("silu") or silu_and_mul(x))
    x, _, weight = inputs(2, 64, torch.bfloat16)
    norm = RMSNorm(64).to(DEVICE, torch.bfloat16)
    norm(x)
    SiluAndMul()(x)
    assert calls == ["norm", "silu"]


@needs_cuda
@pytest.mark.parametrize("rows", [4, 8, 16])  # 16: the fused SwiGLU kernel, 512-wide down tiles
def test_programmatic_dependent_launch_changes_no_result(monkeypatch, rows):
    """A decode layer's MLP chain replayed from a CUDA graph gives the same bits with PDL as
    without, both as separate kernels and as the engine chains them (split-K partials passed on,
    activated or summed by the next kernel). Both runs use the GEMMs' PDL launch configuration."""
    from nanovllm.kernels.device import num_sms
    from nanovllm.kernels.gemm.skinny import (
        DEFERRED_ACTIVATION_MAX_ROWS,
        launch_config,
        skinny_linear,
        skinny_swiglu,
    )
    from nanovllm.kernels.gemm.split_k import SwiGLUSplitKSum

    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(2, rows, 1024, generator=gen)).to(DEVICE, torch.bfloat16)
    gate_up_w = (torch.randn(6144, 1024, generator=gen) / 32).to(DEVICE, torch.bfloat16)
    down_w = (torch.randn(1024, 3072, generator=gen) / 55).to(DEVICE, torch.bfloat16)
    norm = RMSNorm(1024).to(DEVICE, torch.bfloat16)

    def linear(x, weight, defer_sum=False):
        config = launch_config(*weight.shape, num_sms(weight.device), pdl=True, rows=x.shape[0])
        return skinny_linear(x, weight, defer_sum=defer_sum, **dataclasses.asdict(config))

    def layers(as_engine: bool):
        h, res = x, residual
        for _ in range(8):
            normed, res = norm(h, res)
            if as_engine and rows <= DEFERRED_ACTIVATION_MAX_ROWS:
                act = SwiGLUSplitKSum(linear(normed, gate_up_w, defer_sum=True))
            elif as_engine:
                act = skinny_swiglu(normed, gate_up_w)
            else:
                act = silu_and_mul_triton(linear(normed, gate_up_w))
            h = linear(act, down_w, defer_sum=as_engine)
        return summed(h), res

    for as_engine in (False, True):
        results = {}
        for pdl in ("0", "1"):
            monkeypatch.setenv("NANOVLLM_PDL", pdl)
            layers(as_engine)  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = layers(as_engine)
            graph.replay()
            torch.cuda.synchronize()
            results[pdl] = [t.clone() for t in out]
        assert all(map(torch.equal, results["0"], results["1"])), f"as the engine: {as_engine}"


@pytest.mark.parametrize("rows, n", [(0, 64), (1, 64), (7, 1000), (300, 1024)])
def test_embedding_gathers_the_rows_of_the_ids(rows, n):
    gen = torch.Generator().manual_seed(rows)
    vocab = 500
    weight = torch.randn(vocab, n, generator=gen).to(DEVICE, torch.bfloat16)
    ids = torch.randint(vocab, (rows,), generator=gen).to(DEVICE)
    ids[:2] = torch.tensor([vocab - 1, 0])[:rows]  # the table's last and first rows
    assert torch.equal(embedding_triton(ids, weight), torch.nn.functional.embedding(ids, weight))
