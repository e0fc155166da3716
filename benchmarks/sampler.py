"""The temperature sampler kernel by chunks a row splits in; the engine's sampler step by controls.

    python -m benchmarks.sampler          # sample_triton at Qwen3's vocabulary, bf16 logits
    python bench.py --mixed-sampling      # bench_mixed_sampling: the step, every control or few
"""

import functools
import time
from random import randint

import torch

from benchmarks.gpu_timing import bench, emit, save_report
from nanovllm.engine.scheduler import step_sampling
from nanovllm.engine.sequence import Sequence
from nanovllm.kernels.sampling import sample_triton
from nanovllm.runner.sampler_graphs import SamplerGraphs
from nanovllm.runner.sampling_metadata import build_sampling_metadata
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling_params import SamplingParams

VOCAB = 151936
CHUNKS = (1, 2, 4, 8, 16)


def mixes(every_control: dict) -> dict[str, list[SamplingParams]]:
    """Batches' sampling params by name, taken row by row in turn."""
    return {
        "temperature only": [SamplingParams(temperature=0.6), SamplingParams(temperature=0)],
        "mixed controls": [
            SamplingParams(temperature=0), SamplingParams(temperature=0.6),
            SamplingParams(temperature=0.6, top_k=50), SamplingParams(top_p=0.9),
            SamplingParams(min_p=0.05),
            SamplingParams(repetition_penalty=1.1, frequency_penalty=0.2),
            SamplingParams(seed=1), SamplingParams(logprobs=5)],
        "every control, every row": [SamplingParams(temperature=0.6, **every_control)],
    }


def sequences(params: list[SamplingParams], batch: int, vocab_size: int, context: int):
    """`batch` sequences of `context` random tokens, half prompt and half output."""
    seqs = []
    for row in range(batch):
        prompt = [randint(0, vocab_size - 1) for _ in range(context // 2)]
        seq = Sequence(prompt, params[row % len(params)], 256)
        for _ in range(context - context // 2):
            seq.append_token(randint(0, vocab_size - 1))
        seqs.append(seq)
    return seqs


def ms_a_step(step, steps: int) -> float:
    for _ in range(5):  # warm-up (and the graph's capture)
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps * 1e3


def print_profile(step, steps: int):
    """Where a step's time goes: GPU kernels, then host work."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events) / steps / 1e3
    print(f"GPU time per step {gpu_ms:.2f} ms")
    for column in ("self_device_time_total", "self_cpu_time_total"):
        print(events.table(sort_by=column, row_limit=10, max_name_column_width=60))


def bench_mixed_sampling(every_control: dict, vocab_size: int = VOCAB, num_rows: int = 256,
                         context: int = 1024, steps: int = 50, device: str = "cuda"):
    """Sampler time a decode step (metadata from the sequences, sampling, tokens to the host) on
    bf16 logits, by mix of controls at batch num_rows and 1: from the CUDA graphs as the engine
    samples (ModelRunner._sample), and eagerly."""
    device = torch.device(device)
    to_device = torch.from_numpy
    if device.type == "cuda":
        to_device = lambda a: torch.from_numpy(a).pin_memory().to(device, non_blocking=True)
    batches = mixes(every_control)
    logits = torch.randn(num_rows, vocab_size, device=device).to(torch.bfloat16)
    sampler = Sampler()
    graphs = SamplerGraphs(sampler, num_rows)

    def eager_step(batch: int, seqs: list) -> list[int]:
        meta = build_sampling_metadata(step_sampling(seqs), vocab_size, to_device)
        return sampler(logits[:batch], meta).token_ids.tolist()

    def graphed_step(batch: int, seqs: list) -> list[int]:
        sampling = step_sampling(seqs)
        if not graphs.applies(sampling):
            return eager_step(batch, seqs)
        return graphs(logits[:batch], sampling, to_device).token_ids.tolist()

    runs = [(num_rows, name) for name in batches]
    runs += [(1, "temperature only"), (1, "every control, every row")]
    for batch, name in runs:
        seqs = sequences(batches[name], batch, vocab_size, context)
        graphed = functools.partial(graphed_step, batch, seqs)
        eager = ""
        if name != "temperature only":
            eager_ms = ms_a_step(functools.partial(eager_step, batch, seqs), steps)
            eager = f" (eager: {eager_ms:.2f} ms)"
        print(f"sampler, batch {batch}, vocab {vocab_size}, {name}: "
              f"{ms_a_step(graphed, steps):.2f} ms/step{eager}")
        if name == "every control, every row":
            print_profile(graphed, steps)


def main():
    emit(f"{torch.cuda.get_device_name()}: sample_triton, vocab {VOCAB}, bf16 logits, us per call")
    emit(f"{'rows':>5} {'default':>8} " + " ".join(f"{f'{c} chunks':>9}" for c in CHUNKS))
    seed = torch.tensor([1], dtype=torch.int64, device="cuda")
    for rows in (1, 8, 64, 128, 256, 512):
        logits = torch.randn(rows, VOCAB, device="cuda").to(torch.bfloat16)
        temperatures = torch.full((rows,), 0.6, device="cuda")
        times = [bench(functools.partial(sample_triton, logits, temperatures, seed, chunks)) * 1e3
                 for chunks in (None, *CHUNKS)]
        emit(f"{rows:>5} " + " ".join(f"{t:8.1f}" if i == 0 else f"{t:9.1f}"
                                      for i, t in enumerate(times)))
    save_report("bench_sampler.txt")


if __name__ == "__main__":
    main()
