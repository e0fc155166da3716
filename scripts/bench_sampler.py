"""Time the temperature sampler (nanovllm/layers/sampler.py: sample_triton) on a CUDA GPU by how many
programs split each row's vocabulary, at Qwen3's vocabulary and bf16 logits.

    python scripts/bench_sampler.py

Times are medians over CUDA-graph replays (scripts/gpu_timing.py), the second pass (each row's best
chunk) included; "default" is the chunk count sample_triton picks. The table is printed and, if $OUT is
set, written to $OUT/bench_sampler.txt.
"""

import functools

import torch
from gpu_timing import bench, emit, save_report  # scripts/gpu_timing.py

from nanovllm.sampling.sampler import sample_triton

VOCAB = 151936
CHUNKS = (1, 2, 4, 8, 16)


def main():
    emit(f"{torch.cuda.get_device_name()}: sample_triton, vocab {VOCAB}, bf16 logits, us per call")
    emit(f"{'rows':>5} {'default':>8} " + " ".join(f"{f'{c} chunks':>9}" for c in CHUNKS))
    seed = torch.tensor([1], dtype=torch.int64, device="cuda")
    for rows in (1, 8, 64, 128, 256, 512):
        logits = torch.randn(rows, VOCAB, device="cuda").to(torch.bfloat16)
        temperatures = torch.full((rows,), 0.6, device="cuda")
        times = [bench(functools.partial(sample_triton, logits, temperatures, seed, chunks)) * 1e3
                 for chunks in (None, *CHUNKS)]
        emit(f"{rows:>5} " + " ".join(f"{t:8.1f}" if i == 0 else f"{t:9.1f}" for i, t in enumerate(times)))
    save_report("bench_sampler.txt")


if __name__ == "__main__":
    main()
