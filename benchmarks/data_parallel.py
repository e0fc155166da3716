"""Ray's overhead: bench.py's workload on the plain engine, then on `--data-parallel-size`
replicas through Ray (`data_parallel_backend="ray"`; 1 by default, the same GPU), in one process.

    python -m benchmarks.data_parallel [--model DIR] [--runs 3] [--data-parallel-size 1]

Each engine gets a warm-up and `--runs` timed runs of the 256-request workload (prefix cache
reset before each). The plain engine exits, freeing its GPU memory, before the replicas start."""

import argparse
import statistics
import time

from bench import RANDOM_ARCHS, resolve_model, upstream_workload
from nanovllm import LLM, SamplingParams


def time_runs(llm, runs: int, label: str) -> float:
    """The best throughput (tok/s) of `runs` timed runs of the workload."""
    prompts, params = upstream_workload()
    total = sum(p.max_tokens for p in params)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # warm-up
    rates = []
    for run in range(1, runs + 1):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        rates.append(total / seconds)
        print(f"{label} run {run}: {total} tokens in {seconds:.2f} s = {rates[-1]:,.0f} tok/s")
    print(f"{label}: best {max(rates):,.0f} tok/s, median {statistics.median(rates):,.0f}")
    return max(rates)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: as bench.py)")
    parser.add_argument("--random-arch", default="qwen3-0.6b", choices=sorted(RANDOM_ARCHS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    args = parser.parse_args()
    model = resolve_model(args.model, args.random_arch)
    with LLM(model, max_model_len=4096) as llm:
        plain = time_runs(llm, args.runs, "plain engine")
    start = time.perf_counter()
    with LLM(model, max_model_len=4096, data_parallel_size=args.data_parallel_size,
             data_parallel_backend="ray") as llm:
        print(f"Ray and {args.data_parallel_size} replica(s) started in "
              f"{time.perf_counter() - start:.1f} s")
        replicas = time_runs(llm, args.runs, f"ray, data_parallel_size={args.data_parallel_size}")
    print(f"ray / plain: {replicas / plain:.3f}")


if __name__ == "__main__":
    main()
