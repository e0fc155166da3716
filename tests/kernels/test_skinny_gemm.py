"""The skinny GEMM (decode linear layers) vs a float32 torch reference, and its dispatch in linear().

On CPU the kernels run under the Triton interpreter in float16 (the interpreter multiplies bfloat16
tiles as integers, so bfloat16 is tested on CUDA only). With CUDA, bf16 at Qwen3-0.6B shapes against
F.linear, inside a CUDA graph, and linear()'s choice of kernel.
"""

import dataclasses
import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gemm_reference import DEVICE, check, make_inputs, reference  # noqa: E402

from nanovllm.kernels.attention.split_softmax import SplitSoftmax  # noqa: E402
from nanovllm.kernels.gemm import skinny as skinny_gemm  # noqa: E402
from nanovllm.kernels.gemm.skinny import (  # noqa: E402
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
from nanovllm.kernels.gemm.split_k import SplitKSum, SwiGLUSplitKSum, summed  # noqa: E402
from nanovllm.kernels.gemm.tiled import tiled_applies  # noqa: E402
from nanovllm.layers import linear as linear_module  # noqa: E402
from nanovllm.layers.activation import silu_and_mul_triton  # noqa: E402
from nanovllm.models import decoder  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
QWEN3_06B_SHAPES = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024),
                    "down_proj": (1024, 3072)}  # (N, K)


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("N, K", [(64, 128), (100, 200), (48, 40)])  # even; ragged N and K; K < BLOCK_K
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
    """x a view: every other row of a wider buffer, starting at an odd column (unaligned pointer)."""
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
        assert isinstance(out, SplitKSum) and out.parts.shape == (3, 5, 100) and out.parts.dtype == torch.float32
        assert out.shape == (5, 100) and out.dtype == torch.float16
        assert torch.equal(out.sum(), expected)


def test_no_rows():
    x, weight, _ = make_inputs(0, 32, 64, torch.float16)
    assert skinny_linear(x, weight).shape == (0, 32)


@pytest.mark.parametrize("N, K", [*QWEN3_06B_SHAPES.values(), (6144, 4096), (4096, 4096), (24576, 4096),
                                  (4096, 12288), (64, 40)])
def test_launch_config_is_valid(N, K):
    config = launch_config(N, K, sms=132)
    for block in (config.block_n, config.block_k):
        assert block >= 16 and block & (block - 1) == 0
    assert 1 <= config.split_k and config.split_k * config.block_k <= max(K, config.block_k)
    assert config.num_warps in (1, 2, 4, 8, 16) and config.num_stages >= 1
    # With PDL the first tile is loaded before the pipelined loop, which takes one stage fewer; narrow splits
    # become one ONE_TILE_K tile a program (at most twice the splits), loaded before the wait, no loop.
    with_pdl = launch_config(N, K, sms=132, pdl=True)
    if with_pdl.block_k == ONE_TILE_K and with_pdl.num_stages == 1:
        assert with_pdl.split_k * ONE_TILE_K == K and config.split_k < with_pdl.split_k * 2 <= 4 * config.split_k
        assert dataclasses.replace(with_pdl, block_k=config.block_k, split_k=config.split_k, num_stages=4) == config
    else:
        assert with_pdl == dataclasses.replace(config, num_stages=config.num_stages - 1)


def test_launch_config_at_the_qwen3_shapes():
    """With PDL every Qwen3-0.6B projection takes one 64 x 256 weight tile a program (gate/up too, which decode runs
    through skinny_swiglu instead); without PDL, and at wide splits, the pipelined loop over 128-wide tiles."""
    one_tile = {name: launch_config(N, K, sms=132, pdl=True) for name, (N, K) in QWEN3_06B_SHAPES.items()}
    assert {name: (c.block_k, c.split_k, c.num_stages) for name, c in one_tile.items()} == {
        "qkv_proj": (256, 4, 1), "o_proj": (256, 8, 1), "gate_up_proj": (256, 4, 1), "down_proj": (256, 12, 1)}
    assert launch_config(*QWEN3_06B_SHAPES["down_proj"], sms=132) == LaunchConfig(64, 128, 8, 4, 4)  # no PDL
    assert launch_config(24576, 4096, sms=132, pdl=True) == LaunchConfig(64, 128, 1, 4, 3)  # wide: the loop


def test_wide_tiles_from_9_rows():
    """From WIDE_TILE_MIN_ROWS rows (past the deferred activation's 8), one-tile splits leaving more than
    MAX_ONE_TILE_PARTIALS partials (down_proj's 12) take tiles twice as wide at 8 warps; o_proj's 8 and qkv's 4
    stay, and so does everything at 8 rows."""
    assert (WIDE_TILE_MIN_ROWS, MAX_ONE_TILE_PARTIALS) == (9, 8)
    for rows in (9, 16):
        configs = {name: launch_config(N, K, sms=132, pdl=True, rows=rows) for name, (N, K) in QWEN3_06B_SHAPES.items()}
        assert configs["down_proj"] == LaunchConfig(64, 512, 6, 8, 1)
        assert configs["o_proj"] == LaunchConfig(64, 256, 8, 4, 1)
        assert configs["qkv_proj"] == LaunchConfig(64, 256, 4, 4, 1)
    assert launch_config(*QWEN3_06B_SHAPES["down_proj"], sms=132, pdl=True, rows=8) == LaunchConfig(64, 256, 12, 4, 1)
    assert launch_config(*QWEN3_06B_SHAPES["down_proj"], sms=132, rows=16) == LaunchConfig(64, 128, 8, 4, 4)  # no PDL


@pytest.mark.parametrize("M, splits", [(1, 12), (8, 12), (9, 6), (16, 6)])
def test_one_tile_splits_match_reference(M, splits):
    """PDL's configurations (here run without PDL, as on CPU) at down_proj's K: 12 splits of 256, from 9 rows
    6 of 512 at 8 warps."""
    N, K = 128, QWEN3_06B_SHAPES["down_proj"][1]
    x, weight, b = make_inputs(M, N, K, torch.float16, bias=True)
    config = dataclasses.asdict(launch_config(1024, K, sms=132, pdl=True, rows=M))
    check(skinny_linear(x, weight, b, **config), x, weight, b)
    deferred = skinny_linear(x, weight, defer_sum=True, **config)
    assert deferred.parts.shape == (splits, M, N)
    check(deferred.sum(), x, weight, None)


def split_softmax(M, heads, splits, head_dim, dtype, seed=0) -> SplitSoftmax:
    """Decode attention's partials as the decode kernel leaves them: per split a max m (log2 domain), a sum l of
    weights <= 1 under it, and acc of that scale; split 1 of row 0 saw no key (m -1e30, l and acc 0), and the
    last row none at all (a padding row)."""
    gen = torch.Generator().manual_seed(seed)
    m = 4 * torch.randn(M, heads, splits, generator=gen)
    l = 1 + 20 * torch.rand(M, heads, splits, generator=gen)  # noqa: E741
    acc = torch.randn(M, heads, splits, head_dim, generator=gen) * l[..., None]
    for empty in ((0, slice(None), 1), (M - 1,)):
        m[empty], l[empty], acc[empty] = -1.0e30, 0.0, 0.0
    return SplitSoftmax(acc.to(DEVICE), m.to(DEVICE), l.to(DEVICE), dtype)


@pytest.mark.parametrize("M, heads, head_dim, config", [
    (1, 16, 128, dict(block_k=256, split_k=8, num_stages=1)),  # o_proj at batch 1, one tile of 2 heads a program
    (8, 16, 128, dict(block_k=256, split_k=8, num_stages=1)),
    (3, 16, 128, {}),  # the default config's 128-wide tiles: a head a tile
    (5, 5, 64, dict(block_k=256, split_k=2)),  # 4 heads a tile, the last tile a head and three past K
    (4, 4, 256, dict(block_k=128)),  # tiles narrower than a head: merged first
])
@pytest.mark.parametrize("bias", [False, True])
def test_split_softmax_input_is_merged_as_it_loads(M, heads, head_dim, config, bias):
    """x a SplitSoftmax: the GEMM merges it as it loads its tiles, to the bits of merging first, and to the merged
    values' reference."""
    x = split_softmax(M, heads, 4, head_dim, torch.float16)
    _, weight, b = make_inputs(M, 96, heads * head_dim, torch.float16, bias=bias)
    merged = x.merge().flatten(1, -1)
    assert merged.shape == x.shape == (M, heads * head_dim) and (merged[-1] == 0).all()
    y = skinny_linear(x, weight, b, **config)
    assert torch.equal(y, skinny_linear(merged, weight, b, **config))
    check(y, merged, weight, b)
    if not bias:
        deferred = skinny_linear(x, weight, defer_sum=True, **config)
        assert torch.equal(summed(deferred), summed(skinny_linear(merged, weight, defer_sum=True, **config)))


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
        # Both accumulate in float32: at most a bf16 rounding apart.
        torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1.6e-2, atol=1e-3)
        torch.testing.assert_close(y.float(), reference(x, weight, b), rtol=8e-3, atol=1e-3)


@needs_cuda
def test_swiglu_at_the_qwen3_shape_matches_cublas_and_silu():
    N, K = QWEN3_06B_SHAPES["gate_up_proj"]
    for M in range(1, SKINNY_MAX_ROWS + 1):
        x, weight, _ = make_inputs(M, N, K, torch.bfloat16, seed=M)
        gate, up = F.linear(x, weight).chunk(2, dim=-1)
        # gate and up at most a bf16 rounding from cuBLAS's, each op after rounded the same
        torch.testing.assert_close(skinny_swiglu(x, weight), F.silu(gate) * up, rtol=3.2e-2, atol=2e-3)


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
@pytest.mark.parametrize("M, uses_skinny", [(1, True), (SKINNY_MAX_ROWS, True), (SKINNY_MAX_ROWS + 1, False)])
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
    deferred = linear_module.linear(x, weight, defer_sum=True)  # o_proj's shape: K is split (tiled GEMM's too)
    assert isinstance(deferred, SplitKSum) == (uses_skinny or tiled_applies(x, weight))
    torch.testing.assert_close(summed(deferred), F.linear(x, weight), rtol=1.6e-2, atol=1e-3)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M,N,K,block_k", [(1, 40, 64, 32), (5, 32, 80, 32), (16, 64, 128, 64)])
def test_swiglu_is_the_projection_then_silu_and_mul(M, N, K, bias, block_k):
    """One kernel for gate/up and SwiGLU's activation: the unsplit GEMM's values (the same tiles), rounded
    as the SiLU-and-mul kernel rounds them, bit for bit; ragged K and output features included."""
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
    """skinny_swiglu(defer=True) leaves the gate/up projection's split-K partials (a SwiGLUSplitKSum); the skinny GEMM
    reading them sums and activates each tile to the bits of summing, then silu_and_mul, then the GEMM."""
    N, K = 320, 512  # gate/up [2N, K] splits K (in 2 here); down [64, N]: ragged tiles of N
    x, gate_up_w, _ = make_inputs(M, 2 * N, K, torch.float16)
    _, down_w, down_b = make_inputs(M, 64, N, torch.float16, bias=True, seed=1)
    deferred = skinny_swiglu(x, gate_up_w, defer=True)
    assert isinstance(deferred, SwiGLUSplitKSum) and deferred.shape == (M, N) and deferred.dtype == x.dtype
    act = silu_and_mul_triton(deferred.y.sum())
    torch.testing.assert_close(act, skinny_swiglu(x, gate_up_w), rtol=2e-3, atol=2e-3)  # the fused kernel's values
    y = skinny_linear(deferred, down_w, down_b, **down_config)
    assert torch.equal(y, skinny_linear(act, down_w, down_b, **down_config))
    parts = skinny_linear(deferred, down_w, defer_sum=True, **down_config)
    assert torch.equal(summed(parts), summed(skinny_linear(act, down_w, defer_sum=True, **down_config)))


def test_swiglu_defers_only_few_rows_without_bias():
    """From DEFERRED_ACTIVATION_MAX_ROWS + 1 rows, or with a bias, skinny_swiglu(defer=True) activates as without."""
    rows = skinny_gemm.DEFERRED_ACTIVATION_MAX_ROWS
    x, weight, b = make_inputs(rows + 1, 640, 512, torch.float16, bias=True)
    assert torch.equal(skinny_swiglu(x, weight, defer=True), skinny_swiglu(x, weight))
    assert torch.equal(skinny_swiglu(x[:1], weight, b, defer=True), skinny_swiglu(x[:1], weight, b))
    assert isinstance(skinny_swiglu(x[:rows], weight, defer=True), SwiGLUSplitKSum)


@pytest.mark.parametrize("M", [1, 8])
def test_decoder_mlp_leaves_the_activation_to_down_proj(monkeypatch, M):
    """The decode MLP on the skinny path (forced here on CPU): up to 8 rows, gate/up's partials go to down_proj,
    whose skinny GEMM activates them as it loads them; its output is the fused kernel's path's (to the rounding
    of another summation order) and the torch MLP's."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mlp = decoder.DecoderMLP(SimpleNamespace(hidden_size=512, intermediate_size=320), decoder.DecoderOptions())
    finally:
        dist.destroy_process_group()
    x, gate_up_w, _ = make_inputs(M, 640, 512, torch.float16)
    _, down_w, _ = make_inputs(M, 512, 320, torch.float16, seed=1)
    mlp.gate_up_proj.weight.data, mlp.down_proj.weight.data = gate_up_w, down_w
    taken = []
    monkeypatch.setattr(decoder, "skinny_applies", lambda x: True)
    monkeypatch.setattr(linear_module, "skinny_linear",
                        lambda x, *args, **kwargs: taken.append(type(x)) or skinny_linear(x, *args, **kwargs))
    deferred = summed(mlp(x))
    assert taken == [SwiGLUSplitKSum]
    monkeypatch.setattr(skinny_gemm, "DEFERRED_ACTIVATION_MAX_ROWS", 0)
    monkeypatch.setattr(linear_module, "skinny_applies", lambda x: True)  # the fused kernel's output is on CPU
    fused = summed(mlp(x))
    assert taken[1:] == [torch.Tensor]
    torch.testing.assert_close(deferred, fused, rtol=2e-3, atol=2e-3)
    gate, up = F.linear(x.float(), gate_up_w.float()).chunk(2, dim=-1)
    torch.testing.assert_close(deferred.float(), F.linear(F.silu(gate) * up, down_w.float()), rtol=1e-2, atol=1e-2)


def test_swiglu_tiles_cover_the_sms():
    assert gated_launch_config(3072, 1024, 132).block_n == 16  # Qwen3-0.6B: 192 programs
    assert gated_launch_config(9728, 2560, 132).block_n == 64  # Qwen3-4B: 152 programs
    assert gated_launch_config(3072, 1024, 132).split_k == 1
