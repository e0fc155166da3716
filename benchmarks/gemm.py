"""The skinny GEMM (decode linears) against cuBLAS (F.linear), bf16, y = x [M, K] @ W [N, K].T.

    python -m benchmarks.gemm             # Qwen3-0.6B and -8B linear shapes at M = 1..16
    python -m benchmarks.gemm --sweep     # also search launch configs at --rows (default 1,8)
    python -m benchmarks.gemm --chain     # only 28 layers of decode linears, launch variants
    python -m benchmarks.gemm --swiglu    # only 28 decode MLPs: gate_up + SiLU vs skinny_swiglu
    ... --rows 1,4,16                     # the rows of --sweep, --chain, --swiglu
"""

import argparse
import contextlib
import dataclasses
import os
import time

import torch
import torch.nn.functional as F
import triton

from benchmarks.gpu_timing import bench, copy_bandwidth, emit, save_report
from nanovllm.kernels.activation import silu_and_mul_triton
from nanovllm.kernels.device import num_sms, pdl_enabled
from nanovllm.kernels.gemm import skinny as sg
from nanovllm.layers.layernorm import RMSNorm

DTYPE = torch.bfloat16
DEV = "cuda"
ROWS = (1, 2, 4, 8, 16)
SHAPES = (  # (model, layer, N, K), TP=1
    ("0.6B", "qkv", 4096, 1024), ("0.6B", "o", 1024, 2048), ("0.6B", "gate_up", 6144, 1024),
    ("0.6B", "down", 1024, 3072),
    ("8B", "qkv", 6144, 4096), ("8B", "o", 4096, 4096), ("8B", "gate_up", 24576, 4096),
    ("8B", "down", 4096, 12288),
)
LAYERS = 28


def inputs(M, N, K):
    x = torch.randn(M, K, dtype=DTYPE, device=DEV)
    weight = torch.randn(N, K, dtype=DTYPE, device=DEV) / K ** 0.5
    return x, weight


def tbps(N, K, ms):
    """Weight bytes read a second, in TB/s (x and y are noise)."""
    return N * K * DTYPE.itemsize / (ms * 1e-3) / 1e12


def short(config):
    """block_n/block_k/split_k/num_warps/num_stages"""
    return "/".join(str(v) for v in dataclasses.astuple(config))


def default_row(model, layer, N, K, M, copy_bw):
    x, weight = inputs(M, N, K)
    err = (sg.skinny_linear(x, weight).float() - F.linear(x, weight).float()).abs().max().item()
    t_ref = bench(lambda: F.linear(x, weight))
    t = bench(lambda: sg.skinny_linear(x, weight))
    config = sg.launch_config(N, K, num_sms(x.device), pdl_enabled(x.device), M)
    emit(f"{model:>5} {layer:>8} {N:>6} {K:>6} {M:>3} {t_ref * 1e3:9.2f} {tbps(N, K, t_ref):5.2f} "
         f"{t * 1e3:9.2f} {tbps(N, K, t):5.2f} {100 * tbps(N, K, t) * 1e12 / copy_bw:5.1f} "
         f"{t_ref / t:7.2f} {err:8.1e}  {short(config)}")


def run_default(copy_bw):
    emit(f"== skinny_linear (default launch_config) vs F.linear, bf16; "
         f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    emit(f"{'model':>5} {'layer':>8} {'N':>6} {'K':>6} {'M':>3} {'cublas_us':>9} {'TB/s':>5} "
         f"{'skinny_us':>9} {'TB/s':>5} {'%copy':>5} {'speedup':>7} {'max_err':>8}  "
         f"config bn/bk/split/warps/stages")
    for model, layer, N, K in SHAPES:
        for M in ROWS:
            default_row(model, layer, N, K, M, copy_bw)


SWEEP_BEST = dict(qkv=dict(split_k=1), gate_up=dict(block_k=64, split_k=1))
# Chain variants: the skinny GEMM's launch overrides by projection (None: cuBLAS; "transposed":
# cuBLAS from weights stored [K, N]), PDL on or off, one layer's weights for all (they stay in L2:
# the bound on what prefetching weights could gain), and cuBLASLt as torch's BLAS library.
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
    """Seeded weights of Qwen3-0.6B's decode linears for `layers` layers (one_layer: the first's for
    all), an RMSNorm and an input x0 [M, hidden]: every variant of a chain gets the same."""
    hidden, inter = 1024, 3072
    torch.manual_seed(0)
    weights = [dict(qkv=torch.randn(4096, hidden, dtype=DTYPE, device=DEV) / 32,
                    o=torch.randn(hidden, 2048, dtype=DTYPE, device=DEV) / 45,
                    gate_up=torch.randn(2 * inter, hidden, dtype=DTYPE, device=DEV) / 32,
                    down=torch.randn(hidden, inter, dtype=DTYPE, device=DEV) / 55)
               for _ in range(layers)]
    if one_layer:
        weights = weights[:1] * layers
    return weights, RMSNorm(hidden).to(DEV, DTYPE), torch.randn(M, hidden, dtype=DTYPE, device=DEV)


def layer_chain(M, layers, overrides, one_layer=False):
    """`layers` of Qwen3-0.6B's decode linears, attention aside (o reads a fixed input): norm, qkv,
    o, norm, gate_up, SiLU-and-mul, down; projections as CHAIN_VARIANTS' `linear` says."""
    weights, norm, x0 = decode_layers(M, layers, one_layer)
    attn_out = torch.randn(M, 2048, dtype=DTYPE, device=DEV)
    transposed = {}
    if overrides == "transposed":
        transposed = {id(w): w.t().contiguous() for layer in weights for w in layer.values()}

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
            linear("qkv", h, w["qkv"])
            x = linear("o", attn_out, w["o"])
            h, residual = norm(x, residual)
            x = linear("down", silu_and_mul_triton(linear("gate_up", h, w["gate_up"])), w["down"])
        return x

    return run


def check_pdl_is_exact():
    """The same kernels with and without PDL agree bit for bit, eagerly and from a graph (both at
    PDL's launch configs: without PDL, down splits K differently)."""
    sms = num_sms(torch.device(DEV))
    for M in (1, 8):
        with_pdl = {layer: dataclasses.asdict(sg.launch_config(N, K, sms, pdl=True, rows=M))
                    for model, layer, N, K in SHAPES if model == "0.6B"}
        with pdl_setting(False):
            expected = layer_chain(M, LAYERS, with_pdl)()
        with pdl_setting(True):
            chain = layer_chain(M, LAYERS, with_pdl)
            eager = chain()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = chain()
            graph.replay()
        emit(f"M={M}: with PDL equal to without: eager {torch.equal(eager, expected)}, "
             f"graph {torch.equal(replayed, expected)}")


def run_chain(rows):
    emit(f"== {LAYERS} layers of Qwen3-0.6B decode linears + norms + SiLU (attention aside), "
         "one CUDA graph; us per layer")
    emit(f"{'M':>3} " + " ".join(f"{name:>13}" for name in CHAIN_VARIANTS))
    for M in rows:
        times = []
        for variant in CHAIN_VARIANTS.values():
            if isinstance(variant["linear"], dict) and M > sg.SKINNY_MAX_ROWS:
                times.append(None)
                continue
            with pdl_setting(variant["pdl"]), blas_library(variant.get("blas")):
                chain = layer_chain(M, LAYERS, variant["linear"], variant.get("one_layer", False))
                times.append(bench(chain) * 1e3 / LAYERS)
        emit(f"{M:>3} " + " ".join(f"{t:13.2f}" if t is not None else f"{'-':>13}" for t in times))
    check_pdl_is_exact()


# skinny_swiglu configs (block_n, block_k, num_warps, num_stages)
SWIGLU_CONFIGS = [(16, 128, 4, 4), (16, 256, 4, 3), (16, 256, 4, 4), (16, 256, 2, 4),
                  (16, 128, 2, 4), (32, 256, 4, 3), (16, 512, 4, 2), (32, 128, 4, 4)]


def mlp_chain(M, layers, swiglu_config):
    """`layers` of Qwen3-0.6B's decode MLP: norm, then gate_up + SiLU-and-mul (swiglu_config None,
    or "cuBLAS") or skinny_swiglu ("default", or a config of SWIGLU_CONFIGS), then down."""
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
                act = sg.skinny_swiglu(h, w["gate_up"], block_n=bn, block_k=bk, num_warps=warps,
                                       num_stages=stages)
            x = sg.skinny_linear(act, w["down"], defer_sum=True)
        return x

    return run


def mlp_us(M, swiglu_config):
    return bench(mlp_chain(M, LAYERS, swiglu_config)) * 1e3 / LAYERS


def run_swiglu(rows):
    emit(f"== {LAYERS} layers of Qwen3-0.6B's decode MLP (norm, gate_up + SiLU or skinny_swiglu, "
         "down), one CUDA graph, PDL as configured; us per layer")
    for M in rows:
        unfused, cublas, default = (mlp_us(M, config) for config in (None, "cuBLAS", "default"))
        fused = {config: mlp_us(M, config) for config in SWIGLU_CONFIGS}
        emit(f"M={M}: cuBLAS {cublas:.2f}; gate_up + SiLU {unfused:.2f}; skinny_swiglu default "
             f"{default:.2f}, " + "  ".join(f"{'/'.join(map(str, c))}:{t:.2f}"
                                            for c, t in sorted(fused.items(), key=lambda i: i[1])))


TILES = [(bn, bk) for bn in (16, 32, 64, 128) for bk in (64, 128, 256, 512)
         if 4096 <= bn * bk * DTYPE.itemsize <= 65536]  # 4..64 KiB weight tiles


def search_configs(x, weight, default):
    """Coordinate search from the default: tile (bn, bk), then split_k, then (num_warps,
    num_stages). Returns config -> milliseconds, or why it has none."""
    expected = F.linear(x, weight)
    results = {}

    def time_config(config):
        if config in results:
            return
        kwargs = dataclasses.asdict(config)
        try:
            got = sg.skinny_linear(x, weight, **kwargs)
            if not torch.allclose(got, expected, rtol=1.6e-2, atol=1e-3):
                results[config] = "wrong result"
                return
            results[config] = bench(lambda: sg.skinny_linear(x, weight, **kwargs), quick=True)
        except Exception as e:  # e.g. out of shared memory
            results[config] = type(e).__name__

    def best():
        timed = (c for c, v in results.items() if isinstance(v, float))
        return min(timed, key=results.get, default=default)

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
    return results


def sweep_shape(model, layer, N, K, M):
    x, weight = inputs(M, N, K)
    default = sg.launch_config(N, K, num_sms(x.device), pdl_enabled(x.device), M)
    results = search_configs(x, weight, default)
    ranked = sorted(((v, c) for c, v in results.items() if isinstance(v, float)),
                    key=lambda vc: vc[0])
    t_default = results[default]
    if isinstance(t_default, float):
        t_default = f"{t_default * 1e3:.2f} us {tbps(N, K, t_default):.2f} TB/s"
    emit(f"{model} {layer} N={N} K={K} M={M}: default {short(default)} {t_default}")
    emit("   top: " + "  ".join(f"{short(c)}:{v * 1e3:.2f}us/{tbps(N, K, v):.2f}"
                                for v, c in ranked[:5]))
    failed = [f"{short(c)}: {v}" for c, v in results.items() if not isinstance(v, float)]
    if failed:
        emit(f"   failed: {failed}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also search launch configs")
    parser.add_argument("--chain", action="store_true",
                        help="only time 28 layers of decode linears under launch variants")
    parser.add_argument("--swiglu", action="store_true",
                        help="only time 28 decode MLPs: gate_up + SiLU against skinny_swiglu")
    parser.add_argument("--rows", type=lambda s: [int(m) for m in s.split(",")], default=[1, 8],
                        help="rows of --sweep, --swiglu and --chain, comma-separated (default 1,8)")
    return parser.parse_args()


def main():
    args = parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    start = time.time()
    torch.manual_seed(0)
    emit(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    if args.swiglu or args.chain:
        (run_swiglu if args.swiglu else run_chain)(args.rows)
        save_report("bench_gemm.txt")
        return
    run_default(copy_bandwidth())
    if args.sweep:
        emit("== sweep: config bn/bk/split/warps/stages: us/TB/s (medians), top 5 of a "
             "coordinate search")
        for model, layer, N, K in SHAPES:
            for M in args.rows:
                sweep_shape(model, layer, N, K, M)
    emit(f"total {time.time() - start:.0f} s")
    save_report("bench_gemm.txt")


if __name__ == "__main__":
    main()
