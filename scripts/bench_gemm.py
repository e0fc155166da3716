"""Benchmark the skinny GEMM (decode linear layers) against cuBLAS (F.linear) on a CUDA GPU (written
for an H200).

    python scripts/bench_gemm.py            # Qwen3-0.6B and -8B linear shapes at M = 1..16 (~20 s)
    python scripts/bench_gemm.py --sweep    # also search launch configs at M = 1 and 8 (~2 min more)
    python scripts/bench_gemm.py --chain    # only 28 layers of Qwen3-0.6B's decode linears, launch variants
    python scripts/bench_gemm.py --swiglu   # only 28 layers of the decode MLP: gate_up + SiLU vs skinny_swiglu
    ... --rows 1,4,16                       # the rows (M) of --sweep, --chain, --swiglu (default 1,8; --chain
                                            # also above 16, its cuBLAS variants)

bf16, y = x [M, K] @ weight [N, K].T. Times are medians of triton.testing.do_bench over CUDA-graph
replays of the one op (GPU time without host launch overhead, as in the engine's decode graphs;
do_bench flushes L2 between runs). TB/s counts the weight bytes (read once; x and y are noise).
The table is printed and, if $OUT is set, written to $OUT/bench_gemm.txt.
"""

import argparse
import contextlib
import dataclasses
import os
import time

import torch
import torch.nn.functional as F
import triton
from gpu_timing import bench, copy_bandwidth, emit, save_report  # scripts/gpu_timing.py

from nanovllm.kernels.gemm import skinny as sg
from nanovllm.layers.activation import silu_and_mul_triton
from nanovllm.layers.layernorm import RMSNorm

DTYPE = torch.bfloat16
DEV = "cuda"
ROWS = (1, 2, 4, 8, 16)
SHAPES = (  # (model, layer, N, K), TP=1
    ("0.6B", "qkv", 4096, 1024), ("0.6B", "o", 1024, 2048), ("0.6B", "gate_up", 6144, 1024),
    ("0.6B", "down", 1024, 3072),
    ("8B", "qkv", 6144, 4096), ("8B", "o", 4096, 4096), ("8B", "gate_up", 24576, 4096), ("8B", "down", 4096, 12288),
)

def inputs(M, N, K):
    x = torch.randn(M, K, dtype=DTYPE, device=DEV)
    weight = torch.randn(N, K, dtype=DTYPE, device=DEV) / K ** 0.5
    return x, weight


def tbps(N, K, ms):
    return N * K * DTYPE.itemsize / (ms * 1e-3) / 1e12


def short(config):
    """block_n/block_k/split_k/num_warps/num_stages"""
    return "/".join(str(v) for v in dataclasses.astuple(config))


def default_row(model, layer, N, K, M, copy_bw):
    x, weight = inputs(M, N, K)
    err = (sg.skinny_linear(x, weight).float() - F.linear(x, weight).float()).abs().max().item()
    t_ref = bench(lambda: F.linear(x, weight))
    t = bench(lambda: sg.skinny_linear(x, weight))
    config = sg.launch_config(N, K, sg.num_sms(x.device), sg.pdl_enabled(x.device), M)
    emit(f"{model:>5} {layer:>8} {N:>6} {K:>6} {M:>3} {t_ref * 1e3:9.2f} {tbps(N, K, t_ref):5.2f} "
         f"{t * 1e3:9.2f} {tbps(N, K, t):5.2f} {100 * tbps(N, K, t) * 1e12 / copy_bw:5.1f} "
         f"{t_ref / t:7.2f} {err:8.1e}  {short(config)}")


def run_default(copy_bw):
    emit(f"== skinny_linear (default launch_config) vs F.linear, bf16; copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    emit(f"{'model':>5} {'layer':>8} {'N':>6} {'K':>6} {'M':>3} {'cublas_us':>9} {'TB/s':>5} {'skinny_us':>9} "
         f"{'TB/s':>5} {'%copy':>5} {'speedup':>7} {'max_err':>8}  config bn/bk/split/warps/stages")
    for model, layer, N, K in SHAPES:
        for M in ROWS:
            default_row(model, layer, N, K, M, copy_bw)


SWEEP_BEST = dict(qkv=dict(split_k=1), gate_up=dict(block_k=64, split_k=1))
# Variants of the chain: the skinny GEMM's per-projection launch overrides (None: cuBLAS), whether the
# Triton kernels use programmatic dependent launch (NANOVLLM_PDL), and whether every layer has the same
# weights ("weights in L2": 31.5 MB, which stay in the H200's 50 MB L2 from the second layer on; the
# bound on what prefetching the weights into L2 could gain, for the skinny GEMM or cuBLAS); cuBLAS through
# cuBLASLt (torch's preferred_blas_library) or from weights stored transposed, [K, N]. Above SKINNY_MAX_ROWS
# rows only the cuBLAS variants run.
CHAIN_VARIANTS = {
    "default": dict(linear={}, pdl=True),
    "no PDL": dict(linear={}, pdl=False),
    "cuBLAS": dict(linear=None, pdl=True),
    "sweep best": dict(linear=SWEEP_BEST, pdl=True),
    "weights in L2": dict(linear={}, pdl=True, one_layer=True),
    "cuBLAS in L2": dict(linear=None, pdl=True, one_layer=True),
    "cuBLASLt": dict(linear=None, pdl=True, blas="cublaslt"),
    "cuBLAS W^T": dict(linear="transposed", pdl=True),
}


@contextlib.contextmanager
def blas_library(name: str | None):
    """torch's preferred BLAS library (cublas or cublaslt) for the block, if name is given."""
    if name is None:
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


@contextlib.contextmanager
def pdl_setting(enabled: bool):
    previous = os.environ.get("NANOVLLM_PDL")
    os.environ["NANOVLLM_PDL"] = "1" if enabled else "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["NANOVLLM_PDL"]
        else:
            os.environ["NANOVLLM_PDL"] = previous


def decode_layers(M, layers, one_layer=False):
    """Qwen3-0.6B's decode linears' weights for `layers` layers (one_layer: the first layer's for all), an
    RMSNorm and an input x0 [M, hidden], seeded: every variant of a chain gets the same."""
    hidden, inter = 1024, 3072
    torch.manual_seed(0)
    weights = [dict(qkv=torch.randn(4096, hidden, dtype=DTYPE, device=DEV) / 32,
                    o=torch.randn(hidden, 2048, dtype=DTYPE, device=DEV) / 45,
                    gate_up=torch.randn(2 * inter, hidden, dtype=DTYPE, device=DEV) / 32,
                    down=torch.randn(hidden, inter, dtype=DTYPE, device=DEV) / 55) for _ in range(layers)]
    if one_layer:
        weights = weights[:1] * layers
    return weights, RMSNorm(hidden).to(DEV, DTYPE), torch.randn(M, hidden, dtype=DTYPE, device=DEV)


def layer_chain(M, layers, overrides, one_layer=False):
    """A function running `layers` of Qwen3-0.6B's decode linears, attention aside: add + RMSNorm, qkv, o,
    add + RMSNorm, gate_up, SiLU-and-mul (one kernel in the engine: see mlp_chain), down; each projection
    by the skinny GEMM with overrides[name] or, with overrides None, by cuBLAS; with overrides "transposed", by
    cuBLAS from weights stored [K, N] (x @ weight_t; one_layer: decode_layers)."""
    weights, norm, x0 = decode_layers(M, layers, one_layer)
    attn_out = torch.randn(M, 2048, dtype=DTYPE, device=DEV)
    transposed = {id(w): w.t().contiguous() for layer in weights for w in layer.values()} \
        if overrides == "transposed" else {}

    def linear(name, x, weight):
        if overrides is None:
            return F.linear(x, weight)
        if overrides == "transposed":
            return x @ transposed[id(weight)]
        return sg.skinny_linear(x, weight, **overrides.get(name, {}))

    def run():
        x, residual = x0, x0
        for w in weights:
            h, residual = norm(x, residual)
            linear("qkv", h, w["qkv"])  # attention aside: o_proj reads a fixed attention output
            x = linear("o", attn_out, w["o"])
            h, residual = norm(x, residual)
            x = linear("down", silu_and_mul_triton(linear("gate_up", h, w["gate_up"])), w["down"])
        return x

    return run


def run_chain(rows):
    layers = 28
    emit(f"== {layers} layers of Qwen3-0.6B decode linears + norms + SiLU (attention aside), one CUDA graph; "
         "us per layer")
    emit(f"{'M':>3} " + " ".join(f"{name:>13}" for name in CHAIN_VARIANTS))
    for M in rows:
        times = []
        for variant in CHAIN_VARIANTS.values():
            if isinstance(variant["linear"], dict) and M > sg.SKINNY_MAX_ROWS:
                times.append(None)  # the skinny GEMM takes at most SKINNY_MAX_ROWS rows
                continue
            with pdl_setting(variant["pdl"]), blas_library(variant.get("blas")):
                chain = layer_chain(M, layers, variant["linear"], variant.get("one_layer", False))
                times.append(bench(chain) * 1e3 / layers)
        emit(f"{M:>3} " + " ".join(f"{t:13.2f}" if t is not None else f"{'-':>13}" for t in times))
    # The same kernels launched with and without PDL must agree bit for bit, eagerly and from a graph. Both take
    # the launch configurations of PDL (without it down_proj splits K in another count, which changes its bits).
    sms = sg.num_sms(torch.device(DEV))
    for M in (1, 8):
        with_pdl = {layer: dataclasses.asdict(sg.launch_config(N, K, sms, pdl=True, rows=M))
                    for model, layer, N, K in SHAPES if model == "0.6B"}
        with pdl_setting(False):
            expected = layer_chain(M, layers, with_pdl)()
        with pdl_setting(True):
            chain = layer_chain(M, layers, with_pdl)
            eager = chain()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = chain()
            graph.replay()
        emit(f"M={M}: with PDL equal to without: eager {torch.equal(eager, expected)}, "
             f"graph {torch.equal(replayed, expected)}")


# skinny_swiglu configs (block_n, block_k, num_warps, num_stages) against gate_up + SiLU-and-mul
SWIGLU_CONFIGS = [(16, 128, 4, 4), (16, 256, 4, 3), (16, 256, 4, 4), (16, 256, 2, 4), (16, 128, 2, 4),
                  (32, 256, 4, 3), (16, 512, 4, 2), (32, 128, 4, 4)]


def mlp_chain(M, layers, swiglu_config):
    """`layers` of Qwen3-0.6B's decode MLP as the engine runs it: add + RMSNorm, then gate_up (summed) + SiLU-and-mul
    (swiglu_config None) or skinny_swiglu with that (block_n, block_k, num_warps, num_stages), then down."""
    weights, norm, x0 = decode_layers(M, layers)

    def run():
        x, residual = x0, x0
        for w in weights:
            h, residual = norm(x, residual)
            if swiglu_config == "cuBLAS":
                x = F.linear(silu_and_mul_triton(F.linear(h, w["gate_up"])), w["down"])
                continue
            if swiglu_config is None:
                act = silu_and_mul_triton(sg.skinny_linear(h, w["gate_up"]))
            elif swiglu_config == "default":
                act = sg.skinny_swiglu(h, w["gate_up"])
            else:
                bn, bk, warps, stages = swiglu_config
                act = sg.skinny_swiglu(h, w["gate_up"], block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
            x = sg.skinny_linear(act, w["down"], defer_sum=True)
        return x

    return run


def run_swiglu(rows):
    layers = 28
    emit(f"== {layers} layers of Qwen3-0.6B's decode MLP (norm, gate_up + SiLU or skinny_swiglu, down), one CUDA "
         "graph, PDL as configured; us per layer")
    for M in rows:
        unfused = bench(mlp_chain(M, layers, None)) * 1e3 / layers
        cublas = bench(mlp_chain(M, layers, "cuBLAS")) * 1e3 / layers
        default = bench(mlp_chain(M, layers, "default")) * 1e3 / layers
        fused = {config: bench(mlp_chain(M, layers, config)) * 1e3 / layers for config in SWIGLU_CONFIGS}
        emit(f"M={M}: cuBLAS {cublas:.2f}; gate_up + SiLU {unfused:.2f}; skinny_swiglu default {default:.2f}, "
             + "  ".join(f"{'/'.join(map(str, c))}:{t:.2f}"
                         for c, t in sorted(fused.items(), key=lambda item: item[1])))


TILES = [(bn, bk) for bn in (16, 32, 64, 128) for bk in (64, 128, 256, 512)
         if 4096 <= bn * bk * DTYPE.itemsize <= 65536]  # 4..64 KiB weight tiles


def sweep_shape(model, layer, N, K, M):
    """Coordinate search from the default: tile (bn, bk), then split_k, then (num_warps, num_stages)."""
    x, weight = inputs(M, N, K)
    expected = F.linear(x, weight)
    default = sg.launch_config(N, K, sg.num_sms(x.device), sg.pdl_enabled(x.device), M)
    results = {}  # config -> milliseconds, or why it has none

    def time_config(config):
        if config in results:
            return
        kwargs = dataclasses.asdict(config)
        try:
            if not torch.allclose(sg.skinny_linear(x, weight, **kwargs), expected, rtol=1.6e-2, atol=1e-3):
                results[config] = "wrong result"
                return
            results[config] = bench(lambda: sg.skinny_linear(x, weight, **kwargs), quick=True)
        except Exception as e:  # e.g. out of shared memory
            results[config] = type(e).__name__

    def best():
        return min((c for c, v in results.items() if isinstance(v, float)), key=results.get, default=default)

    time_config(default)
    for bn, bk in TILES:
        time_config(dataclasses.replace(default, block_n=bn, block_k=bk))
    tile = best()
    for split_k in (1, 2, 4, 8):
        time_config(dataclasses.replace(tile, split_k=split_k))
    split = best()
    for warps in (4, 8):
        for stages in (2, 3, 4):
            time_config(dataclasses.replace(split, num_warps=warps, num_stages=stages))
    ranked = sorted(((v, c) for c, v in results.items() if isinstance(v, float)), key=lambda vc: vc[0])
    t_default = results[default]
    emit(f"{model} {layer} N={N} K={K} M={M}: default {short(default)} "
         + (f"{t_default * 1e3:.2f} us {tbps(N, K, t_default):.2f} TB/s" if isinstance(t_default, float)
            else t_default))
    emit("   top: " + "  ".join(f"{short(c)}:{v * 1e3:.2f}us/{tbps(N, K, v):.2f}" for v, c in ranked[:5]))
    failed = [f"{short(c)}: {v}" for c, v in results.items() if not isinstance(v, float)]
    if failed:
        emit(f"   failed: {failed}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also search launch configs at M = 1 and 8")
    parser.add_argument("--chain", action="store_true",
                        help="only time 28 layers of decode linears under launch variants")
    parser.add_argument("--swiglu", action="store_true",
                        help="only time 28 layers of the decode MLP: gate_up + SiLU against skinny_swiglu configs")
    parser.add_argument("--rows", type=lambda s: [int(m) for m in s.split(",")], default=[1, 8],
                        help="rows of --sweep and --swiglu (M <= 16) and of --chain, comma-separated "
                             "(default 1,8)")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    start = time.time()
    torch.manual_seed(0)
    emit(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    if args.swiglu:
        run_swiglu(args.rows)
        save_report("bench_gemm.txt")
        return
    if args.chain:
        run_chain(args.rows)
        save_report("bench_gemm.txt")
        return
    run_default(copy_bandwidth())
    if args.sweep:
        emit("== sweep: config bn/bk/split/warps/stages: us/TB/s (medians), top 5 of a coordinate search")
        for model, layer, N, K in SHAPES:
            for M in args.rows:
                sweep_shape(model, layer, N, K, M)
    emit(f"total {time.time() - start:.0f} s")
    save_report("bench_gemm.txt")


if __name__ == "__main__":
    main()
