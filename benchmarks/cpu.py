"""Batched greedy decode on the CPU: ours against transformers' `generate`, in one process, on a
random-weight SmolLM2-135M-shaped checkpoint (written once under $XDG_CACHE_HOME/nanovllm/, by
default ~/.cache/nanovllm/).

    python -m benchmarks.cpu                      # 8 prompts x 64 new tokens, float32, 5 runs each
    python -m benchmarks.cpu --profile            # then where 8 of our steps' time goes
"""

import argparse
import os
import random
import time

import torch

from nanovllm.testing.real_model import cache_dir
from nanovllm.testing.tiny_model import SMOLLM2_135M, write_benchmark_checkpoint


def checkpoint(path: str | None = None) -> str:
    path = path or os.path.join(cache_dir(), "smollm2-135m-random")
    if not os.path.exists(os.path.join(path, "config.json")):
        write_benchmark_checkpoint(path, SMOLLM2_135M, dtype="float32")
        # one shard: named as transformers looks for an unindexed checkpoint
        os.replace(os.path.join(path, "model-00000.safetensors"),
                   os.path.join(path, "model.safetensors"))
    return path


def prompts(num_prompts: int, min_len: int, max_len: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(300, vocab_size) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num_prompts)]


def transformers_runner(path: str, batch: list[list[int]], new_tokens: int):
    """A function running transformers' batched greedy `generate` (left-padded): the token lists."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(map(len, batch))
    pad = model.generation_config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(ids[:, -8:], attention_mask=mask[:, -8:], do_sample=False,
                       max_new_tokens=4, pad_token_id=pad)  # warm-up

    def run() -> list[list[int]]:
        with torch.inference_mode():
            return model.generate(ids, **kwargs)[:, width:].tolist()
    return run


def our_runner(llm, batch: list[list[int]], new_tokens: int):
    """A function running our engine on the batch, its prefix cache reset first: the token lists."""
    from nanovllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([p[:8] for p in batch], SamplingParams(temperature=0, max_tokens=4),
                 use_tqdm=False)  # warm-up

    def run() -> list[list[int]]:
        llm.reset_prefix_cache()  # each run prefills its prompts in full, as transformers
        return [o["token_ids"] for o in llm.generate(batch, params, use_tqdm=False)]
    return run


def timed(run) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    tokens = run()
    return time.perf_counter() - start, tokens


def profile(llm, batch: list[list[int]]):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from nanovllm import SamplingParams

    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(batch, short, use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                    max_name_column_width=50))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()

    from nanovllm import LLM

    path = checkpoint()
    batch = prompts(args.prompts, args.min_len, args.max_len, SMOLLM2_135M["vocab_size"])
    generated = args.prompts * args.new_tokens
    print(f"{args.prompts} prompts of {args.min_len}-{args.max_len} tokens x {args.new_tokens} "
          f"new, float32, {torch.get_num_threads()} threads, {args.repeats} runs each, "
          "alternating")
    with LLM(path, device="cpu", num_kvcache_blocks=64, max_model_len=1024) as llm:
        runners = {"nanovllm": our_runner(llm, batch, args.new_tokens)}
        if not args.skip_transformers:
            runners["transformers"] = transformers_runner(path, batch, args.new_tokens)
        seconds = {name: [] for name in runners}
        tokens = {}
        for _ in range(args.repeats):  # alternating, so that a slow spell of the machine hits both
            for name, run in runners.items():
                elapsed, tokens[name] = timed(run)
                seconds[name].append(elapsed)
        for name, times in seconds.items():
            rates = sorted(generated / t for t in times)
            print(f"{name:>12}: best {rates[-1]:6.1f} tok/s, median {rates[len(rates) // 2]:6.1f}")
        if "transformers" in runners:
            ratios = sorted(a / b for a, b in zip(seconds["transformers"], seconds["nanovllm"]))
            same = sum(a == b for a, b in zip(tokens["nanovllm"], tokens["transformers"]))
            print(f"nanovllm / transformers, run by run: {', '.join(f'{r:.2f}' for r in ratios)}"
                  f" (median {ratios[len(ratios) // 2]:.2f}x); identical tokens: {same} of "
                  f"{args.prompts} prompts")
        if args.profile:
            profile(llm, batch)


if __name__ == "__main__":
    main()
