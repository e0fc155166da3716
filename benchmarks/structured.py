"""Structured outputs' cost per decode step: a grammar on every row against none, same run, at
batch 1, 16 and 64. Each row generates exactly --tokens tokens (the grammar, [a-z]{N}, ends just
there; the free rows ignore EOS), so a step's time is the run's time over N.

    python -m benchmarks.structured --model Qwen/Qwen3-0.6B      # on a GPU
    python -m benchmarks.structured                               # the tiny random model, CPU
"""

import argparse
import tempfile
import time

from nanovllm import LLM, SamplingParams, StructuredOutputsParams


def ms_a_step(llm: LLM, batch: int, tokens: int, grammar: bool) -> float:
    """Mean milliseconds per token position of `batch` rows of `tokens` tokens each."""
    spec = StructuredOutputsParams(regex=f"[a-z]{{{tokens}}}") if grammar else None
    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=not grammar,
                            structured_outputs=spec)
    prompts = [[1 + (row % 200), 2, 3, 4] for row in range(batch)]
    llm.generate(prompts[:1], params, use_tqdm=False)  # compiles the grammar, warms the paths
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == tokens for o in outputs)
    return seconds / tokens * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint (default: a tiny random Qwen3 on the CPU)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = args.model
        if model is None:
            from nanovllm.testing.tiny_model import write_tiny_qwen3

            write_tiny_qwen3(folder)
            model = folder
        with LLM(model, max_num_seqs=max(args.batches), max_model_len=args.tokens + 64) as llm:
            print(f"{'batch':>5} {'no grammar ms':>14} {'grammar ms':>11} {'ratio':>6}")
            for batch in args.batches:
                free = ms_a_step(llm, batch, args.tokens, grammar=False)
                constrained = ms_a_step(llm, batch, args.tokens, grammar=True)
                print(f"{batch:>5} {free:>14.3f} {constrained:>11.3f} {constrained / free:>6.2f}")


if __name__ == "__main__":
    main()
