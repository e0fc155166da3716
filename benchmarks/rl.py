"""The RL rollout features on the GPU, on random-weight checkpoints (written once under
$XDG_CACHE_HOME/nanovllm/, by default ~/.cache/nanovllm/): GPU memory awake / asleep / woken and
the sleep + wake time (levels 1 and 2), update_weights from a CPU and from a GPU state dict,
and 64 prompts x n=8 against the same 512 requests made independently (time, decode
throughput, prefilled tokens).

    python -m benchmarks.rl                        # Qwen3-0.6B, then Qwen3-8B shapes
    python -m benchmarks.rl --arch qwen3-0.6b      # one of them
"""

import argparse
import glob
import os
import random
import time

import torch
from safetensors.torch import load_file

from bench import resolve_model
from nanovllm import LLM, SamplingParams

GIB = 1 << 30


def gpu_memory() -> str:
    """Memory the device has in use (every process, CUDA context included) and our tensors'."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (f"device used {(total - free) / GIB:6.2f} GiB, "
            f"allocated {torch.cuda.memory_allocated() / GIB:6.2f} GiB")


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


def wake_up(llm: LLM) -> tuple[float, str]:
    """wake_up's seconds, and whether the CUDA graphs were kept or captured again."""
    graphs = llm.llm_engine.model_runner.graphs
    seconds = timed(llm.wake_up)
    return seconds, ("graphs kept" if llm.llm_engine.model_runner.graphs is graphs
                     else "graphs captured again")


def bench_sleep(llm: LLM, cpu_weights: dict[str, torch.Tensor]):
    print(f"  awake          {gpu_memory()}")
    for cycle in ("first", "second"):  # RL loops sleep every step: the second is the steady state
        seconds = timed(lambda: llm.sleep(1))
        print(f"  sleep(1)       {gpu_memory()}   sleep {seconds:.3f} s ({cycle} cycle)")
        seconds, graphs = wake_up(llm)
        print(f"  woken          {gpu_memory()}   wake_up {seconds:.3f} s ({graphs})")
    sleep_seconds = timed(lambda: llm.sleep(2))
    print(f"  sleep(2)       {gpu_memory()}   sleep {sleep_seconds:.3f} s")
    wake_seconds, graphs = wake_up(llm)
    load_seconds = timed(lambda: llm.update_weights(cpu_weights))
    print(f"  woken, loaded  {gpu_memory()}   wake_up {wake_seconds:.3f} s ({graphs}), "
          f"update_weights from CPU {load_seconds:.3f} s")


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
    args = parser.parse_args()
    for arch in args.arch or ["qwen3-0.6b", "qwen3-8b"]:
        path = resolve_model(None, arch)
        print(f"{arch} ({path}), {torch.cuda.get_device_name()}")
        cpu_weights = state_dict(path, "cpu")
        with LLM(path, gpu_memory_utilization=args.gpu_memory_utilization) as llm:
            bench_sleep(llm, cpu_weights)
            bench_update(llm, path, cpu_weights)
            bench_n_samples(llm, 64, 8, args.prompt_len, args.max_tokens)
        del cpu_weights


if __name__ == "__main__":
    main()
