"""The tiled GEMM against cuBLAS at 64-256 rows, alone and in a decode layer's chain of kernels.

    python -m benchmarks.tiled_gemm                 # M = 64, 128, 256
    python -m benchmarks.tiled_gemm --rows 128,256
"""

import argparse
import itertools
import os

import torch
import torch.nn.functional as F
import triton

from benchmarks.gemm import SHAPES
from benchmarks.gpu_timing import bench, emit, save_report
from nanovllm.kernels.activation import silu_and_mul_triton
from nanovllm.kernels.gemm.split_k import summed
from nanovllm.kernels.gemm.tiled import TileConfig, config_for_tiles, tile_config, tiled_linear
from nanovllm.kernels.norm import rms_norm_triton
from nanovllm.kernels.qk_norm_rope import qk_norm_rope

DTYPE = torch.bfloat16
PROJECTIONS = {layer: (N, K) for model, layer, N, K in SHAPES if model == "0.6B"}
# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
TILES = list(itertools.product((64, 128), (64, 128, 256), (64, 128), (1, 2, 4)))
# The projections whose next kernel (q/k norm + RoPE, a norm) sums split-K partials as it loads.
SPLITTABLE = ("qkv", "o", "down")
TRIED_IN_CHAIN = 3  # a projection's fastest tiles alone that the chain's search tries


def tile_of(config: TileConfig) -> tuple[int, int, int, int]:
    return config.block_m, config.block_n, config.block_k, config.split_k


def tiled(x, weight, tile):
    return tiled_linear(x, weight, defer_sum=tile[3] > 1, config=config_for_tiles(*tile))


def use_pdl(on: bool):
    os.environ["NANOVLLM_PDL"] = "1" if on else "0"


def tile_times(name, M, N, K) -> tuple[dict[tuple, float], float]:
    """Milliseconds of each tile that applies to one projection at M rows, alone, and of cuBLAS."""
    x = torch.randn(M, K, dtype=DTYPE, device="cuda")
    weight = torch.randn(N, K, dtype=DTYPE, device="cuda") / K ** 0.5
    expected = F.linear(x, weight)
    times = {}
    for tile in TILES:
        split = tile[3] > 1
        if K % (tile[2] * tile[3]) or tile[0] > max(64, M) or (split and name not in SPLITTABLE):
            continue
        try:
            got = summed(tiled(x, weight, tile))
        except triton.runtime.errors.OutOfResources:
            continue
        if not torch.allclose(got, expected, rtol=1.6e-2, atol=1e-2):
            error = (got - expected).abs().max().item()
            emit(f"   {name} M={M} {tile}: wrong result, max error {error:.3g}")
            continue
        times[tile] = bench(lambda tile=tile: tiled(x, weight, tile), quick=True)
    return times, bench(lambda: F.linear(x, weight), quick=True)


def ranked_tiles(M: int) -> dict[str, list[tuple]]:
    """Each projection's tiles at M rows, fastest alone first."""
    ranked = {}
    for name, (N, K) in PROJECTIONS.items():
        times, cublas = tile_times(name, M, N, K)
        ranked[name] = sorted(times, key=times.get)
        emit(f"M={M:>3} {name:>7} N={N} K={K}: cuBLAS {cublas * 1e3:6.2f} us; tiled best "
             + "  ".join(f"{'/'.join(map(str, t))}:{times[t] * 1e3:.2f}" for t in ranked[name][:4]))
    return ranked


def chain(M: int, tiles: dict[str, tuple] | None, layers: int = 28):
    """`layers` decode layers' kernels less attention (o reads a fixed input): norm, qkv, q/k norm
    + RoPE, o, norm, gate_up, SiLU, down; the projections by cuBLAS (tiles None) or tiled."""
    torch.manual_seed(0)
    hidden, heads, kv_heads, head_dim = 1024, 16, 8, 128

    def w(*shape):
        return torch.randn(*shape, dtype=DTYPE, device="cuda") / shape[-1] ** 0.5

    weights = [{name: w(N, K) for name, (N, K) in PROJECTIONS.items()} for _ in range(layers)]
    norm_w = torch.ones(hidden, dtype=DTYPE, device="cuda")
    head_norm_w = torch.ones(head_dim, dtype=DTYPE, device="cuda")
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
    """The tiles tile_config gives the engine at M rows."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {name: tile_of(tile_config(M, N, K, sms, splittable=name in SPLITTABLE))
            for name, (N, K) in PROJECTIONS.items()}


def searched_tiles(M, ranked) -> tuple[dict[str, tuple], float]:
    """Coordinate descent over the projections' tiles in the chain, from each's fastest alone."""
    best = {name: tiles[0] for name, tiles in ranked.items()}
    best_us = chain_us(M, best)
    for name, tiles in ranked.items():
        for tile in tiles[1:TRIED_IN_CHAIN]:
            us = chain_us(M, {**best, name: tile})
            if us < best_us:
                best, best_us = {**best, name: tile}, us
    return best, best_us


def named(tiles: dict[str, tuple]) -> str:
    return ", ".join(f"{n} {'/'.join(map(str, t))}" for n, t in tiles.items())


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=lambda s: [int(m) for m in s.split(",")],
                        default=[64, 128, 256])
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
        best, best_us = searched_tiles(M, ranked)
        use_pdl(False)
        cublas_no_pdl, engine_no_pdl = chain_us(M, None), chain_us(M, engine)
        emit(f"M={M:>3} chain, us a layer, PDL on: cuBLAS {cublas:.2f}; tile_config's tiles "
             f"{engine_us:.2f} ({cublas / engine_us:.2f}x): {named(engine)}; "
             f"searched {best_us:.2f}: {named(best)}")
        emit(f"M={M:>3} chain, us a layer, PDL off (every kernel): cuBLAS {cublas_no_pdl:.2f}; "
             f"tile_config's tiles {engine_no_pdl:.2f}")
        save_report("bench_tiled_gemm.txt")


if __name__ == "__main__":
    main()
