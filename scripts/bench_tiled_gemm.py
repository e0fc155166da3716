"""The tiled GEMM (nanovllm/layers/tiled_gemm.py) against cuBLAS on Qwen3-0.6B's projections at 64-256 rows, in
the chain of kernels a decode layer runs; and whether its tile_config picks the tiles a search would.

    python scripts/bench_tiled_gemm.py                    # M = 64, 128, 256 (~2 min on an H200)
    python scripts/bench_tiled_gemm.py --rows 128,256

Above SKINNY_MAX_ROWS, cuBLAS is not launched with programmatic dependent launch (PDL): it starts only once the norm
before it has ended, and the kernel after it only once it has; the tiled GEMM is. Each projection's tiles are first
ranked alone (one GEMM, L2 flushed), then the chain is timed: 28 layers of the engine's kernels, input norm -> qkv ->
q/k norm + RoPE -> o -> post-attention norm -> gate_up -> SiLU -> down (attention left out: o's x is fixed), with
cuBLAS (F.linear), with tile_config's tiles, and with the tiles of a coordinate descent from each projection's
fastest alone over its TRIED_IN_CHAIN fastest; then cuBLAS and tile_config's tiles with PDL off for every kernel.
Times: medians of replays of a CUDA graph (scripts/gpu_timing.py). Report under $OUT.
"""

import argparse
import itertools
import os

import torch
import torch.nn.functional as F
import triton
from bench_gemm import SHAPES  # scripts/bench_gemm.py
from gpu_timing import bench, emit, save_report  # scripts/gpu_timing.py

from nanovllm.kernels.gemm.split_k import summed
from nanovllm.kernels.gemm.tiled import TileConfig, config_for_tiles, tile_config, tiled_linear
from nanovllm.kernels.qk_norm_rope import qk_norm_rope
from nanovllm.layers.activation import silu_and_mul_triton
from nanovllm.layers.layernorm import rms_norm_triton

DTYPE = torch.bfloat16
PROJECTIONS = {layer: (N, K) for model, layer, N, K in SHAPES if model == "0.6B"}
# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K); 8 warps for 128 x 128 tiles, else 4; stages as tile_config sets them.
TILES = list(itertools.product((64, 128), (64, 128, 256), (64, 128), (1, 2, 4)))
# Only these projections' outputs may be split-K partials: the kernels after them (q/k norm + RoPE, the norms) sum
# them as they load; SiLU after gate_up takes a tensor.
SPLITTABLE = ("qkv", "o", "down")
TRIED_IN_CHAIN = 3  # a projection's fastest tiles alone that the chain tries


def tile_of(config: TileConfig) -> tuple[int, int, int, int]:
    return config.block_m, config.block_n, config.block_k, config.split_k


def tiled(x, weight, tile):
    return tiled_linear(x, weight, defer_sum=tile[3] > 1, config=config_for_tiles(*tile))


def use_pdl(on: bool):
    """The tiled GEMM and the engine's other kernels launch with PDL or without (utils.device.pdl_enabled)."""
    os.environ["NANOVLLM_PDL"] = "1" if on else "0"


def ranked_tiles(M: int) -> dict[str, list[tuple]]:
    """Each projection's tiles at M rows, fastest alone first; times against cuBLAS's emitted."""
    ranked = {}
    for name, (N, K) in PROJECTIONS.items():
        x = torch.randn(M, K, dtype=DTYPE, device="cuda")
        weight = torch.randn(N, K, dtype=DTYPE, device="cuda") / K ** 0.5
        expected = F.linear(x, weight)
        cublas = bench(lambda x=x, weight=weight: F.linear(x, weight), quick=True)
        times = {}
        for tile in TILES:
            if K % (tile[2] * tile[3]) or tile[0] > max(64, M) or (tile[3] > 1 and name not in SPLITTABLE):
                continue
            try:
                got = summed(tiled(x, weight, tile))
            except triton.runtime.errors.OutOfResources:
                continue
            if not torch.allclose(got, expected, rtol=1.6e-2, atol=1e-2):
                emit(f"   {name} M={M} {tile}: wrong result, max error {(got - expected).abs().max().item():.3g}")
                continue
            times[tile] = bench(lambda x=x, weight=weight, tile=tile: tiled(x, weight, tile), quick=True)
        ranked[name] = sorted(times, key=times.get)
        emit(f"M={M:>3} {name:>7} N={N} K={K}: cuBLAS {cublas * 1e3:6.2f} us; tiled best "
             + "  ".join(f"{'/'.join(map(str, t))}:{times[t] * 1e3:.2f}" for t in ranked[name][:4]))
    return ranked


def chain(M: int, tiles: dict[str, tuple] | None, layers: int = 28):
    """`layers` decode layers' kernels less attention, the projections by cuBLAS (tiles None) or by the tiled
    kernel with each projection's tile."""
    torch.manual_seed(0)
    hidden, heads, kv_heads, head_dim = 1024, 16, 8, 128

    def w(*shape):
        return torch.randn(*shape, dtype=DTYPE, device="cuda") / shape[-1] ** 0.5

    weights = [{name: w(N, K) for name, (N, K) in PROJECTIONS.items()} for _ in range(layers)]
    norm_w, head_norm_w = torch.ones(hidden, dtype=DTYPE, device="cuda"), torch.ones(head_dim, dtype=DTYPE,
                                                                                      device="cuda")
    attn_out = torch.randn(M, heads * head_dim, dtype=DTYPE, device="cuda")
    first = torch.randn(M, hidden, dtype=DTYPE, device="cuda")
    positions = torch.arange(M, device="cuda")
    cos_sin = torch.randn(4096, head_dim, dtype=torch.float32, device="cuda")

    def proj(name, x, weight):
        return F.linear(x, weight) if tiles is None else tiled(x, weight, tiles[name])

    def run():
        out, residual = first, first
        for layer in weights:
            h, residual = rms_norm_triton(out, residual, norm_w, 1e-6)
            qkv = proj("qkv", h, layer["qkv"])
            qk_norm_rope(qkv, positions, cos_sin, heads, kv_heads, head_dim, q_weight=head_norm_w,
                         k_weight=head_norm_w)
            o = proj("o", attn_out, layer["o"])
            h, residual = rms_norm_triton(o, residual, norm_w, 1e-6)
            act = silu_and_mul_triton(proj("gate_up", h, layer["gate_up"]))
            out = proj("down", act, layer["down"])

    return run


def chain_us(M, tiles, layers=28):
    return bench(chain(M, tiles, layers)) * 1e3 / layers


def engine_tiles(M: int) -> dict[str, tuple]:
    """The tiles tile_config gives the engine at M rows (split K only where the next kernel sums the partials)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {name: tile_of(tile_config(M, N, K, sms, splittable=name in SPLITTABLE))
            for name, (N, K) in PROJECTIONS.items()}


def named(tiles: dict[str, tuple]) -> str:
    return ", ".join(f"{n} {'/'.join(map(str, t))}" for n, t in tiles.items())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=lambda s: [int(m) for m in s.split(",")], default=[64, 128, 256])
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    emit(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    emit("== tile BLOCK_M/BLOCK_N/BLOCK_K/SPLIT_K: us (one GEMM alone, PDL, medians)")
    for M in args.rows:
        use_pdl(True)
        ranked = ranked_tiles(M)
        cublas = chain_us(M, None)
        engine = engine_tiles(M)
        engine_us = chain_us(M, engine)
        # Coordinate descent over the projections' tiles, in the chain, from each one's fastest alone.
        best = {name: tiles[0] for name, tiles in ranked.items()}
        best_us = chain_us(M, best)
        for name, tiles in ranked.items():
            for tile in tiles[1:TRIED_IN_CHAIN]:
                us = chain_us(M, {**best, name: tile})
                if us < best_us:
                    best, best_us = {**best, name: tile}, us
        use_pdl(False)
        cublas_no_pdl, engine_no_pdl = chain_us(M, None), chain_us(M, engine)
        emit(f"M={M:>3} chain, us a layer, PDL on: cuBLAS {cublas:.2f}; tile_config's tiles {engine_us:.2f} "
             f"({cublas / engine_us:.2f}x): {named(engine)}; searched {best_us:.2f}: {named(best)}")
        emit(f"M={M:>3} chain, us a layer, PDL off (every kernel): cuBLAS {cublas_no_pdl:.2f}; tile_config's "
             f"tiles {engine_no_pdl:.2f}")
        save_report("bench_tiled_gemm.txt")


if __name__ == "__main__":
    main()
