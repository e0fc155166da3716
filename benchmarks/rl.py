"""The RL rollout features on the GPU, on random-weight checkpoints (written once under
$XDG_CACHE_HOME/nanovllm/, by default ~/.cache/nanovllm/): sleep(1) / wake_up / update_weights from
a CPU state dict, cycle after cycle (the first cycle packs the weights and the KV pool and pins the
host copy; the later ones are the steady state), GPU memory awake and asleep (and what stays
allocated asleep), sleep(2) in vLLM's RL order, update_weights from a CPU and from a GPU state dict,
and 64 prompts x n=8 against the same 512 requests made independently (time, decode throughput,
prefilled tokens).

    python -m benchmarks.rl                        # Qwen3-0.6B, then Qwen3-8B shapes
    python -m benchmarks.rl --arch qwen3-8b        # one of them
"""

import argparse
import gc
import glob
import os
import random
import statistics
import time

import torch
from safetensors.torch import load_file

from bench import resolve_model
from nanovllm import LLM, SamplingParams

GIB = 1 << 30


def gpu_memory() -> str:
    """Memory the device has in use (every process, CUDA context included), our tensors' in
    PyTorch's allocator (the weights and KV pool live outside it once packed) and its reserve."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (f"device used {(total - free) / GIB:6.2f} GiB, "
            f"allocated {torch.cuda.memory_allocated() / GIB:5.2f} GiB, "
            f"reserved {torch.cuda.memory_reserved() / GIB:5.2f} GiB")


def live_tensors(top: int = 6) -> str:
    """What stays in PyTorch's allocator: the graphs' pools, and the largest storages that Python
    still reaches (the packed weights and KV pool live outside it)."""
    segments = torch.cuda.memory_snapshot()
    pools = sum(s["total_size"] for s in segments
                if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))
    ranges = [(s["address"], s["address"] + s["total_size"]) for s in segments]
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.is_cuda:  # type(): no __class__ hooks
            storage = obj.untyped_storage()
            if any(start <= storage.data_ptr() < end for start, end in ranges):
                storages[storage.data_ptr()] = (storage.nbytes(), tuple(obj.shape), obj.dtype)
    largest = sorted(storages.values(), key=lambda s: -s[0])[:top]
    total = sum(s[0] for s in storages.values())
    return "\n".join([f"    graph pools reserve {pools / GIB:.2f} GiB; {len(storages)} live "
                      f"storages, {total / GIB:.2f} GiB, the largest:",
                      *(f"    {nbytes / 2**20:9.1f} MiB  {list(shape)} {dtype}"
                        for nbytes, shape, dtype in largest)])


def timed(action) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    action()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def state_dict(path: str, device: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        tensors.update(load_file(file, device=device))
    return tensors


def wake_up(llm: LLM, tags: list[str] | None = None) -> tuple[float, str]:
    """wake_up's seconds, and whether the CUDA graphs were kept or captured again."""
    graphs = llm.llm_engine.model_runner.graphs
    seconds = timed(lambda: llm.wake_up(tags))
    return seconds, ("graphs kept" if llm.llm_engine.model_runner.graphs is graphs
                     else "graphs captured again")


def bench_sleep(llm: LLM, cpu_weights: dict[str, torch.Tensor], cycles: int):
    """RL loops sleep every step: the first cycle, then the median of the later ones."""
    num_bytes = sum(t.nbytes for t in cpu_weights.values())
    print(f"  awake                 {gpu_memory()}")
    times = {"sleep(1)": [], "wake_up": [], "update_weights": []}
    for cycle in range(cycles):
        times["sleep(1)"].append(timed(lambda: llm.sleep(1)))
        print(f"  asleep (cycle {cycle + 1})      {gpu_memory()}")
        if cycle == 1:
            print(live_tensors())
        seconds, graphs = wake_up(llm)
        times["wake_up"].append(seconds)
        times["update_weights"].append(timed(lambda: llm.update_weights(cpu_weights)))
        print(f"  woken, loaded         {gpu_memory()}   ({graphs})")
    for name, seconds in times.items():
        first, steady = seconds[0], statistics.median(seconds[1:])
        rate = (f"   {num_bytes / GIB / first:5.1f} / {num_bytes / GIB / steady:5.1f} GiB/s "
                "host to device" if name == "update_weights" else "")
        print(f"  {name:<15} first cycle {first:6.3f} s, steady state {steady:6.3f} s{rate}")
    sleep_seconds = timed(lambda: llm.sleep(2))
    print(f"  sleep(2)              {gpu_memory()}   sleep {sleep_seconds:.3f} s")
    wake_seconds, _ = wake_up(llm, ["weights"])
    load_seconds = timed(lambda: llm.update_weights(cpu_weights))
    kv_seconds, graphs = wake_up(llm, ["kv_cache"])
    print(f"  woken, loaded         {gpu_memory()}   wake_up(weights) {wake_seconds:.3f} s, "
          f"update_weights from CPU {load_seconds:.3f} s, wake_up(kv_cache) {kv_seconds:.3f} s "
          f"({graphs})")


def bench_update(llm: LLM, path: str, cpu_weights: dict[str, torch.Tensor]):
    num_bytes = sum(t.nbytes for t in cpu_weights.values())
    for source in ("cpu", "cuda"):
        weights = cpu_weights if source == "cpu" else state_dict(path, "cuda")
        seconds = min(timed(lambda w=weights: llm.update_weights(w)) for _ in range(3))
        print(f"  update_weights from a {source} state dict: {seconds:.3f} s "
              f"({num_bytes / GIB / seconds:.1f} GiB/s of {num_bytes / GIB:.2f} GiB)")
        del weights
    seconds = timed(lambda: llm.update_weights_from_path(path))
    print(f"  update_weights_from_path: {seconds:.3f} s")


def bench_n_samples(llm: LLM, num_prompts: int, n: int, prompt_len: int, max_tokens: int):
    rng = random.Random(0)
    vocab = min(10000, llm.llm_engine.config.hf_config.vocab_size)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]
    params = dict(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    runs = [(f"{num_prompts} prompts x n={n}", prompts, SamplingParams(n=n, **params)),
            (f"{num_prompts * n} independent", [p for p in prompts for _ in range(n)],
             SamplingParams(**params))]
    for name, batch, sampling in runs:
        llm.reset_prefix_cache()
        prefilled = llm.llm_engine.num_prefilled_tokens
        seconds = timed(lambda b=batch, s=sampling: llm.generate(b, s, use_tqdm=False))
        tokens = num_prompts * n * max_tokens
        print(f"  {name:>22}: {seconds:6.2f} s, {tokens / seconds:8,.0f} output tok/s, "
              f"prefilled {llm.llm_engine.num_prefilled_tokens - prefilled:,} tokens")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=["qwen3-0.6b", "qwen3-8b"], action="append")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                        help="leaves room for the GPU state dict of the update_weights timing")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--cycles", type=int, default=4, help="sleep / wake / update cycles")
    args = parser.parse_args()
    for arch in args.arch or ["qwen3-0.6b", "qwen3-8b"]:
        path = resolve_model(None, arch)
        print(f"{arch} ({path}), {torch.cuda.get_device_name()}")
        cpu_weights = state_dict(path, "cpu")
        with LLM(path, gpu_memory_utilization=args.gpu_memory_utilization) as llm:
            bench_sleep(llm, cpu_weights, max(2, args.cycles))
            bench_update(llm, path, cpu_weights)
            bench_n_samples(llm, 64, 8, args.prompt_len, args.max_tokens)
        del cpu_weights


if __name__ == "__main__":
    main()
