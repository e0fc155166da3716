"""The skinny GEMM vs a float32 torch reference, and its dispatch in linear().

On CPU the Triton interpreter runs it in float16 (it multiplies bfloat16 tiles as integers); with
CUDA, bf16 at Qwen3-0.6B's shapes against F.linear, inside a CUDA graph."""
# ruff: noqa: E402

import dataclasses
import os
from types import SimpleNamespace

import torch

from tests.conftest import needs_cuda

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch.distributed as dist
import torch.nn.functional as F
from gemm_reference import DEVICE, check, make_inputs, reference

from nanovllm.kernels.activation import silu_and_mul_triton
from nanovllm.kernels.attention.split_softmax import SplitSoftmax
from nanovllm.kernels.gemm import skinny as skinny_gemm
from nanovllm.kernels.gemm.skinny import (
    MAX_ONE_TILE_PARTIALS,
    ONE_TILE_K,
    SKINNY_MAX_ROWS,
    WIDE_TILE_MIN_ROWS,
    LaunchConfig,
    gated_launch_config,
    launch_config,
    skinny_linear,
    skinny_swiglu,
)
from nanovllm.kernels.gemm.split_k import SplitKSum, SwiGLUSplitKSum, summed
from nanovllm.kernels.gemm.tiled import tiled_applies
from nanovllm.layers import linear as linear_module
from nanovllm.models import decoder

QWEN3_06B_SHAPES = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048),  # (N, K)
                    "gate_up_proj": (6144, 1024), "down_proj": (1024, 3072)}


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("N, K", [(64, 128), (100, 200), (48, 40)])  # even, ragged, K < BLOCK_K
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split_k", [1, 3])
def test_matches_reference(M, N, K, bias, split_k):
    x, weight, b = make_inputs(M, N, K, torch.float16, bias)
    check(skinny_linear(x, weight, b, block_n=32, block_k=64, split_k=split_k), x, weight, b)


@pytest.mark.parametrize("split_k", [2, 8])  # 8 > K tiles: the empty splits are dropped
def test_split_k_ragged_tail(split_k):
    x, weight, b = make_inputs(5, 40, 200, torch.float16, bias=True)
    check(skinny_linear(x, weight, b, block_n=16, block_k=32, split_k=split_k), x, weight, b)


def test_default_config_splits_k():
    M, N, K = 2, 64, 1024
    assert launch_config(N, K, sms=132).split_k > 1
    x, weight, b = make_inputs(M, N, K, torch.float16, bias=True)
    check(skinny_linear(x, weight, b), x, weight, b)


def test_strided_rows():
    """x every other row of a wider buffer, from an odd column (unaligned pointer)."""
    K = 72
    base, weight, b = make_inputs(2 * 7, 80, K + 5, torch.float16, bias=True)
    x = base[::2, 3:3 + K]
    weight = weight[:, :K].contiguous()
    assert x.stride(0) != K
    check(skinny_linear(x, weight, b, block_n=32, block_k=32, split_k=1), x, weight, b)
    check(skinny_linear(x, weight, b, block_n=32, block_k=32, split_k=2), x, weight, b)


@pytest.mark.parametrize("bias, split_k", [(False, 3), (True, 3), (False, 1)])
def test_defer_sum(bias, split_k):
    """defer_sum leaves split-K partials (no bias, K split) whose sum() is exactly the reduced y."""
    x, weight, b = make_inputs(5, 100, 192, torch.float16, bias)
    config = dict(block_n=32, block_k=64, split_k=split_k)
    out = skinny_linear(x, weight, b, defer_sum=True, **config)
    expected = skinny_linear(x, weight, b, **config)
    if bias or split_k == 1:
        assert isinstance(out, torch.Tensor) and torch.equal(out, expected)
    else:
        assert isinstance(out, SplitKSum) and out.parts.shape == (3, 5, 100)
        assert out.parts.dtype == torch.float32
        assert out.shape == (5, 100) and out.dtype == torch.float16
        assert torch.equal(out.sum(), expected)


def test_no_rows():
    x, weight, _ = make_inputs(0, 32, 64, torch.float16)
    assert skinny_linear(x, weight).shape == (0, 32)


@pytest.mark.parametrize("N, K", [*QWEN3_06B_SHAPES.values(), (6144, 4096), (4096, 4096),
                                  (24576, 4096), (4096, 12288), (64, 40)])
def test_launch_config_is_valid(N, K):
    config = launch_config(N, K, sms=132)
    for block in (config.block_n, config.block_k):
        assert block >= 16 and block & (block - 1) == 0
    assert 1 <= config.split_k and config.split_k * config.block_k <= max(K, config.block_k)
    assert config.num_warps in (1, 2, 4, 8, 16) and config.num_stages >= 1
    # With PDL: one stage fewer, or narrow splits made one ONE_TILE_K tile a program (<= 2x splits).
    with_pdl = launch_config(N, K, sms=132, pdl=True)
    if with_pdl.block_k == ONE_TILE_K and with_pdl.num_stages == 1:
        assert with_pdl.split_k * ONE_TILE_K == K
        assert config.split_k < with_pdl.split_k * 2 <= 4 * config.split_k
        unsplit = dataclasses.replace(with_pdl, block_k=config.block_k, split_k=config.split_k,
                                      num_stages=4)
        assert unsplit == config
    else:
        assert with_pdl == dataclasses.replace(config, num_stages=config.num_stages - 1)


def test_launch_config_at_the_qwen3_shapes():
    """With PDL one 64 x 256 weight tile a program; without PDL, or wide, the pipelined loop."""
    one_tile = {name: launch_config(N, K, sms=132, pdl=True)
                for name, (N, K) in QWEN3_06B_SHAPES.items()}
    assert {name: (c.block_k, c.split_k, c.num_stages) for name, c in one_tile.items()} == {
        "qkv_proj": (256, 4, 1), "o_proj": (256, 8, 1), "gate_up_proj": (256, 4, 1),
        "down_proj": (256, 12, 1)}
    down = QWEN3_06B_SHAPES["down_proj"]
    assert launch_config(*down, sms=132) == LaunchConfig(64, 128, 8, 4, 4)
    assert launch_config(24576, 4096, sms=132, pdl=True) == LaunchConfig(64, 128, 1, 4, 3)


def test_wide_tiles_from_9_rows():
    """From 9 rows, down_proj's 12 one-tile partials become 6 of twice the width at 8 warps."""
    assert (WIDE_TILE_MIN_ROWS, MAX_ONE_TILE_PARTIALS) == (9, 8)
    for rows in (9, 16):
        configs = {name: launch_config(N, K, sms=132, pdl=True, rows=rows)
                   for name, (N, K) in QWEN3_06B_SHAPES.items()}
        assert configs["down_proj"] == LaunchConfig(64, 512, 6, 8, 1)
        assert configs["o_proj"] == LaunchConfig(64, 256, 8, 4, 1)
        assert configs["qkv_proj"] == LaunchConfig(64, 256, 4, 4, 1)
    down = QWEN3_06B_SHAPES["down_proj"]
    assert launch_config(*down, sms=132, pdl=True, rows=8) == LaunchConfig(64, 256, 12, 4, 1)
    assert launch_config(*down, sms=132, rows=16) == LaunchConfig(64, 128, 8, 4, 4)


@pytest.mark.parametrize("M, splits", [(1, 12), (8, 12), (9, 6), (16, 6)])
def test_one_tile_splits_match_reference(M, splits):
    """PDL's configurations at down_proj's K (run without PDL): 12 splits of 256, or 6 of 512."""
    N, K = 128, QWEN3_06B_SHAPES["down_proj"][1]
    x, weight, b = make_inputs(M, N, K, torch.float16, bias=True)
    config = dataclasses.asdict(launch_config(1024, K, sms=132, pdl=True, rows=M))
    check(skinny_linear(x, weight, b, **config), x, weight, b)
    deferred = skinny_linear(x, weight, defer_sum=True, **config)
    assert deferred.parts.shape == (splits, M, N)
    check(deferred.sum(), x, weight, None)


def split_softmax(M, heads, splits, head_dim, dtype, seed=0) -> SplitSoftmax:
    """Decode attention's partials (m in the log2 domain, l, acc); split 1 of row 0 and the whole
    last row (padding) saw no key."""
    gen = torch.Generator().manual_seed(seed)
    m = 4 * torch.randn(M, heads, splits, generator=gen)
    l = 1 + 20 * torch.rand(M, heads, splits, generator=gen)  # noqa: E741
    acc = torch.randn(M, heads, splits, head_dim, generator=gen) * l[..., None]
    for empty in ((0, slice(None), 1), (M - 1,)):
        m[empty], l[empty], acc[empty] = -1.0e30, 0.0, 0.0
    return SplitSoftmax(acc.to(DEVICE), m.to(DEVICE), l.to(DEVICE), dtype)


@pytest.mark.parametrize("M, heads, head_dim, config", [
    (1, 16, 128, dict(block_k=256, split_k=8, num_stages=1)),  # o_proj: 2 heads a program
    (8, 16, 128, dict(block_k=256, split_k=8, num_stages=1)),
    (3, 16, 128, {}),  # default tiles: a head a tile
    (5, 5, 64, dict(block_k=256, split_k=2)),  # 4 heads a tile, the last ragged
    (4, 4, 256, dict(block_k=128)),  # tiles narrower than a head: merged first
])
@pytest.mark.parametrize("bias", [False, True])
def test_split_softmax_input_is_merged_as_it_loads(M, heads, head_dim, config, bias):
    """A SplitSoftmax x, merged as its tiles load: bit for bit the GEMM of the merged x."""
    x = split_softmax(M, heads, 4, head_dim, torch.float16)
    _, weight, b = make_inputs(M, 96, heads * head_dim, torch.float16, bias=bias)
    merged = x.merge().flatten(1, -1)
    assert merged.shape == x.shape == (M, heads * head_dim) and (merged[-1] == 0).all()
    y = skinny_linear(x, weight, b, **config)
    assert torch.equal(y, skinny_linear(merged, weight, b, **config))
    check(y, merged, weight, b)
    if not bias:
        deferred = skinny_linear(x, weight, defer_sum=True, **config)
        expected = skinny_linear(merged, weight, defer_sum=True, **config)
        assert torch.equal(summed(deferred), summed(expected))


def test_linear_uses_f_linear_on_cpu(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("skinny_linear called for a CPU tensor")

    monkeypatch.setattr(linear_module, "skinny_linear", fail)
    x, weight, b = make_inputs(1, 32, 64, torch.bfloat16, bias=True)
    x, weight, b = x.cpu(), weight.cpu(), b.cpu()
    torch.testing.assert_close(linear_module.linear(x, weight, b), F.linear(x, weight, b))


@needs_cuda
@pytest.mark.parametrize("name", QWEN3_06B_SHAPES)
def test_qwen3_shapes_match_cublas(name):
    N, K = QWEN3_06B_SHAPES[name]
    for M in range(1, SKINNY_MAX_ROWS + 1):
        x, weight, b = make_inputs(M, N, K, torch.bfloat16, bias=name == "qkv_proj", seed=M)
        y = skinny_linear(x, weight, b)
        torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1.6e-2, atol=1e-3)
        torch.testing.assert_close(y.float(), reference(x, weight, b), rtol=8e-3, atol=1e-3)


@needs_cuda
@pytest.mark.parametrize("N, K", [QWEN3_06B_SHAPES["gate_up_proj"], (24576, 4096)])  # 0.6B, 8B
def test_swiglu_at_the_qwen3_shapes_matches_cublas_and_silu(N, K):
    for M in range(1, SKINNY_MAX_ROWS + 1):
        x, weight, _ = make_inputs(M, N, K, torch.bfloat16, seed=M)
        gate, up = F.linear(x, weight).chunk(2, dim=-1)
        torch.testing.assert_close(skinny_swiglu(x, weight), F.silu(gate) * up, rtol=3.2e-2,
                                   atol=2e-3)


@needs_cuda
def test_cuda_graph_replay():
    x, weight, b = make_inputs(4, 1024, 3072, torch.bfloat16, bias=True)
    expected = skinny_linear(x, weight, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_linear(x, weight, b)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(y, skinny_linear(x, weight, b), rtol=0, atol=0)
    assert not torch.equal(y, expected)


@needs_cuda
@pytest.mark.parametrize("M, uses_skinny", [(1, True), (SKINNY_MAX_ROWS, True),
                                             (SKINNY_MAX_ROWS + 1, False)])
def test_linear_dispatch_on_cuda(monkeypatch, M, uses_skinny):
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return skinny_linear(*args, **kwargs)

    monkeypatch.setattr(linear_module, "skinny_linear", spy)
    x, weight, b = make_inputs(M, 1024, 2048, torch.bfloat16, bias=True)
    y = linear_module.linear(x, weight, b)
    assert calls == ([M] if uses_skinny else [])
    torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1.6e-2, atol=1e-3)
    deferred = linear_module.linear(x, weight, defer_sum=True)  # o_proj's shape: K is split
    assert isinstance(deferred, SplitKSum) == (uses_skinny or tiled_applies(x, weight))
    torch.testing.assert_close(summed(deferred), F.linear(x, weight), rtol=1.6e-2, atol=1e-3)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M,N,K,block_k", [(1, 40, 64, 32), (5, 32, 80, 32), (16, 64, 128, 64)])
def test_swiglu_is_the_projection_then_silu_and_mul(M, N, K, bias, block_k):
    """Bit for bit the unsplit GEMM (same tiles), then the SiLU-and-mul kernel; ragged K and N."""
    x, weight, b = make_inputs(M, 2 * N, K, torch.float16, bias)
    config = dict(block_n=16, block_k=block_k)
    fused = skinny_swiglu(x, weight, b, **config)
    projected = skinny_linear(x, weight, b, split_k=1, **config)
    torch.testing.assert_close(fused, silu_and_mul_triton(projected), rtol=0, atol=0)
    gate, up = reference(x, weight, b).chunk(2, dim=-1)
    torch.testing.assert_close(fused.float(), F.silu(gate) * up, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("down_config", [{}, dict(block_k=256, split_k=2, num_stages=1)])
def test_deferred_swiglu_is_activated_as_down_proj_loads_it(M, down_config):
    """A SwiGLUSplitKSum x: bit for bit summing, then silu_and_mul, then the GEMM."""
    N, K = 320, 512  # gate/up [2N, K] splits K in 2; down [64, N]: ragged tiles of N
    x, gate_up_w, _ = make_inputs(M, 2 * N, K, torch.float16)
    _, down_w, down_b = make_inputs(M, 64, N, torch.float16, bias=True, seed=1)
    deferred = skinny_swiglu(x, gate_up_w, defer=True)
    assert isinstance(deferred, SwiGLUSplitKSum) and deferred.shape == (M, N)
    assert deferred.dtype == x.dtype
    act = silu_and_mul_triton(deferred.y.sum())
    torch.testing.assert_close(act, skinny_swiglu(x, gate_up_w), rtol=2e-3, atol=2e-3)
    y = skinny_linear(deferred, down_w, down_b, **down_config)
    assert torch.equal(y, skinny_linear(act, down_w, down_b, **down_config))
    parts = skinny_linear(deferred, down_w, defer_sum=True, **down_config)
    expected = skinny_linear(act, down_w, defer_sum=True, **down_config)
    assert torch.equal(summed(parts), summed(expected))


def test_swiglu_defers_only_few_rows_without_bias():
    """Past DEFERRED_ACTIVATION_MAX_ROWS rows, or with a bias, defer=True changes nothing."""
    rows = skinny_gemm.DEFERRED_ACTIVATION_MAX_ROWS
    x, weight, b = make_inputs(rows + 1, 640, 512, torch.float16, bias=True)
    assert torch.equal(skinny_swiglu(x, weight, defer=True), skinny_swiglu(x, weight))
    assert torch.equal(skinny_swiglu(x[:1], weight, b, defer=True), skinny_swiglu(x[:1], weight, b))
    assert isinstance(skinny_swiglu(x[:rows], weight, defer=True), SwiGLUSplitKSum)


@pytest.mark.parametrize("M", [1, 8])
def test_decoder_mlp_leaves_the_activation_to_down_proj(monkeypatch, M):
    """The decode MLP (skinny path forced on CPU) hands gate/up's partials to down_proj; it matches
    the fused kernel's path and the torch MLP."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sizes = SimpleNamespace(hidden_size=512, intermediate_size=320)
        mlp = decoder.DecoderMLP(sizes, decoder.DecoderOptions())
    finally:
        dist.destroy_process_group()
    x, gate_up_w, _ = make_inputs(M, 640, 512, torch.float16)
    _, down_w, _ = make_inputs(M, 512, 320, torch.float16, seed=1)
    mlp.gate_up_proj.weight.data, mlp.down_proj.weight.data = gate_up_w, down_w
    taken = []
    monkeypatch.setattr(decoder, "skinny_applies", lambda x: True)
    monkeypatch.setattr(linear_module, "skinny_linear", lambda x, *args, **kwargs:
                        taken.append(type(x)) or skinny_linear(x, *args, **kwargs))
    deferred = summed(mlp(x))
    assert taken == [SwiGLUSplitKSum]
    monkeypatch.setattr(skinny_gemm, "DEFERRED_ACTIVATION_MAX_ROWS", 0)
    monkeypatch.setattr(linear_module, "skinny_applies", lambda x: True)  # for CPU tensors too
    fused = summed(mlp(x))
    assert taken[1:] == [torch.Tensor]
    torch.testing.assert_close(deferred, fused, rtol=2e-3, atol=2e-3)
    gate, up = F.linear(x.float(), gate_up_w.float()).chunk(2, dim=-1)
    expected = F.linear(F.silu(gate) * up, down_w.float())
    torch.testing.assert_close(deferred.float(), expected, rtol=1e-2, atol=1e-2)


def test_swiglu_tiles_cover_the_sms():
    assert gated_launch_config(3072, 1024, 132).block_n == 16  # Qwen3-0.6B: 192 programs
    assert gated_launch_config(9728, 2560, 132).block_n == 64  # Qwen3-4B: 152 programs
    assert gated_launch_config(3072, 1024, 132).split_k == 1


def test_swiglu_stages_fit_in_shared_memory():
    """Qwen3-8B's gate/up, 64 weight rows a program: 3 pipelined stages of 32 rows would take
    240 KiB, past Hopper's 227 KiB, so 17-32 rows run 3 stages (2 pipelined)."""
    assert [gated_launch_config(12288, 4096, 132, rows, 232448).num_stages
            for rows in (1, 16, 17, 32)] == [4, 4, 3, 3]
    assert gated_launch_config(3072, 1024, 132, 32, 232448).num_stages == 4  # 16 rows a program
    assert gated_launch_config(12288, 4096, 132, 32, 101376).num_stages == 2
