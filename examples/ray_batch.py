"""Offline batch inference over a Ray Data dataset: a pool of engine actors turns the rows'
prompts into completions, streaming (the dataset may be larger than memory).

    python examples/ray_batch.py                  # a tiny random model, 64 rows, 2 replicas
    python examples/ray_batch.py --model ~/huggingface/Qwen3-0.6B --rows 10000 --replicas 8
    RAY_ADDRESS=auto python examples/ray_batch.py ...   # on a running Ray cluster

Each replica takes `--tensor-parallel-size` GPUs (one CPU without a GPU)."""

import argparse
import os
import tempfile

import ray

from nanovllm import SamplingParams
from nanovllm.ray_data import generate_dataset
from nanovllm.testing.tiny_model import write_tiny_qwen3


def tiny_model() -> str:
    model = os.path.join(tempfile.gettempdir(), "nanovllm-tiny-qwen3")
    if not os.path.isfile(os.path.join(model, "config.json")):
        write_tiny_qwen3(model)
    print(f"No --model: a tiny RANDOM Qwen3 in {model}; its text is meaningless.")
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: tiny)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=2, help="engine actors in the pool")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--output", default=None, help="write the completions here (parquet)")
    args = parser.parse_args()
    model = args.model or tiny_model()

    ray.init()  # RAY_ADDRESS picks a cluster; without it, a local Ray
    questions = ray.data.from_items(
        [{"id": i, "prompt": f"Question {i}: what is {i} + {i}?"} for i in range(args.rows)])
    completions = generate_dataset(
        questions, model, SamplingParams(temperature=0, max_tokens=args.max_tokens),
        num_replicas=args.replicas, tensor_parallel_size=args.tensor_parallel_size)
    if args.output:
        completions.write_parquet(args.output)
        print(f"{args.rows} completions written to {args.output}")
        return
    for row in sorted(completions.take_all(), key=lambda row: row["id"])[:5]:
        print(f"{row['prompt']!r} -> {row['generated_text']!r} ({row['finish_reason']})")


if __name__ == "__main__":
    main()
