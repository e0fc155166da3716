"""Throughput benchmark: upstream nano-vllm's workload, or a few concurrent streams.

    python bench.py                       # 256 requests, prompts and outputs of 100-1024 tokens
    python bench.py --single-stream       # one request: time to first token, then decode rate
    python bench.py --streams 8 [--every-control]   # 8 requests [sampling with every control]
    python bench.py --kv-cache-dtype fp8 [--breakdown]   # [then one more run's time by phase]
    python bench.py --profile [--streams 8]   # decode steps' GPU time by kernel, and idle time
    python bench.py --profile-prefill     # the same of the workload's prefill steps
    python bench.py --mixed-sampling      # the sampler step alone, by mix of controls
"""

from nanovllm.extras import ctrl_c_in_one_line

ctrl_c_in_one_line()  # first: the imports below take seconds

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from random import randint, seed

import torch

from benchmarks.profiling import PROFILED_STEPS, profile_decode, profile_prefill
from benchmarks.sampler import bench_mixed_sampling
from nanovllm import LLM, SamplingParams
from nanovllm.engine.scheduler import Scheduler
from nanovllm.models.decoder import DecoderForCausalLM
from nanovllm.runner.cuda_graph import DecodeGraphs
from nanovllm.runner.model_runner import ModelRunner, PendingOutput
from nanovllm.runner.step_inputs import StepInputs
from nanovllm.testing.real_model import cache_dir
from nanovllm.testing.tiny_model import (
    LLAMA_3_2_1B,
    QWEN2_5_0_5B,
    QWEN3_0_6B,
    QWEN3_8B,
    QWEN3_30B_A3B,
    SMOLLM2_135M,
    write_benchmark_checkpoint,
)

DEFAULT_MODEL = os.path.expanduser("~/huggingface/Qwen3-0.6B")
RANDOM_ARCHS = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-8b": QWEN3_8B, "qwen2.5-0.5b": QWEN2_5_0_5B,
                "llama-3.2-1b": LLAMA_3_2_1B, "qwen3-30b-a3b": QWEN3_30B_A3B,
                "smollm2-135m": SMOLLM2_135M}
# Without a GPU: a model and workload that take a few minutes a run on two cores, where
# upstream's (256 requests of up to 1,024 tokens in and out, on Qwen3-0.6B) would take hours.
CPU_ARCH = "smollm2-135m"
CPU_WORKLOAD = dict(num_seqs=8, max_input_len=128, max_output_len=128)
EVERY_CONTROL = dict(top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                     presence_penalty=0.2, frequency_penalty=0.2, seed=1, logprobs=5)
DECODE_BATCH_BOUNDS = (16, 64, 128, 256)  # decode phases: 1-16, 17-64, 65-128, 129-256, 257+
MEDIAN = "median of {runs} runs: decode {rate:,.0f} tok/s per stream"


def resolve_model(path: str | None, arch: str, layers: int | None = None) -> str:
    """`path`, else a random-weight checkpoint of `arch` (with `layers` layers if given)."""
    if path is not None:
        return path
    if arch == "qwen3-0.6b" and os.path.isdir(DEFAULT_MODEL) and layers is None:
        return DEFAULT_MODEL
    shape = dict(RANDOM_ARCHS[arch])
    if layers is not None:
        shape["num_hidden_layers"] = layers
        arch = f"{arch}-{layers}-layers"
    cached = os.path.join(cache_dir(), f"random-{arch}")
    if not os.path.isfile(os.path.join(cached, "config.json")):
        print(f"No checkpoint given: writing a random-weight {arch} checkpoint to {cached} "
              "(once; bf16, 2 bytes a parameter: Qwen3-0.6B takes 1.2 GB and a minute or more)",
              file=sys.stderr, flush=True)
        start = time.perf_counter()
        write_benchmark_checkpoint(cached, shape, dtype="bfloat16")
        size = sum(entry.stat().st_size for entry in os.scandir(cached))
        print(f"Wrote {size / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    else:
        print(f"Using the random-weight {arch} checkpoint in {cached}", file=sys.stderr)
    return cached


def upstream_workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024):
    """Exactly upstream bench.py's draws: seed 0, prompts first, then sampling params."""
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, max_input_len))]
               for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=randint(100, max_output_len)) for _ in range(num_seqs)]
    return prompts, params


def bench_throughput(llm: LLM, runs: int, breakdown: bool, workload: dict | None = None):
    prompts, params = upstream_workload(**(workload or {}))
    total = sum(p.max_tokens for p in params)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # warm-up
    for run in range(1, runs + 1):
        llm.reset_prefix_cache()  # each run computes every prompt, as upstream's one run does
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        print(f"run {run}: {total} tokens in {seconds:.2f} s = {total / seconds:,.0f} tok/s")
    if breakdown:
        time_by_phase(llm, prompts, params)


def decode_phase(batch: int) -> str:
    low = 1
    for high in DECODE_BATCH_BOUNDS:
        if batch <= high:
            return f"decode, batch {low}-{high}"
        low = high + 1
    return f"decode, batch {low}+"


def time_by_phase(llm: LLM, prompts, params):
    """One more run, step by step: its wall time by phase. A step() call launches step N and waits
    for step N-1, so its time is charged to the step it completed."""
    llm.reset_prefix_cache()
    llm.llm_engine.add(llm.make_requests(prompts, params))
    phases: dict[str, list[float]] = {}  # phase -> [steps, seconds, tokens]
    start = time.perf_counter()
    while not llm.is_finished():
        step_start = time.perf_counter()
        result = llm.step()
        seconds = time.perf_counter() - step_start
        if result.num_prefill_tokens:
            phase, tokens = "prefill", result.num_prefill_tokens
        elif result.num_decode_tokens:
            tokens = result.num_decode_tokens
            phase = decode_phase(tokens)
        else:
            phase, tokens = "first launch", 0
        entry = phases.setdefault(phase, [0, 0.0, 0])
        entry[0] += 1
        entry[1] += seconds
        entry[2] += tokens
    print_phases(phases, time.perf_counter() - start)


def print_phases(phases: dict[str, list[float]], wall: float):
    print(f"by phase ({wall:.2f} s in all):")
    order = lambda item: (item[0].startswith("decode"), item[1][2] / item[1][0])
    for phase, (steps, seconds, tokens) in sorted(phases.items(), key=order):
        print(f"  {phase:<24} {steps:5d} steps {seconds:6.2f} s ({seconds / wall:4.0%}) "
              f"{seconds / steps * 1e3:7.2f} ms/step {tokens / max(seconds, 1e-9):9,.0f} tok/s")


# The host's decode step by the method doing it (rank 0). "waiting": for a step's tokens; a host
# that never waits is the bottleneck, and the GPU idles between steps.
HOST_PARTS = {
    "waiting": (PendingOutput, "result"),
    "schedule": (Scheduler, "schedule"),
    "inputs": (StepInputs, "prepare_decode"),
    "graph launch": (DecodeGraphs, "replay"),
    "eager forward": (DecoderForCausalLM, "forward"),
    "lm_head": (DecoderForCausalLM, "compute_logits"),
    "sampling": (ModelRunner, "_sample"),
    "head graph": (DecodeGraphs, "sample"),  # lm_head and sampler of a temperature-only step
    "postprocess": (Scheduler, "postprocess"),
}


@contextlib.contextmanager
def host_time_by_part():
    """Yields a dict summing the seconds the host spends in each of HOST_PARTS during the block."""
    spent = dict.fromkeys(HOST_PARTS, 0.0)
    originals = {part: getattr(cls, name) for part, (cls, name) in HOST_PARTS.items()}

    def timed(part, method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - start
        return wrapper

    for part, (cls, name) in HOST_PARTS.items():
        setattr(cls, name, timed(part, originals[part]))
    try:
        yield spent
    finally:
        for part, (cls, name) in HOST_PARTS.items():
            setattr(cls, name, originals[part])


def stream_requests(llm: LLM, prompt_len: int, new_tokens: int, num_streams: int,
                    every_control: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    """num_streams random prompts, each sampling new_tokens at temperature 0.6 (ignore_eos)."""
    vocab = min(10000, llm.llm_engine.config.hf_config.vocab_size - 1)
    controls = EVERY_CONTROL if every_control else {}
    prompts = [[randint(0, vocab) for _ in range(prompt_len)] for _ in range(num_streams)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=new_tokens, **controls)
              for _ in range(num_streams)]
    return prompts, params


def time_stream_run(llm: LLM, prompts, params) -> tuple[float, float, float, dict]:
    """(start, first, end, host seconds by part): `first` once every stream's first token is on
    the host (a step() call returns before the GPU finishes its step)."""
    requests = llm.make_requests(prompts, params)
    start = time.perf_counter()
    seqs = llm.llm_engine.add(requests)
    while any(seq.num_output_tokens == 0 for seq in seqs):
        llm.step()
    first = time.perf_counter()
    with host_time_by_part() as spent:
        while not llm.is_finished():
            llm.step()
    return start, first, time.perf_counter(), spent


def bench_streams(llm: LLM, prompt_len: int, new_tokens: int, num_streams: int,
                  every_control: bool, runs: int = 2) -> list[float]:
    """Time to first token, then the decode rate per stream and the host's time by part, of each
    run after a warm-up. Returns the runs' decode rates per stream."""
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    rates = []
    for _ in range(runs):
        prompts, params = stream_requests(llm, prompt_len, new_tokens, num_streams, every_control)
        start, first, end, spent = time_stream_run(llm, prompts, params)
        per_stream = (new_tokens - 1) / (end - first)
        # on the CPU the host computes the step itself: there is nothing to wait for
        waited = (f"; the host waited for the GPU {spent['waiting'] / (end - first):.0%} of the "
                  "decode" if llm.llm_engine.config.device == "cuda" else "")
        print(f"{num_streams} stream(s): prompt {prompt_len}, time to first token "
              f"{(first - start) * 1e3:.1f} ms, decode {per_stream:,.0f} tok/s per stream "
              f"({1e3 / per_stream:.2f} ms/token), {per_stream * num_streams:,.0f} tok/s in "
              f"all{waited}")
        steps = new_tokens - 1
        parts = {**spent, "other": end - first - sum(spent.values())}
        print("  host µs a decode step: " + ", ".join(
            f"{part} {seconds / steps * 1e6:.0f}" for part, seconds in parts.items()))
        rates.append(per_stream)
    if runs >= 3:
        print(MEDIAN.format(runs=runs, rate=statistics.median(rates)))
    return rates


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default=None,
        help=f"checkpoint directory (default {DEFAULT_MODEL}, else a random-weight one)")
    add("--random-arch", default=None, choices=sorted(RANDOM_ARCHS),
        help="architecture of the random checkpoint written when no model is given (default "
             f"qwen3-0.6b; without a GPU {CPU_ARCH})")
    add("--upstream-workload", action="store_true",
        help=f"without a GPU too: upstream's workload and qwen3-0.6b, not {CPU_WORKLOAD} and "
             f"{CPU_ARCH} (hours on a CPU)")
    add("--random-layers", type=int, default=None,
        help="layers of the random checkpoint (default: the architecture's), e.g. to fit a disk")
    add("--tensor-parallel-size", type=int, default=1)
    add("--expert-parallel", action="store_true", help="MoE: whole experts per GPU")
    add("--gpu-memory-utilization", type=float, default=0.9)
    add("--attention-backend", default="auto")
    add("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    add("--enforce-eager", action="store_true")
    add("--runs", type=int, default=None,
        help="timed runs in one process, after a warm-up (default 2; without a GPU 1)")
    add("--breakdown", action="store_true",
        help="after the timed runs, one more: its time by phase (prefill, decode by batch size)")
    add("--single-stream", action="store_true", help="one request instead of the workload")
    add("--streams", type=int, default=0, help="like --single-stream with this many requests")
    add("--prompt-len", type=int, default=1000, help="prompt length of each stream")
    add("--new-tokens", type=int, default=1024, help="output length of each stream")
    add("--every-control", action="store_true",
        help="streams sample with every control (top-k/p, min-p, penalties, seed, logprobs)")
    add("--profile", action="store_true",
        help="profile decode steps at batch 1 and 256 of the workload (with --single-stream or "
             "--streams, of theirs, mid-decode) instead of timing (CUDA)")
    add("--profile-prefill", action="store_true",
        help="profile the workload's prefill steps instead of timing (CUDA)")
    add("--mixed-sampling", action="store_true",
        help="time the sampler alone at batch 256 and 1, by mix of controls (CUDA)")
    args = parser.parse_args()
    args.cpu_sized = not torch.cuda.is_available() and not args.upstream_workload
    if args.random_arch is None:
        args.random_arch = CPU_ARCH if args.cpu_sized else "qwen3-0.6b"
    if args.runs is None:
        args.runs = 1 if args.cpu_sized else 2
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if args.mixed_sampling and not torch.cuda.is_available():
        parser.error("--mixed-sampling needs CUDA")
    return args


def run(llm: LLM, args):
    streams = args.streams or 1
    if args.profile and (args.single_stream or args.streams):
        prompts, params = stream_requests(llm, args.prompt_len, args.new_tokens, streams,
                                          args.every_control)
        profile_decode(llm, prompts, params,
                       warmup=max(0, args.new_tokens // 2 - PROFILED_STEPS))
    elif args.profile:
        for batch in [1, 256]:
            prompts, params = upstream_workload(batch)
            for sp in params:
                sp.max_tokens = 1024  # none finishes while profiled
            profile_decode(llm, prompts, params)
    elif args.profile_prefill:
        profile_prefill(llm, *upstream_workload())
    elif args.single_stream or args.streams:
        bench_streams(llm, args.prompt_len, args.new_tokens, streams, args.every_control,
                      args.runs)
    else:
        bench_throughput(llm, args.runs, args.breakdown, CPU_WORKLOAD if args.cpu_sized else None)


def main():
    args = parse_args()
    if args.mixed_sampling:
        bench_mixed_sampling(EVERY_CONTROL)
        return
    if args.cpu_sized and not (args.single_stream or args.streams or args.profile_prefill):
        print(f"No GPU: a CPU-sized workload, {CPU_WORKLOAD['num_seqs']} requests of "
              f"100-{CPU_WORKLOAD['max_input_len']} prompt tokens and "
              f"100-{CPU_WORKLOAD['max_output_len']} new ones, {args.runs} timed run(s) after a "
              "warm-up; a few minutes a run on two cores with the default model "
              "(--upstream-workload: upstream's 256 requests, for hours)", file=sys.stderr)
    model = resolve_model(args.model, args.random_arch, args.random_layers)
    with LLM(model, max_model_len=4096, tensor_parallel_size=args.tensor_parallel_size,
             attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
             enforce_eager=args.enforce_eager, expert_parallel=args.expert_parallel,
             gpu_memory_utilization=args.gpu_memory_utilization) as llm:
        engine = llm.llm_engine
        print(f"KV pool: {engine.num_kvcache_blocks} blocks of {engine.config.kvcache_block_size} "
              f"tokens ({args.kv_cache_dtype}), backend {engine.config.attention_backend}, "
              f"tp {args.tensor_parallel_size}")
        run(llm, args)
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            peak = torch.cuda.max_memory_allocated() / 2**30
            print(f"GPU memory in use {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB; "
                  f"peak allocated by torch on rank 0 {peak:.1f} GiB")


if __name__ == "__main__":
    main()
