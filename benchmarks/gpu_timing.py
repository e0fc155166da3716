"""GPU timing for the kernel benchmarks: CUDA-graph replays, copy bandwidth, a saved report."""

import os
import pathlib

import torch
from triton.testing import do_bench

LINES = []


def emit(line=""):
    print(line, flush=True)
    LINES.append(line)


def save_report(name: str):
    """Everything emitted to $OUT/name, if $OUT is set."""
    if os.environ.get("OUT"):
        pathlib.Path(os.environ["OUT"], name).write_text("\n".join(LINES) + "\n")


def bench(fn, quick=False):
    """Median ms of fn replayed from a CUDA graph (eager if capture fails), L2 flushed first."""
    warmup, rep = (5, 25) if quick else (25, 100)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:
        emit(f"(CUDA graph capture failed, timing eagerly: {type(e).__name__}: {e})"[:200])
        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    return do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth():
    """Device-to-device copy, bytes read + written per second (eager: a captured copy is slower)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / (do_bench(lambda: y.copy_(x), return_mode="median") * 1e-3)
