"""bench.py --profile and --profile-prefill: the GPU's time a step by kernel, and its idle time."""

import collections
import cProfile
import pstats
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.device import pdl_enabled

PROFILED_STEPS = 30  # decode steps profile_decode profiles on the GPU, and as many on the host

Kernel = tuple[str, float, float]


def time_added(kernels: list[Kernel]) -> tuple[float, dict, dict, dict, dict]:
    """Kernels (name, start, end) -> (span, idle, added, calls, waits): what each adds to the GPU's
    timeline (its end less the latest end before), and the idle gaps by the kernel ending each.
    Unlike the profiler's times under PDL, added and idle sum to the span."""
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


def by_place_in_layer(kernels: list[Kernel], calls_a_layer: int) -> list[Kernel]:
    """kernels in time order, those a multiple m > 1 of calls_a_layer times (the skinny GEMM's qkv,
    o, gate/up, down) named "name #i of m" by their place in the layer."""
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
    """time_added of the profiler's GPU events a step, largest first; given the model's layers,
    kernels run several times a layer apart by their place in it."""
    from torch.autograd import DeviceType

    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events
               if e.device_type == DeviceType.CUDA]
    if layers:
        kernels = by_place_in_layer(kernels, steps * layers)
    span, idle, added, calls, waits = time_added(kernels)
    print(f"time added per step (span {span / steps:.1f} us, idle "
          f"{sum(idle.values()) / steps:.1f} us), by kernel:")
    for name, us in sorted(added.items(), key=lambda item: -item[1])[:top]:
        print(f"  {us / steps:8.1f} us  {calls[name] / steps:5.1f} calls  {name[:100]}")
    print("idle per step, by the kernel that ends the wait (the profiler slows the host, so a wait "
          "before a step's first kernel may be the profiler's):")
    for name, us in sorted(idle.items(), key=lambda item: -item[1])[:8]:
        print(f"  {us / steps:8.1f} us  {waits[name] / steps:5.1f} waits  {name[:100]}")


def profile_gpu(llm: LLM, steps: int):
    """The GPU's busy time against the wall clock over `steps` decode steps, and its kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    batch = len(llm.llm_engine.scheduler.running)
    print(f"decode at batch {batch}: {wall / steps * 1e3:.2f} ms/step wall, "
          f"GPU busy {gpu_us / steps / 1e3:.2f} ms/step ({gpu_us / 1e6 / wall:.0%})")
    if pdl_enabled(torch.device("cuda")):
        print("(programmatic dependent launch: a kernel's time includes its wait for the one "
              "before, so busy time may exceed wall time; NANOVLLM_PDL=0 gives additive times)")
    print(events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=70))
    print_time_added(prof.events(), steps, layers=llm.llm_engine.config.hf_config.num_hidden_layers)


def profile_decode(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
                   warmup: int = 5, steps: int = PROFILED_STEPS):
    """`steps` decode steps profiled on the GPU, then `steps` on the host, after the requests'
    prefill and `warmup` steps."""
    for prompt, sp in zip(prompts, params):
        llm.add_request(prompt, sp)
    while llm.llm_engine.scheduler.waiting:
        llm.step()
    for _ in range(warmup):
        llm.step()
    profile_gpu(llm, steps)
    host = cProfile.Profile()
    host.enable()
    for _ in range(steps):
        llm.step()
    host.disable()
    pstats.Stats(host).sort_stats("tottime").print_stats(12)
    while not llm.is_finished():
        llm.step()


def profile_prefill(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
                    steps: int = 3):
    """What each kernel adds to `steps` prefill steps of the requests, after one unprofiled."""
    from torch.profiler import ProfilerActivity, profile

    llm.reset_prefix_cache()
    llm.llm_engine.add(llm.make_requests(prompts, params))
    llm.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        tokens = sum(llm.step().num_prefill_tokens for _ in range(steps))
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    print(f"prefill: {tokens / steps:,.0f} prompt tokens a step, "
          f"{wall / steps * 1e3:.2f} ms/step wall")
    print_time_added(prof.events(), steps, top=20)
    while not llm.is_finished():
        llm.step()
