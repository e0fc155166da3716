"""Greedy tokens and logprobs with an fp8 KV cache against the model-dtype cache.

    python -m tools.fp8_agreement                  # random Qwen3-0.6B-shaped model, on CUDA
    python -m tools.fp8_agreement --model DIR --device cpu --max-prompt-len 200   # a tiny model
"""

import argparse
import os
import random
import time


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (default: random Qwen3-0.6B shape)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--attention-backend", default=None,
                        help="default: triton on CUDA, torch on CPU")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-prompt-len", type=int, default=100)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def random_checkpoint() -> str:
    """The random-weight Qwen3-0.6B checkpoint bench.py writes, written once."""
    from nanovllm.testing.real_model import cache_dir
    from nanovllm.testing.tiny_model import QWEN3_0_6B, write_benchmark_checkpoint

    model = os.path.join(cache_dir(), "random-qwen3-0.6b")
    if not os.path.isfile(os.path.join(model, "config.json")):
        print(f"Writing a random-weight Qwen3-0.6B-shaped checkpoint to {model} (once)")
        write_benchmark_checkpoint(model, QWEN3_0_6B, dtype="bfloat16")
    return model


def generate_both(model, device, backend, prompts, max_model_len, greedy) -> dict[str, list]:
    """The same requests through two engines, one after the other: kv_cache_dtype auto, then fp8."""
    from nanovllm import LLM

    outputs = {}
    for kv_cache_dtype in ("auto", "fp8"):
        start = time.perf_counter()
        with LLM(model, device=device, attention_backend=backend, kv_cache_dtype=kv_cache_dtype,
                 max_model_len=max_model_len, max_num_seqs=len(prompts)) as llm:
            outputs[kv_cache_dtype] = llm.generate(prompts, greedy, use_tqdm=False)
            config = llm.llm_engine.config
            print(f"kv_cache_dtype={kv_cache_dtype}: dtype {config.dtype}, backend "
                  f"{config.attention_backend}, KV pool {llm.llm_engine.num_kvcache_blocks} "
                  "blocks of "
                  f"{config.kvcache_block_size} tokens, {time.perf_counter() - start:.1f} s")
    return outputs


def report(outputs: dict[str, list], num_prompts: int):
    """Output positions agreeing up to each sequence's first divergence and position by position;
    the top-20 logprobs' difference where the context is still the same."""
    total = prefix_agreeing = agreeing = identical = 0
    errors = []  # by position with the same context: max |logprob difference| in the top-20
    for auto, fp8 in zip(outputs["auto"], outputs["fp8"]):
        a, b = auto["token_ids"], fp8["token_ids"]
        diverge = first_divergence(a, b)
        total += len(a)
        prefix_agreeing += diverge
        agreeing += sum(x == y for x, y in zip(a, b))
        identical += diverge == len(a)
        for la, lb in zip(auto["logprobs"][:diverge + 1], fp8["logprobs"][:diverge + 1]):
            errors.append(max(abs(la[t].logprob - lb[t].logprob) for t in la.keys() & lb.keys()))
    print(f"positions agreeing up to the first divergence: {prefix_agreeing / total:.1%}; "
          f"position by position: {agreeing / total:.1%}; "
          f"identical sequences: {identical}/{num_prompts}")
    print(f"top-20 logprob difference at positions with the same context ({len(errors)}): "
          f"max {max(errors):.4f}, mean of per-position max {sum(errors) / len(errors):.4f}")


def main():
    args = parse_args()
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = args.attention_backend or ("triton" if device == "cuda" else "torch")
    if device == "cpu" and backend == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    from nanovllm import SamplingParams
    from nanovllm.checkpoint.hf_config import load_hf_config
    from nanovllm.models import MODELS

    model = args.model or random_checkpoint()
    hf = load_hf_config(model, MODELS)
    max_prompt_len = min(args.max_prompt_len, hf.max_position_embeddings - args.max_tokens)
    rng = random.Random(args.seed)
    vocab = min(10000, hf.vocab_size)
    prompts = [[rng.randrange(vocab)
                for _ in range(rng.randint(args.min_prompt_len, max_prompt_len))]
               for _ in range(args.num_prompts)]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                            logprobs=20)
    outputs = generate_both(model, device, backend, prompts, max_prompt_len + args.max_tokens,
                            greedy)
    print(f"{len(prompts)} prompts x {args.max_tokens} greedy tokens, prompt lengths "
          f"{args.min_prompt_len}..{max_prompt_len}")
    report(outputs, len(prompts))


if __name__ == "__main__":
    main()
