"""Our engine against transformers' own generate (its MoE path) on the same requests, in one process
(CUDA): bench.py's first prompts (100-1,024 tokens, seed 0), each generating a fixed number of
tokens by temperature 0.6, on a random-weight Qwen3-30B-A3B checkpoint (written once) or --model.

    python -m benchmarks.moe_vs_transformers                  # 16 requests x 128 new tokens
    python -m benchmarks.moe_vs_transformers --num-seqs 64 --new-tokens 256 --random-layers 24

transformers pads the batch to its longest prompt and keeps every row to the end; both sides count
num_seqs x new_tokens tokens. Ours runs first and is closed before transformers loads."""

import argparse
import gc
import time

import torch

from bench import resolve_model, upstream_workload
from nanovllm import LLM, SamplingParams


def run_ours(path: str, prompts: list[list[int]], new_tokens: int, utilization: float) -> float:
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=new_tokens)
    with LLM(path, max_model_len=4096, gpu_memory_utilization=utilization) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    assert all(len(o["token_ids"]) == new_tokens for o in outputs)
    return seconds


def run_transformers(path: str, prompts: list[list[int]], new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
    model.eval()
    pad = model.generation_config.pad_token_id or 0
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    kwargs = dict(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(ids[:2, -16:], attention_mask=mask[:2, -16:], max_new_tokens=4,
                       **kwargs)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, **kwargs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    assert out.shape[1] == width + new_tokens
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: a random-weight Qwen3-30B-A3B")
    parser.add_argument("--random-layers", type=int, default=None)
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs CUDA")
    path = resolve_model(args.model, "qwen3-30b-a3b", args.random_layers)
    prompts, _ = upstream_workload(args.num_seqs)
    tokens = args.num_seqs * args.new_tokens
    ours = run_ours(path, prompts, args.new_tokens, args.gpu_memory_utilization)
    print(f"nanovllm: {tokens} tokens in {ours:.2f} s = {tokens / ours:,.1f} tok/s", flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    theirs = run_transformers(path, prompts, args.new_tokens)
    print(f"transformers: {tokens} tokens in {theirs:.2f} s = {tokens / theirs:,.1f} tok/s")
    print(f"nanovllm / transformers: {theirs / ours:.1f}x ({args.num_seqs} requests, prompts "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.new_tokens} new each)")


if __name__ == "__main__":
    main()
