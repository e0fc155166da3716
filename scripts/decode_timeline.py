"""Where a decode step's attention kernel spends its time, program by program: the engine's own run (CUDA
graphs, PDL, the kernels around it) with a copy of the Triton decode kernel that reads the GPU's global timer
(%globaltimer, ns) at five points of each program and stores them with its SM. The copy is built here, from
nanovllm/layers/triton_decode.py's source with the timer lines inserted, and replaces the engine's kernel for
this run only, so the engine's code carries no instrumentation.

    PYTHONPATH=. python scripts/decode_timeline.py --kv-cache-dtype fp8 --batch 8 --prompt-len 1000 --new-tokens 512
    PYTHONPATH=. python scripts/decode_timeline.py --kv-cache-dtype fp8 --batch 256 --ragged 100-1024 --new-tokens 64

Every request samples --new-tokens tokens (ignore_eos), so the run's last step is a decode step of the whole
batch; a graph replay overwrites the timeline, so what is read afterwards is that step's last layer. Its
contexts: each prompt's length plus new_tokens - 1. The points of a program:
  start    it began (with PDL: while the kernel before it, the qkv projection, still runs)
  wait     gdc_wait returned: the kernel before it finished and its writes are visible
  q        q is computed (from the qkv projection) and, in the program holding the newest key, its K/V stored
  loop     its tiles of K/V are done (the partial softmax in registers)
  end      its partials and split count are stored; the last split to arrive has merged them
Printed: the phases' durations over programs (percentiles), the kernel's span from the first wait to the last
end, and how many programs are busy in each slice of it. Saved to $OUT/decode_timeline.txt too, the records to
$OUT/decode_timeline_b<batch>.npy.

H200, thirty-fifth session (BENCHMARKS.md): at 8 streams a program with 2 tiles took ~8 µs from the wait to
its end alone on an SM and ~12 µs with three others. With the grid's split index slowest, 88 of 132 SMs got
four such programs and 21 only empty splits, so the engine's grid now has the split index fastest. At batch
256 every SM stays busy to the last ~5 µs of the ~97: no tail to take.
"""

import argparse
import importlib.util
import inspect
import os
import pathlib
import random
import sys
import tempfile

import numpy as np
import torch
from gpu_timing import emit, save_report  # scripts/gpu_timing.py

from bench import resolve_model  # bench.py at the repository root
from nanovllm import LLM, SamplingParams
from nanovllm.config import head_dim as config_head_dim
from nanovllm.kernels.attention import decode as triton_decode

FIELDS = ("start", "wait", "q", "loop", "end", "smid", "seq", "split", "kv_head", "ctx", "merged")
WIDTH = 16  # int64 slots a program's record takes

TIMER_HELPERS = '''

@triton.jit
def _timer():
    """The GPU's global timer, ns."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _timer_after(x):
    """The timer, read by each thread once its elements of x exist (x's bits are the asm's input)."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [bits], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _store_first(ptr, values):
    """Store values' first element (of a 2-D tensor) at ptr: one thread's store, no reduction."""
    r = tl.arange(0, values.shape[0])[:, None]
    c = tl.arange(0, values.shape[1])[None, :]
    tl.store(ptr + r * 0 + c * 0, values, mask=(r == 0) & (c == 0))
'''

# (text of triton_decode.py, what replaces it): each must occur exactly once
EDITS = (
    ("    NUM_KV_HEADS: tl.constexpr,\n):", "    NUM_KV_HEADS: tl.constexpr, timeline_ptr,\n):"),
    ("    if PDL:\n        tl.extra.cuda.gdc_launch_dependents()\n",
     "    _rec = timeline_ptr + ((tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0)\n"
     f"                           + tl.program_id(0)).to(tl.int64) * {WIDTH}\n"
     "    tl.store(_rec + 0, _timer())\n"
     "    tl.store(_rec + 10, 0)\n"
     "    if PDL:\n        tl.extra.cuda.gdc_launch_dependents()\n"),
    ("\n    g = tl.arange(0, G_PAD)\n",
     "\n    tl.store(_rec + 1, _timer())\n"
     "    tl.store(_rec + 5, tl.inline_asm_elementwise('mov.u32 $0, %smid;', '=r', [], dtype=tl.int32, "
     "is_pure=True, pack=1).to(tl.int64))\n"
     "    tl.store(_rec + 6, seq.to(tl.int64))\n"
     "    tl.store(_rec + 7, split.to(tl.int64))\n"
     "    tl.store(_rec + 8, kv_head.to(tl.int64))\n"
     "    tl.store(_rec + 9, ctx.to(tl.int64))\n"
     "    g = tl.arange(0, G_PAD)\n"),
    ("    if FP8:\n        q = q.to(FP8_COMPUTE)\n",
     "    _store_first(_rec + 2, _timer_after(q))\n"
     "    if FP8:\n        q = q.to(FP8_COMPUTE)\n"),
    ("    if FP8:\n        acc = tl.trans(acc_t)\n",
     "    if FP8:\n        acc = tl.trans(acc_t)\n"
     "    _store_first(_rec + 3, _timer_after(acc))\n"),
    ("                tl.store(count_ptr, 0)\n",
     "                tl.store(count_ptr, 0)\n"
     "                tl.store(_rec + 10, 1)\n"),
    ("\n\n# The decode kernel prefetches its first tile",
     "\n    tl.store(_rec + 4, _timer())\n\n\n# The decode kernel prefetches its first tile"),
)


def instrumented_kernel():
    """_decode_kernel of triton_decode.py with the timer lines, from a module written to a temporary file
    (Triton reads a kernel's source from its file)."""
    source = inspect.getsource(triton_decode)
    for old, new in EDITS:
        if source.count(old) != 1:
            raise RuntimeError(f"triton_decode.py changed: {old!r} occurs {source.count(old)} times, not once")
        source = source.replace(old, new)
    first_kernel = "\n\n@triton.jit\ndef _prefetch_runs"
    source = source.replace(first_kernel, TIMER_HELPERS + first_kernel, 1)
    path = pathlib.Path(tempfile.mkdtemp()) / "triton_decode_timeline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("triton_decode_timeline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module._decode_kernel


class TimedKernel:
    """Stands in for triton_decode._decode_kernel: launches the instrumented copy with the timeline buffer
    (allocated before any graph is captured, for grids of up to MAX_PROGRAMS programs). Replays do not pass
    through here, so it keeps the grid of each batch size launched (a graph's, where one was captured)."""

    MAX_PROGRAMS = 1 << 16

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, {}
        self.timeline = torch.zeros(self.MAX_PROGRAMS, WIDTH, dtype=torch.int64, device="cuda")

    def __getitem__(self, grid):
        if grid[0] * grid[1] * grid[2] > self.MAX_PROGRAMS:
            raise ValueError(f"grid {grid} has more than {self.MAX_PROGRAMS} programs")

        def launch(*args, **kwargs):
            self.grids[args[6].shape[0]] = grid  # by batch size: context_lens [B] is the kernel's 7th argument
            return self.kernel[grid](*args, timeline_ptr=self.timeline, **kwargs)
        return launch


def percentiles(values: np.ndarray) -> str:
    p = np.percentile(values, [0, 10, 50, 90, 100])
    return " / ".join(f"{x:6.2f}" for x in p)


def split_tiles(ctx: np.ndarray, split: np.ndarray, num_splits: int, block_n: int) -> np.ndarray:
    """Tiles of each program's split, as _decode_kernel divides a context (whole tiles a split)."""
    def cdiv(a, b):
        return -(-a // b)

    per_split = cdiv(cdiv(ctx, num_splits), block_n) * block_n
    start = split * per_split
    return np.maximum(0, cdiv(np.minimum(start + per_split, ctx) - start, block_n))


def report(records: np.ndarray, num_splits: int, block_n: int):
    rec = {name: records[:, i] for i, name in enumerate(FIELDS)}
    tiles = split_tiles(rec["ctx"], rec["split"], num_splits, block_n)
    origin = rec["wait"].min()
    us = {name: (rec[name] - origin) / 1e3 for name in ("start", "wait", "q", "loop", "end")}
    busy = rec["ctx"] > 0
    emit(f"{len(records)} programs ({busy.sum()} with a context), on {len(np.unique(rec['smid']))} SMs; "
         f"times in µs from the first wait's return")
    emit(f"kernel: first start {us['start'].min():.2f}, last wait {us['wait'].max():.2f}, "
         f"last end {us['end'].max():.2f} (span from the first wait {us['end'].max():.2f})")
    emit("phase (µs)                min / p10 / median / p90 / max over programs")
    for name, a, b in (("start -> wait", "start", "wait"), ("wait -> q", "wait", "q"), ("q -> loop", "q", "loop"),
                       ("loop -> end", "loop", "end")):
        emit(f"  {name:22s} {percentiles(us[b] - us[a])}")
    merged = rec["merged"] == 1
    for label, mask in (("merging", merged), ("not merging", ~merged)):
        if mask.any():
            emit(f"  loop -> end, {label:11s} {percentiles(us['end'][mask] - us['loop'][mask])}  ({mask.sum()})")
    for n in np.unique(tiles):
        emit(f"  q -> loop, {n:2d} tile(s)  {percentiles(us['loop'][tiles == n] - us['q'][tiles == n])}"
             f"  ({(tiles == n).sum()})")
    for name in ("wait", "q", "loop", "end"):
        emit(f"  at {name:6s} (from first wait) {percentiles(us[name])}")
    span = us["end"].max()
    edges = np.linspace(0, span, 21)
    emit("programs between wait and end, by twentieth of the span (after the first wait):")
    counts = [int(((us["wait"] <= t) & (us["end"] > t)).sum()) for t in edges[:-1]]
    emit("  " + " ".join(f"{c}" for c in counts))
    emit("SMs with a program between wait and end, same slices:")
    sms = [len(np.unique(rec["smid"][(us["wait"] <= t) & (us["end"] > t)])) for t in edges[:-1]]
    emit("  " + " ".join(f"{c}" for c in sms))
    last = int(np.argmax(us["end"]))
    on_its_sm = rec["smid"] == rec["smid"][last]
    emit(f"the last to end: seq {rec['seq'][last]}, split {rec['split'][last]}, kv head {rec['kv_head'][last]}, "
         f"context {rec['ctx'][last]}, {tiles[last]} tile(s), merged {rec['merged'][last]}; its SM ran "
         f"{on_its_sm.sum()} programs, {tiles[on_its_sm].sum()} tiles")
    per_sm = np.bincount(rec["smid"], weights=tiles)
    used = per_sm[np.unique(rec["smid"])]
    emit(f"tiles an SM: min {used.min():.0f}, median {np.median(used):.0f}, max {used.max():.0f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtype", default="fp8", choices=["auto", "fp8"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--ragged", default=None, help="LO-HI: prompt lengths uniform in [LO, HI] instead")
    parser.add_argument("--new-tokens", type=int, default=512)
    args = parser.parse_args()
    timed = TimedKernel(instrumented_kernel())
    triton_decode._decode_kernel = timed
    random.seed(0)
    with LLM(resolve_model(None, "qwen3-0.6b"), max_model_len=4096, kv_cache_dtype=args.kv_cache_dtype) as llm:
        vocab = llm.config.hf_config.vocab_size
        if args.ragged:
            lo, hi = map(int, args.ragged.split("-"))
            lengths = [random.randint(lo, hi) for _ in range(args.batch)]
        else:
            lengths = [args.prompt_len] * args.batch
        prompts = [[random.randrange(vocab) for _ in range(n)] for n in lengths]
        params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.new_tokens)
        for _ in range(2):  # the first compiles and captures
            llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        # the last step's batch: the smallest graph batch size holding them all (or theirs, eager)
        grid = timed.grids[min(b for b in timed.grids if b >= args.batch)]
        records = timed.timeline[: grid[0] * grid[1] * grid[2]].cpu().numpy()
        head_dim = config_head_dim(llm.config.hf_config)
    emit(f"batch {args.batch}, contexts {min(lengths) + args.new_tokens - 1}-{max(lengths) + args.new_tokens - 1}, "
         f"{args.kv_cache_dtype}; the last step's last layer, grid {grid}")
    block_n = triton_decode._decode_tile(head_dim, args.kv_cache_dtype == "fp8")[0]
    report(records, grid[0], block_n)  # grid (NUM_SPLITS, KVH, B)
    save_report("decode_timeline.txt")
    if os.environ.get("OUT"):  # the records, for a closer look: one row a program, FIELDS' columns
        np.save(pathlib.Path(os.environ["OUT"], f"decode_timeline_b{args.batch}.npy"), records[:, : len(FIELDS)])


if __name__ == "__main__":
    main()
