"""Throughput benchmark: upstream nano-vllm's workload, or a single stream.

    python bench.py                       # 256 requests, prompts/outputs uniform in 100..1024 tokens
    python bench.py --single-stream       # one request: time to first token, then decode tok/s
    python bench.py --streams 8           # the same with 8 concurrent requests (tok/s per stream)
    python bench.py --single-stream --every-control  # ...sampling with top-k/p, min-p, penalties, seed, logprobs
    python bench.py --model DIR --tensor-parallel-size 2 --attention-backend triton
    python bench.py --kv-cache-dtype fp8  # fp8 KV cache (Triton kernels): twice the tokens in the pool
    python bench.py --breakdown           # ...then where the time goes: prefill vs decode by batch size
    python bench.py --profile --streams 8 # the GPU's time by kernel, and its idle time, over 8 streams' decode steps
    python bench.py --mixed-sampling      # sampler step time at batch 256 and 1: every control vs temperature only

Without --model and without ~/huggingface/Qwen3-0.6B, a random-weight checkpoint with Qwen3-0.6B's
architecture is written once to ~/.cache/nanovllm/ (throughput with ignore_eos does not depend on
the weights' values).
"""

import argparse
import collections
import contextlib
import functools
import os
import statistics
import time
from random import randint, seed

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.scheduler import Scheduler
from nanovllm.kernels.device import pdl_enabled
from nanovllm.models.decoder import DecoderForCausalLM
from nanovllm.runner.cuda_graph import DecodeGraphs
from nanovllm.runner.model_runner import ModelRunner, PendingOutput
from nanovllm.runner.step_inputs import StepInputs
from nanovllm.utils.tiny_model import LLAMA_3_2_1B, QWEN2_5_0_5B, QWEN3_0_6B, QWEN3_8B, write_benchmark_checkpoint

DEFAULT_MODEL = os.path.expanduser("~/huggingface/Qwen3-0.6B")
RANDOM_ARCHS = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-8b": QWEN3_8B, "qwen2.5-0.5b": QWEN2_5_0_5B,
                "llama-3.2-1b": LLAMA_3_2_1B}


def resolve_model(path: str | None, arch: str) -> str:
    if path is not None:
        return path
    if arch == "qwen3-0.6b" and os.path.isdir(DEFAULT_MODEL):
        return DEFAULT_MODEL
    cached = os.path.expanduser(f"~/.cache/nanovllm/random-{arch}")
    if not os.path.isfile(os.path.join(cached, "config.json")):
        print(f"No checkpoint given: writing a random-weight {arch} checkpoint to {cached} (once)")
        write_benchmark_checkpoint(cached, RANDOM_ARCHS[arch], dtype="bfloat16")
    else:
        print(f"Using the random-weight {arch} checkpoint in {cached}")
    return cached


def upstream_workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024):
    """Exactly upstream bench.py's draws: seed 0, prompts first, then sampling params."""
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, max_input_len))] for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, max_output_len))
              for _ in range(num_seqs)]
    return prompts, params


def bench_throughput(llm: LLM, runs: int, breakdown: bool):
    prompts, params = upstream_workload()
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


DECODE_BATCH_BOUNDS = (16, 64, 128, 256)  # decode phases: batch 1-16, 17-64, 65-128, 129-256, then 257+


def decode_phase(batch: int) -> str:
    low = 1
    for high in DECODE_BATCH_BOUNDS:
        if batch <= high:
            return f"decode, batch {low}-{high}"
        low = high + 1
    return f"decode, batch {low}+"


def time_by_phase(llm: LLM, prompts, params):
    """One more run of the workload, step by step: where its wall time goes, prefill steps against
    decode steps by batch size. Steps overlap (a step() call launches step N and waits for step N-1),
    so a call's time is charged to the step it completed: the GPU time of that step, once the host
    keeps ahead of the GPU."""
    llm.reset_prefix_cache()
    for seq in llm.make_sequences(prompts, params):
        llm.scheduler.add(seq)
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
    wall = time.perf_counter() - start
    print(f"by phase ({wall:.2f} s in all):")
    for phase, (steps, seconds, tokens) in sorted(phases.items(), key=lambda item: (item[0].startswith("decode"),
                                                                                 item[1][2] / item[1][0])):
        print(f"  {phase:<24} {steps:5d} steps {seconds:6.2f} s ({seconds / wall:4.0%}) "
              f"{seconds / steps * 1e3:7.2f} ms/step {tokens / max(seconds, 1e-9):9,.0f} tok/s")


EVERY_CONTROL = dict(top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.2,
                     frequency_penalty=0.2, seed=1, logprobs=5)


# What bench_streams times of the host's decode step (rank 0's process), by the method doing it. "waiting" is
# the host waiting for a step's tokens: steps overlap, so a host that never waits is the bottleneck, and the GPU
# then idles between steps for the host's work.
HOST_PARTS = {
    "waiting": (PendingOutput, "result"),
    "schedule": (Scheduler, "schedule"),
    "inputs": (StepInputs, "prepare_decode"),
    "graph launch": (DecodeGraphs, "replay"),
    "eager forward": (DecoderForCausalLM, "forward"),  # no graph: CPU, --enforce-eager, batches above the graphs'
    "lm_head": (DecoderForCausalLM, "compute_logits"),
    "sampling": (ModelRunner, "_sample"),
    "head graph": (DecodeGraphs, "sample"),  # lm_head and the sampler of a temperature-only step, in a graph
    "postprocess": (Scheduler, "postprocess"),
}


@contextlib.contextmanager
def host_time_by_part():
    """Yields a dict that sums, while the block runs, the seconds the host spends in each of HOST_PARTS."""
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


PROFILED_STEPS = 30  # decode steps profile_decode profiles on the GPU, and as many more on the host


def stream_requests(llm: LLM, prompt_len: int, new_tokens: int, num_streams: int,
                    every_control: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    """The streams' requests: num_streams prompts of prompt_len random tokens, each sampling new_tokens tokens at
    temperature 0.6 (ignore_eos), and with every_control with every other sampling control too."""
    vocab = min(10000, llm.config.hf_config.vocab_size - 1)
    controls = EVERY_CONTROL if every_control else {}
    prompts = [[randint(0, vocab) for _ in range(prompt_len)] for _ in range(num_streams)]
    return prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=new_tokens, **controls)
                     for _ in range(num_streams)]


def bench_streams(llm: LLM, prompt_len: int, new_tokens: int, num_streams: int, every_control: bool,
                  runs: int = 2) -> list[float]:
    """Time to first token (until every stream's first token is on the host: steps overlap, so a
    step() call returns before the GPU finishes it), then the decode rate per stream, for each of `runs`
    runs after a warm-up, and from 3 runs their median. Temperature 0.6, and with every_control, every
    other sampling control too. Returns the runs' decode rates per stream."""
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # warm-up
    rates = []
    for _ in range(runs):
        prompts, params = stream_requests(llm, prompt_len, new_tokens, num_streams, every_control)
        seqs = llm.make_sequences(prompts, params)
        start = time.perf_counter()
        for seq in seqs:
            llm.scheduler.add(seq)
        while any(seq.num_output_tokens == 0 for seq in seqs):
            llm.step()
        first = time.perf_counter()
        with host_time_by_part() as spent:
            while not llm.is_finished():
                llm.step()
        end = time.perf_counter()
        per_stream = (new_tokens - 1) / (end - first)
        print(f"{num_streams} stream(s): prompt {prompt_len}, time to first token {(first - start) * 1e3:.1f} ms, "
              f"decode {per_stream:,.0f} tok/s per stream ({1e3 / per_stream:.2f} ms/token), "
              f"{per_stream * num_streams:,.0f} tok/s in all; the host waited for the GPU "
              f"{spent['waiting'] / (end - first):.0%} of the decode")
        steps = new_tokens - 1
        parts = {**spent, "other": end - first - sum(spent.values())}
        print("  host µs a decode step: " + ", ".join(f"{part} {seconds / steps * 1e6:.0f}"
                                                   for part, seconds in parts.items()))
        rates.append(per_stream)
    if runs >= 3:
        print(f"median of {runs} runs: decode {statistics.median(rates):,.0f} tok/s per stream")
    return rates


def profile_decode(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], warmup: int = 5,
                   steps: int = PROFILED_STEPS):
    """GPU-busy time vs wall clock over `steps` decode steps of the requests (prompts, params), after their
    prefill and `warmup` decode steps, the top kernels, and the top host functions."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    for prompt, sp in zip(prompts, params):
        llm.add_request(prompt, sp)
    while llm.scheduler.waiting:
        llm.step()
    for _ in range(warmup):
        llm.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    print(f"decode at batch {len(llm.scheduler.running)}: {wall / steps * 1e3:.2f} ms/step wall, GPU busy "
          f"{gpu_us / steps / 1e3:.2f} ms/step ({gpu_us / 1e6 / wall:.0%})")
    if pdl_enabled(torch.device("cuda")):
        print("(programmatic dependent launch: a kernel starts while the one before it runs, and its time includes "
              "that wait, so busy time may exceed wall time; NANOVLLM_PDL=0 gives additive kernel times)")
    print(events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=70))
    print_time_added(prof.events(), steps, layers=llm.config.hf_config.num_hidden_layers)
    host = cProfile.Profile()
    host.enable()
    for _ in range(steps):
        llm.step()
    host.disable()
    pstats.Stats(host).sort_stats("tottime").print_stats(12)
    while not llm.is_finished():
        llm.step()


def profile_prefill(llm: LLM, steps: int = 3):
    """What each kernel adds to the workload's prefill steps (16,384 prompt tokens each), after one
    unprofiled prefill step: the GPU's timeline over `steps` steps, as profile_decode prints it."""
    from torch.profiler import ProfilerActivity, profile

    prompts, params = upstream_workload()
    llm.reset_prefix_cache()
    for seq in llm.make_sequences(prompts, params):
        llm.scheduler.add(seq)
    llm.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        tokens = sum(llm.step().num_prefill_tokens for _ in range(steps))
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    print(f"prefill: {tokens / steps:,.0f} prompt tokens a step, {wall / steps * 1e3:.2f} ms/step wall")
    print_time_added(prof.events(), steps, top=20)
    while not llm.is_finished():
        llm.step()


def time_added(kernels: list[tuple[str, float, float]]) -> tuple[float, dict[str, float], dict[str, float],
                                                                 dict[str, int], dict[str, int]]:
    """What each kernel (name, start, end) adds to the GPU's timeline: its end minus the latest end before
    it (0 if it ended earlier), summed by name, with the calls by name; the time in which the GPU ran
    nothing (idle), summed by the name of the kernel that ends each gap, with the gaps (waits) by name; and
    the whole span. With PDL a kernel's own time includes its wait for the one before, so the profiler's
    table overlaps; these sums do not: with idle they add up to the span, so they say which kernels a step
    is waiting on. Returns (span, idle, added, calls, waits)."""
    added, idle, calls, waits = (collections.Counter() for _ in range(4))
    last_end = None
    for name, start, end in sorted(kernels, key=lambda kernel: kernel[1]):
        last_end = start if last_end is None else last_end
        if start > last_end:
            idle[name] += start - last_end
            waits[name] += 1
        added[name] += max(0.0, end - max(start, last_end))
        calls[name] += 1
        last_end = max(last_end, end)
    span = last_end - min(start for _, start, _ in kernels) if kernels else 0.0
    return span, idle, added, calls, waits


def by_place_in_layer(kernels: list[tuple[str, float, float]], calls_a_layer: int) -> list[tuple[str, float, float]]:
    """kernels (name, start, end) with each name run a multiple m > 1 of calls_a_layer times (the skinny GEMM:
    qkv, o, gate/up, down in each layer) named apart by their place in the layer, "name #i of m" in time order,
    so that time_added says which of them a step waits on. The other names are kept."""
    counts = collections.Counter(name for name, _, _ in kernels)
    seen = collections.Counter()
    labelled = []
    for name, start, end in sorted(kernels, key=lambda kernel: kernel[1]):
        per_layer, rest = divmod(counts[name], calls_a_layer)
        if per_layer > 1 and rest == 0:
            seen[name] += 1
            name = f"{name} #{(seen[name] - 1) % per_layer + 1} of {per_layer}"
        labelled.append((name, start, end))
    return labelled


def print_time_added(events, steps: int, top: int = 15, layers: int | None = None):
    """time_added of the profiler's GPU events, per step, the largest first; given the model's `layers`, the
    kernels run several times a layer apart by their place in it (by_place_in_layer)."""
    from torch.autograd import DeviceType

    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
    if layers:
        kernels = by_place_in_layer(kernels, steps * layers)
    span, idle, added, calls, waits = time_added(kernels)
    print(f"time added per step (span {span / steps:.1f} us, idle {sum(idle.values()) / steps:.1f} us), by kernel:")
    for name, us in sorted(added.items(), key=lambda item: -item[1])[:top]:
        print(f"  {us / steps:8.1f} us  {calls[name] / steps:5.1f} calls  {name[:100]}")
    print("idle per step, by the kernel that ends the wait (the profiler slows the host, so a wait before a step's "
          "first kernel may be the profiler's):")
    for name, us in sorted(idle.items(), key=lambda item: -item[1])[:8]:
        print(f"  {us / steps:8.1f} us  {waits[name] / steps:5.1f} waits  {name[:100]}")


def bench_mixed_sampling(vocab_size: int = QWEN3_0_6B["vocab_size"], num_rows: int = 256, context: int = 1024,
                         steps: int = 50, device: str = "cuda"):
    """Sampler time per decode step (building the metadata from the sequences, sampling, copying the
    tokens back) on bf16 logits: at batch `num_rows`, temperature only, which runs the one-pass kernel,
    vs batches mixing every control; then at batch 1, where the kernel splits the row over the SMs,
    temperature only and every control. As the engine samples: the general path replayed from CUDA
    graphs (SamplerGraphs), and for comparison eagerly. Contexts are half prompt, half output,
    `context` tokens long."""
    from nanovllm.engine.sequence import Sequence
    from nanovllm.sampling.graphs import SamplerGraphs
    from nanovllm.sampling.metadata import build_sampling_metadata
    from nanovllm.sampling.sampler import Sampler

    device = torch.device(device)
    to_device = (lambda a: torch.from_numpy(a).pin_memory().to(device, non_blocking=True)) if device.type == "cuda" \
        else torch.from_numpy
    mixes = {
        "temperature only": [SamplingParams(temperature=0.6), SamplingParams(temperature=0)],
        "mixed controls": [SamplingParams(temperature=0), SamplingParams(temperature=0.6),
                           SamplingParams(temperature=0.6, top_k=50), SamplingParams(top_p=0.9),
                           SamplingParams(min_p=0.05), SamplingParams(repetition_penalty=1.1, frequency_penalty=0.2),
                           SamplingParams(seed=1), SamplingParams(logprobs=5)],
        "every control, every row": [SamplingParams(temperature=0.6, **EVERY_CONTROL)],
    }
    logits = torch.randn(num_rows, vocab_size, device=device).to(torch.bfloat16)
    sampler = Sampler()
    graphs = SamplerGraphs(sampler, num_rows)
    runs = [(num_rows, name) for name in mixes] + [(1, "temperature only"), (1, "every control, every row")]

    def eager_step(batch: int, seqs: list) -> list[int]:
        return sampler(logits[:batch], build_sampling_metadata(seqs, vocab_size, to_device)).token_ids.tolist()

    def graphed_step(batch: int, seqs: list) -> list[int]:
        """One step as the engine takes it (ModelRunner._sample): metadata from the sequences, sample (by a
        graph where one applies), tokens to the host."""
        if not graphs.applies(seqs):
            return eager_step(batch, seqs)
        return graphs(logits[:batch], seqs, to_device).token_ids.tolist()

    def time_steps(step, batch: int, seqs: list) -> float:
        for _ in range(5):  # warm-up (and the graph's capture)
            step(batch, seqs)
        start = time.perf_counter()
        for _ in range(steps):
            step(batch, seqs)
        return (time.perf_counter() - start) / steps * 1e3

    for batch, name in runs:
        params = mixes[name]
        seqs = []
        for row in range(batch):
            sp = params[row % len(params)]
            seq = Sequence([randint(0, vocab_size - 1) for _ in range(context // 2)], sp, 256)
            for _ in range(context - context // 2):
                seq.append_token(randint(0, vocab_size - 1))
            seqs.append(seq)
        eager = "" if name == "temperature only" else f" (eager: {time_steps(eager_step, batch, seqs):.2f} ms)"
        print(f"sampler, batch {batch}, vocab {vocab_size}, {name}: "
              f"{time_steps(graphed_step, batch, seqs):.2f} ms/step{eager}")
        if name == "every control, every row":  # where the time goes: GPU kernels, then host work
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    graphed_step(batch, seqs)
            events = prof.key_averages()
            print(f"GPU time per step {sum(e.self_device_time_total for e in events) / steps / 1e3:.2f} ms")
            for column in ("self_device_time_total", "self_cpu_time_total"):
                print(events.table(sort_by=column, row_limit=10, max_name_column_width=60))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=f"checkpoint directory (default {DEFAULT_MODEL})")
    parser.add_argument("--random-arch", default="qwen3-0.6b", choices=sorted(RANDOM_ARCHS),
                        help="architecture of the random checkpoint written when no model is given")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--runs", type=int, default=2,
                        help="timed runs in one process (the workload's first warms up; streams warm up apart)")
    parser.add_argument("--breakdown", action="store_true",
                        help="after the timed runs, one more: its time by phase (prefill, decode by batch size)")
    parser.add_argument("--single-stream", action="store_true", help="one request instead of the batch workload")
    parser.add_argument("--streams", type=int, default=0, help="like --single-stream with this many requests")
    parser.add_argument("--prompt-len", type=int, default=1000, help="prompt length of each stream")
    parser.add_argument("--new-tokens", type=int, default=1024, help="output length of each stream")
    parser.add_argument("--every-control", action="store_true",
                        help="streams sample with every control (top-k/p, min-p, penalties, seed, logprobs)")
    parser.add_argument("--profile", action="store_true",
                        help="profile decode steps at batch 1 and 256 of the workload (with --single-stream or "
                             "--streams, of theirs, mid-decode) instead of timing (CUDA)")
    parser.add_argument("--profile-prefill", action="store_true",
                        help="profile the workload's prefill steps instead of timing (CUDA)")
    parser.add_argument("--mixed-sampling", action="store_true",
                        help="time the sampler alone at batch 256 and 1, every control vs temperature only (CUDA)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")

    if args.mixed_sampling:
        if not torch.cuda.is_available():
            parser.error("--mixed-sampling needs CUDA")
        bench_mixed_sampling()
        return
    model = resolve_model(args.model, args.random_arch)
    with LLM(model, max_model_len=4096, tensor_parallel_size=args.tensor_parallel_size,
             attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
             enforce_eager=args.enforce_eager) as llm:
        print(f"KV pool: {llm.num_kvcache_blocks} blocks of {llm.config.kvcache_block_size} tokens "
              f"({args.kv_cache_dtype}), backend {llm.config.attention_backend}, tp {args.tensor_parallel_size}")
        if args.profile and (args.single_stream or args.streams):  # mid-decode: the run's average contexts
            prompts, params = stream_requests(llm, args.prompt_len, args.new_tokens, args.streams or 1,
                                              args.every_control)
            profile_decode(llm, prompts, params, warmup=max(0, args.new_tokens // 2 - PROFILED_STEPS))
        elif args.profile:
            for batch in [1, 256]:
                prompts, params = upstream_workload(batch)
                for sp in params:
                    sp.max_tokens = 1024  # none finishes while profiled
                profile_decode(llm, prompts, params)
        elif args.profile_prefill:
            profile_prefill(llm)
        elif args.single_stream or args.streams:
            bench_streams(llm, args.prompt_len, args.new_tokens, args.streams or 1, args.every_control, args.runs)
        else:
            bench_throughput(llm, args.runs, args.breakdown)
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            print(f"GPU memory in use {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB; peak allocated by "
                  f"torch on rank 0 {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
