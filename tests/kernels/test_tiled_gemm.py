"""The tiled GEMM vs a float32 torch reference, its tile_config, and its dispatch in linear().

On CPU the Triton interpreter runs it in float16 (it multiplies bfloat16 tiles as integers), without
PDL; with CUDA, bf16 at Qwen3-0.6B's shapes against F.linear, inside a CUDA graph."""
# ruff: noqa: E402

import os

import torch

from tests.conftest import needs_cuda, needs_hopper

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch.nn.functional as F
from gemm_reference import check, make_inputs

from nanovllm.kernels.gemm import tiled as tiled_gemm
from nanovllm.kernels.gemm.skinny import SKINNY_MAX_ROWS
from nanovllm.kernels.gemm.split_k import SplitKSum, summed
from nanovllm.kernels.gemm.tiled import (
    TILED_MAX_ROWS,
    TileConfig,
    tile_config,
    tiled_applies,
    tiled_linear,
)
from nanovllm.layers import linear as linear_module

SMS = 132
QWEN3_06B_SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048),  # (N, K)
                    "gate_up": (6144, 1024), "down": (1024, 3072)}


def config(block_m, block_n, block_k, split_k, num_warps=4, num_stages=2):
    return TileConfig(block_m, block_n, block_k, split_k, num_warps, num_stages)


@pytest.mark.parametrize("M, N, K, tiles", [
    (33, 64, 128, config(64, 64, 64, 1)),  # one ragged row tile
    (100, 200, 192, config(64, 64, 64, 1)),  # ragged rows and columns (2 x 4 tiles), three K tiles
    (70, 192, 256, config(64, 128, 64, 2)),  # two splits of two K tiles
    (130, 128, 256, config(128, 64, 64, 4)),  # four splits of one K tile, two row tiles of 128
])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(M, N, K, tiles, bias):
    x, weight, b = make_inputs(M, N, K, torch.float16, bias=bias)
    if tiles.split_k > 1 and bias:
        with pytest.raises(ValueError, match="without a bias"):
            tiled_linear(x, weight, b, defer_sum=True, config=tiles)
        return
    y = tiled_linear(x, weight, b, defer_sum=True, config=tiles)
    assert isinstance(y, SplitKSum) == (tiles.split_k > 1)
    if isinstance(y, SplitKSum):
        assert y.parts.shape == (tiles.split_k, M, N) and y.parts.dtype == torch.float32
        assert y.dtype == x.dtype
    check(summed(y), x, weight, b)


def test_strided_rows_and_no_rows():
    x, weight, _ = make_inputs(40, 64, 256, torch.float16)
    wide = torch.cat([x, x], dim=1)[:, :256]  # row stride 512
    check(tiled_linear(wide, weight, config=config(64, 64, 128, 1)), x, weight, None)
    empty = tiled_linear(x[:0], weight, defer_sum=True, config=config(64, 64, 64, 2))
    assert summed(empty).shape == (0, 64)


def test_rejects_a_split_of_partial_tiles():
    x, weight, _ = make_inputs(40, 64, 192, torch.float16)
    with pytest.raises(ValueError, match="K=192 into whole 64-wide tiles"):
        tiled_linear(x, weight, defer_sum=True, config=config(64, 64, 64, 2))


def tiles(c: TileConfig) -> tuple:
    return c.block_m, c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages


@pytest.mark.parametrize("M, expected", [
    (64, {"qkv": (64, 64, 128, 2, 4, 4), "o": (64, 64, 128, 4, 4, 4),
          "gate_up": (64, 64, 128, 1, 4, 4), "down": (64, 64, 128, 4, 4, 4)}),
    (128, {"qkv": (64, 64, 128, 1, 4, 4), "o": (64, 64, 128, 4, 4, 4),
           "gate_up": (64, 128, 128, 1, 4, 3), "down": (64, 64, 128, 4, 4, 4)}),
    (256, {"qkv": (64, 128, 128, 1, 4, 3), "o": (64, 64, 128, 2, 4, 4),
           "gate_up": (128, 128, 64, 1, 8, 4), "down": (64, 64, 128, 2, 4, 4)}),
])
def test_tile_config_at_the_qwen3_shapes(M, expected):
    got = {name: tiles(tile_config(M, N, K, SMS, splittable=name != "gate_up"))
           for name, (N, K) in QWEN3_06B_SHAPES.items()}
    assert got == expected


@pytest.mark.parametrize("M", [33, 48, 80, 112, 144, 200, 256])
@pytest.mark.parametrize("N, K", [(4096, 1024), (1024, 3072), (1000, 64), (6144, 1024), (512, 192)])
def test_tile_config_is_valid(M, N, K):
    for splittable in (False, True):
        c = tile_config(M, N, K, SMS, splittable)
        programs = -(-M // c.block_m) * -(-N // c.block_n)
        assert K % (c.block_k * c.split_k) == 0 and K // c.split_k >= c.block_k
        assert c.split_k == 1 or (splittable and programs * c.split_k <= SMS
                                  and K // c.split_k >= 2 * c.block_k)
        assert c.block_k == (64 if (c.block_m, c.block_n) == (128, 128) or K % 128 else 128)
        stage_bytes = (c.block_m + c.block_n) * c.block_k * 2
        assert stage_bytes * c.num_stages <= tiled_gemm.STAGES_SMEM_BYTES


def test_not_applied_on_cpu():
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    weight = torch.randn(64, 128, dtype=torch.bfloat16)
    assert not tiled_applies(x, weight)


@needs_cuda
@pytest.mark.parametrize("name", QWEN3_06B_SHAPES)
def test_qwen3_shapes_match_cublas(name):
    N, K = QWEN3_06B_SHAPES[name]
    for M in (33, 48, 64, 100, 128, 192, 256):
        x, weight, b = make_inputs(M, N, K, torch.bfloat16, bias=name == "qkv", seed=M)
        y = tiled_linear(x, weight, b)
        torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1.6e-2, atol=1e-3)
        deferred = tiled_linear(x, weight, defer_sum=True)
        assert isinstance(deferred, SplitKSum) == (tile_config(M, N, K, SMS, True).split_k > 1)
        torch.testing.assert_close(summed(deferred), F.linear(x, weight), rtol=1.6e-2, atol=1e-3)


@needs_cuda
def test_cuda_graph_replay():
    x, weight, b = make_inputs(96, 1024, 3072, torch.bfloat16, bias=True)
    expected = tiled_linear(x, weight, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tiled_linear(x, weight, b)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(y, tiled_linear(x, weight, b), rtol=0, atol=0)
    assert not torch.equal(y, expected)


@needs_hopper
@pytest.mark.parametrize("M, uses_tiled", [(SKINNY_MAX_ROWS, False), (SKINNY_MAX_ROWS + 1, True),
                                           (TILED_MAX_ROWS, True), (TILED_MAX_ROWS + 1, False)])
def test_linear_dispatch_on_hopper(monkeypatch, M, uses_tiled):
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return tiled_linear(*args, **kwargs)

    monkeypatch.setattr(linear_module, "tiled_linear", spy)
    x, weight, b = make_inputs(M, 1024, 2048, torch.bfloat16, bias=True)
    torch.testing.assert_close(linear_module.linear(x, weight, b), F.linear(x, weight, b),
                               rtol=1.6e-2, atol=1e-3)
    assert calls == ([M] if uses_tiled else [])
    monkeypatch.setenv("NANOVLLM_PDL", "0")
    calls.clear()
    linear_module.linear(x, weight, b)
    assert calls == []  # not without PDL


@needs_hopper
def test_not_applied_to_rows_tma_cannot_address():
    """TMA needs the rows 16-byte aligned: x's first element and its row stride."""
    weight = torch.randn(256, 1024, dtype=torch.bfloat16, device="cuda")
    wide = torch.randn(64, 1032, dtype=torch.bfloat16, device="cuda")
    assert tiled_applies(wide[:, 8:], weight)  # 16 bytes in, row stride 2,064 bytes
    assert not tiled_applies(wide[:, 4:1028], weight)  # 8 bytes in
    narrow = torch.randn(64, 1028, dtype=torch.bfloat16, device="cuda")
    assert not tiled_applies(narrow[:, :1024], weight)  # row stride 2,056 bytes
