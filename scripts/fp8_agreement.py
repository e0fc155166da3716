"""Greedy tokens and logprobs with an fp8 KV cache against the model-dtype (bf16) cache.

    python scripts/fp8_agreement.py                        # random Qwen3-0.6B-shaped model, on CUDA
    python scripts/fp8_agreement.py --model DIR --device cpu --max-prompt-len 200   # a tiny model

Runs the same greedy requests (random token prompts) through two engines, one after the other, that
differ only in kv_cache_dtype ("auto", then "fp8"), and reports how many output positions agree:
up to each sequence's first divergence (after it the contexts differ) and position by position. It
also reports the difference of the top-20 logprobs at positions whose context is still the same.

Without --model, the random-weight checkpoint bench.py uses is written once to ~/.cache/nanovllm/.
The Triton kernels are the default backend on CUDA; on CPU the default is the torch reference, since
Triton's interpreter rounds float32 to fp8 wrongly for some values (see tests/conftest.py).
"""

import argparse
import os
import random
import sys
import time


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: random Qwen3-0.6B shape)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--attention-backend", default=None, help="default: triton on CUDA, torch on CPU")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-prompt-len", type=int, default=100)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    backend = args.attention_backend or ("triton" if device == "cuda" else "torch")
    if device == "cpu" and backend == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from nanovllm import LLM, SamplingParams
    from nanovllm.config import load_hf_config
    from nanovllm.utils.tiny_model import QWEN3_0_6B, write_benchmark_checkpoint

    model = args.model
    if model is None:
        model = os.path.expanduser("~/.cache/nanovllm/random-qwen3-0.6b")  # as bench.py writes it
        if not os.path.isfile(os.path.join(model, "config.json")):
            print(f"Writing a random-weight Qwen3-0.6B-shaped checkpoint to {model} (once)")
            write_benchmark_checkpoint(model, QWEN3_0_6B, dtype="bfloat16")
    hf = load_hf_config(model)
    max_prompt_len = min(args.max_prompt_len, hf.max_position_embeddings - args.max_tokens)
    rng = random.Random(args.seed)
    vocab = min(10000, hf.vocab_size)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_prompt_len, max_prompt_len))]
               for _ in range(args.num_prompts)]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=20)

    outputs = {}
    for kv_cache_dtype in ("auto", "fp8"):
        start = time.perf_counter()
        with LLM(model, device=device, attention_backend=backend, kv_cache_dtype=kv_cache_dtype,
                 max_model_len=max_prompt_len + args.max_tokens, max_num_seqs=args.num_prompts) as llm:
            outputs[kv_cache_dtype] = llm.generate(prompts, greedy, use_tqdm=False)
            print(f"kv_cache_dtype={kv_cache_dtype}: dtype {llm.config.dtype}, backend {llm.config.attention_backend}, "
                  f"KV pool {llm.num_kvcache_blocks} blocks of {llm.config.kvcache_block_size} tokens, "
                  f"{time.perf_counter() - start:.1f} s")

    total = prefix_agreeing = agreeing = identical = 0
    errors = []  # per position with the same context: max |logprob difference| over the common top-20
    for auto, fp8 in zip(outputs["auto"], outputs["fp8"]):
        a, b = auto["token_ids"], fp8["token_ids"]
        diverge = first_divergence(a, b)
        total += len(a)
        prefix_agreeing += diverge
        agreeing += sum(x == y for x, y in zip(a, b))
        identical += diverge == len(a)
        for la, lb in zip(auto["logprobs"][:diverge + 1], fp8["logprobs"][:diverge + 1]):
            errors.append(max(abs(la[t] - lb[t]) for t in la.keys() & lb.keys()))
    print(f"{len(prompts)} prompts x {args.max_tokens} greedy tokens, prompt lengths "
          f"{args.min_prompt_len}..{max_prompt_len}")
    print(f"positions agreeing up to the first divergence: {prefix_agreeing / total:.1%}; "
          f"position by position: {agreeing / total:.1%}; identical sequences: {identical}/{len(prompts)}")
    print(f"top-20 logprob difference at positions with the same context ({len(errors)}): "
          f"max {max(errors):.4f}, mean of per-position max {sum(errors) / len(errors):.4f}")


if __name__ == "__main__":
    main()
