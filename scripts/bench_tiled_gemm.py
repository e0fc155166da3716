"""Can a tiled Triton GEMM beat cuBLAS on Qwen3-0.6B's projections at 64-256 rows (decode of large batches)?

    python scripts/bench_tiled_gemm.py                    # M = 64, 128, 256 (~30 s on an H200)
    python scripts/bench_tiled_gemm.py --rows 128,256

At 256 rows the four projections take ~28 us a layer under cuBLAS against ~12 for their FLOPs and weight bytes
(BENCHMARKS.md, thirtieth session), each GEMM under one wave of its tiles. This times, for each projection and M,
cuBLAS (F.linear) and a plain tiled kernel (x [M, K] @ weight [N, K]^T, float32 accumulation, tiles of BLOCK_M x
BLOCK_N, K optionally split with the skinny GEMM's reduce kernel summing the partials) over a grid of tiles, then
28 layers of the four projections in one CUDA graph with each projection's best tile against cuBLAS. The engine's
skinny GEMM (skinny_gemm.py) lays its tiles out for few rows; this kernel is the textbook layout, kept here until it
wins. Times: medians of replays of a CUDA graph, L2 flushed between (scripts/gpu_timing.py). Report under $OUT.
"""

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from bench_gemm import SHAPES  # scripts/bench_gemm.py
from gpu_timing import bench, emit, save_report  # scripts/gpu_timing.py

from nanovllm.layers import skinny_gemm as sg

DTYPE = torch.bfloat16
PROJECTIONS = {layer: (N, K) for model, layer, N, K in SHAPES if model == "0.6B"}
# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K); 8 warps from 128 x 128 tiles, else 4; 3 stages at BLOCK_K 128, else 4.
TILES = list(itertools.product((64, 128), (64, 128), (64, 128), (1, 2, 4)))


@triton.jit
def _tiled_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, k_per_split, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), SPLIT_K). The programs of one weight tile are consecutive, so
    its other row tiles read it from L2. SPLIT_K 1: out is y [M, N] in x's dtype; else float32 partials
    [SPLIT_K, M, N]. K is a multiple of BLOCK_K * SPLIT_K's tiles (no mask along K)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % tiles_m, pid // tiles_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * k_per_split + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]  # [BLOCK_K, BLOCK_N] of weight^T
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        x = tl.load(x_ptrs + k, mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptrs + k, mask=n_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc)
    out = out_ptr + tl.program_id(1) * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, tile: tuple[int, int, int, int]) -> torch.Tensor:
    """F.linear(x, weight) by _tiled_kernel with tile (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)."""
    block_m, block_n, block_k, split_k = tile
    M, K = x.shape
    N = weight.shape[0]
    assert K % (block_k * split_k) == 0, (K, tile)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    out = y if split_k == 1 else torch.empty(split_k, M, N, dtype=torch.float32, device=x.device)
    _tiled_kernel[(triton.cdiv(M, block_m) * triton.cdiv(N, block_n), split_k)](
        x, weight, out, M, N, K, x.stride(0), K // split_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=3 if block_k == 128 else 4)
    if split_k > 1:
        sg._reduce(out, None, y)
    return y


def best_tiles(M: int) -> dict[str, tuple]:
    """Each projection's fastest tile at M rows, its time against cuBLAS's emitted."""
    best = {}
    for name, (N, K) in PROJECTIONS.items():
        x = torch.randn(M, K, dtype=DTYPE, device="cuda")
        weight = torch.randn(N, K, dtype=DTYPE, device="cuda") / K ** 0.5
        expected = F.linear(x, weight)
        cublas = bench(lambda x=x, weight=weight: F.linear(x, weight), quick=True)
        times = {}
        for tile in TILES:
            if K % (tile[2] * tile[3]) or tile[0] > M:
                continue
            got = tiled_linear(x, weight, tile)
            if not torch.allclose(got, expected, rtol=1.6e-2, atol=1e-2):
                emit(f"   {name} M={M} {tile}: wrong result, max error {(got - expected).abs().max().item():.3g}")
                continue
            times[tile] = bench(lambda x=x, weight=weight, tile=tile: tiled_linear(x, weight, tile), quick=True)
        ranked = sorted(times, key=times.get)
        best[name] = ranked[0]
        emit(f"M={M:>3} {name:>7} N={N} K={K}: cuBLAS {cublas * 1e3:6.2f} us; tiled best "
             + "  ".join(f"{'/'.join(map(str, t))}:{times[t] * 1e3:.2f}" for t in ranked[:4]))
    return best


def chain(M: int, tiles: dict[str, tuple] | None, layers: int):
    """`layers` layers of the four projections (their inputs fixed; each layer its own weights), by cuBLAS (tiles
    None) or by the tiled kernel with each projection's tile."""
    torch.manual_seed(0)
    weights = [{name: torch.randn(N, K, dtype=DTYPE, device="cuda") / K ** 0.5
                for name, (N, K) in PROJECTIONS.items()} for _ in range(layers)]
    inputs = {name: torch.randn(M, K, dtype=DTYPE, device="cuda") for name, (N, K) in PROJECTIONS.items()}

    def run():
        for layer in weights:
            for name, weight in layer.items():
                if tiles is None:
                    F.linear(inputs[name], weight)
                else:
                    tiled_linear(inputs[name], weight, tiles[name])

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=lambda s: [int(m) for m in s.split(",")], default=[64, 128, 256])
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    emit(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    emit("== tile BLOCK_M/BLOCK_N/BLOCK_K/SPLIT_K: us (one GEMM, medians)")
    for M in args.rows:
        tiles, layers = best_tiles(M), 28
        cublas = bench(chain(M, None, layers)) * 1e3 / layers
        tiled = bench(chain(M, tiles, layers)) * 1e3 / layers
        emit(f"M={M:>3} chain of {layers} layers, the four projections, us a layer: cuBLAS {cublas:.2f}, tiled "
             f"{tiled:.2f} ({cublas / tiled:.2f}x)")
        save_report("bench_tiled_gemm.txt")


if __name__ == "__main__":
    main()
