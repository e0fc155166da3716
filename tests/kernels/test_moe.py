"""The fused MoE kernels (router, align, grouped gate/up and down GEMMs) against torch references.

Tiny float32 shapes (on CPU under the Triton interpreter, with CUDA on the GPU, its dots in tf32):
uneven expert loads, experts without tokens, top-k 1 and 8, expert-parallel slices. With CUDA
also bf16 at Qwen3-30B-A3B's layer shape, eagerly and inside a CUDA graph."""

import pytest
import torch

from nanovllm.kernels import moe as moe_kernels
from nanovllm.kernels.gemm.split_k import SplitKSum, summed
from nanovllm.kernels.moe import (
    DECODE_TILES,
    DEFER_MAX_ASSIGNMENTS,
    MID_TILES,
    PREFILL_TILES,
    MoeTiles,
    fused_moe,
    max_padded_rows,
    moe_align,
    moe_tiles,
)
from nanovllm.kernels.moe_router import topk_softmax
from nanovllm.layers.fused_moe import moe_reference, select_experts, select_experts_torch
from tests.conftest import needs_cuda

SMALL = MoeTiles(16, 16, 16, group_m=2, num_warps=4, num_stages=2)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 dots: exact in the interpreter, tf32 on the GPU.
FP32 = dict(rtol=1e-5, atol=1e-5) if DEVICE == "cpu" else dict(rtol=2e-2, atol=2e-2)


def uneven_ids(T: int, top_k: int, num_experts: int, seed: int = 0) -> torch.Tensor:
    """[T, top_k] distinct experts per token, skewed: low ids popular, the last two unused."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, num_experts - 2, generator=g) * torch.linspace(4, 1, num_experts - 2)
    return scores.topk(top_k, dim=-1).indices.to(DEVICE)


def check_align(ids: torch.Tensor, num_experts: int, block_m: int, offset: int = 0):
    sorted_ids, expert_ids, num_padded = moe_align(ids, num_experts, block_m, offset)
    flat, n = ids.flatten(), ids.numel()
    total = int(num_padded)
    assert sorted_ids.numel() == max_padded_rows(n, num_experts, block_m) >= total
    assert total % block_m == 0
    seen = []
    for block in range(sorted_ids.numel() // block_m):
        rows = sorted_ids[block * block_m:(block + 1) * block_m].tolist()
        expert = int(expert_ids[block])
        if block * block_m >= total:
            assert expert == -1 and rows == [n] * block_m
            continue
        real = [r for r in rows if r != n]
        assert all(int(flat[r]) - offset == expert for r in real)
        assert rows == real + [n] * (block_m - len(real))  # a run's padding ends it
        seen += real
    local = [i for i in range(n) if 0 <= int(flat[i]) - offset < num_experts]
    assert sorted(seen) == local
    counts = [int((flat - offset == e).sum()) for e in range(num_experts)]
    padded = sum(-(-c // block_m) * block_m for c in counts)
    assert total == padded  # only experts with rows take blocks, in expert order
    assert expert_ids[:total // block_m].tolist() == sorted(expert_ids[:total // block_m].tolist())


@pytest.mark.parametrize("T, top_k, block_m", [(1, 1, 16), (5, 2, 16), (37, 8, 16), (40, 3, 64)])
def test_align_groups_every_assignment_by_expert(T, top_k, block_m):
    check_align(uneven_ids(T, top_k, 10), 10, block_m)


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_in_chunks_with_a_separate_scatter(block_m, monkeypatch):
    monkeypatch.setattr(moe_kernels, "ALIGN_CHUNK", 64)  # 296 assignments: 5 chunks, 5 programs
    check_align(uneven_ids(37, 8, 12, seed=3), 12, block_m)
    check_align(uneven_ids(37, 8, 12, seed=3), 6, block_m, offset=6)


def test_align_keeps_only_local_experts():
    ids = uneven_ids(23, 4, 12, seed=1)
    check_align(ids, 6, 16, offset=6)  # the second of two expert-parallel ranks
    check_align(ids, 6, 16, offset=0)


def moe_inputs(T, top_k, E, H, inter, dtype, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    x = rand(T, H)
    w13, w2 = rand(E, 2 * inter, H, scale=H ** -0.5), rand(E, H, inter, scale=inter ** -0.5)
    logits = rand(T, E) + torch.linspace(3, 0, E, device=device, dtype=dtype)  # uneven loads
    weights, ids = select_experts_torch(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("T, top_k, E, H, inter", [
    (1, 1, 4, 32, 16),  # one token: three experts without any
    (9, 2, 8, 48, 40),  # ragged hidden and intermediate tiles
    (20, 8, 10, 32, 32),  # top-8 of 10: nearly every expert, uneven
    (3, 8, 16, 16, 16),  # more experts than assignments
])
@pytest.mark.parametrize("defer_sum", [False, True])
def test_fused_moe_matches_reference(T, top_k, E, H, inter, defer_sum):
    x, w13, w2, weights, ids = moe_inputs(T, top_k, E, H, inter, torch.float32)
    expected = moe_reference(x, w13, w2, weights, ids)
    out = fused_moe(x, w13, w2, weights, ids, tiles=SMALL, defer_sum=defer_sum)
    assert isinstance(out, SplitKSum) == defer_sum
    if defer_sum:  # one float32 partial per expert slot, as split-K partials
        assert out.parts.shape == (top_k, T, H) and out.dtype == x.dtype
    torch.testing.assert_close(summed(out), expected, **FP32)


@pytest.mark.parametrize("tiles", [DECODE_TILES, MID_TILES, PREFILL_TILES])
def test_default_tiles_match_reference(tiles):
    x, w13, w2, weights, ids = moe_inputs(70, 4, 8, 64, 96, torch.float32, seed=1)
    out = fused_moe(x, w13, w2, weights, ids, tiles=tiles)
    torch.testing.assert_close(out, moe_reference(x, w13, w2, weights, ids), **FP32)


def test_tiles_follow_the_rows_per_expert():
    assert [moe_tiles(T * 8, 128) for T in (1, 64, 65, 512, 513)] == [
        DECODE_TILES, DECODE_TILES, MID_TILES, MID_TILES, PREFILL_TILES]


def test_expert_parallel_halves_sum_to_the_whole():
    x, w13, w2, weights, ids = moe_inputs(11, 3, 8, 32, 16, torch.float32, seed=2)
    halves = [fused_moe(x, w13[4 * r:4 * r + 4].contiguous(), w2[4 * r:4 * r + 4].contiguous(),
                        weights, ids, expert_offset=4 * r, all_local=False, tiles=SMALL)
              for r in range(2)]
    for r, half in enumerate(halves):
        torch.testing.assert_close(half, moe_reference(x, w13[4 * r:4 * r + 4],
                                                       w2[4 * r:4 * r + 4], weights, ids, 4 * r),
                                   **FP32)
    torch.testing.assert_close(halves[0] + halves[1], moe_reference(x, w13, w2, weights, ids),
                               **FP32)


def test_router_matches_transformers():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    for norm in (True, False):
        config = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                norm_topk_prob=norm)
        router = Qwen3MoeTopKRouter(config)
        torch.nn.init.normal_(router.weight)
        x = torch.randn(5, 16)
        _, expected_weights, expected_ids = router(x)
        weights, ids = select_experts(x @ router.weight.T, 3, norm)
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("T, E, top_k", [(1, 8, 1), (21, 10, 2), (5, 128, 8), (40, 6, 6)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_kernel_matches_select_experts(T, E, top_k, renormalize):
    logits = torch.randn(T, E) * 3
    logits[0, 1] = logits[0, 4] = logits[0].max() + 1  # a tie at the top: the lower id first
    weights, ids = topk_softmax(logits.to(DEVICE), top_k, renormalize)
    expected_weights, expected_ids = select_experts_torch(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == logits.dtype
    assert torch.equal(ids.cpu().long(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_weights, rtol=1e-5, atol=1e-6)
    if top_k > 1:
        assert ids[0, :2].tolist() == [1, 4]


QWEN3_30B_A3B_LAYER = dict(E=128, H=2048, inter=768, top_k=8)


@needs_cuda
@pytest.mark.parametrize("T", [1, 8, 64, 256, 1000])
def test_fused_moe_bf16_on_cuda(T):
    shape = QWEN3_30B_A3B_LAYER
    x, w13, w2, weights, ids = moe_inputs(T, shape["top_k"], shape["E"], shape["H"],
                                          shape["inter"], torch.bfloat16)
    expected = moe_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)
    out = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    deferred = fused_moe(x, w13, w2, weights, ids, defer_sum=True)
    assert isinstance(deferred, SplitKSum) == (T * shape["top_k"] <= DEFER_MAX_ASSIGNMENTS)
    torch.testing.assert_close(summed(deferred).float(), expected, rtol=2e-2, atol=2e-2)
    for tiles in (DECODE_TILES, MID_TILES, PREFILL_TILES):
        again = fused_moe(x, w13, w2, weights, ids, tiles=tiles)
        torch.testing.assert_close(again.float(), expected, rtol=2e-2, atol=2e-2)


@needs_cuda
def test_fused_moe_replays_in_a_cuda_graph():
    shape = QWEN3_30B_A3B_LAYER
    x, w13, w2, weights, ids = moe_inputs(16, shape["top_k"], shape["E"], shape["H"],
                                          shape["inter"], torch.bfloat16)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for seed in (1, 2):  # new routing and inputs, written in place
        x2, _, _, weights2, ids2 = moe_inputs(16, shape["top_k"], shape["E"], shape["H"],
                                              shape["inter"], torch.bfloat16, "cuda", seed)
        x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)
        graph.replay()
        torch.testing.assert_close(out, fused_moe(x, w13, w2, weights, ids), rtol=0, atol=0)
