"""Answer two chat questions with nanovllm.

    python example.py [--model DIR]   # ~/huggingface/Qwen3-0.6B, else a tiny random model"""

import argparse
import os
import tempfile

from nanovllm import LLM, SamplingParams
from nanovllm.utils.tiny_model import write_tiny_qwen3

DEFAULT_MODEL = os.path.expanduser("~/huggingface/Qwen3-0.6B")


def main():
    parser = argparse.ArgumentParser(description="Answer a few chat questions.")
    parser.add_argument("--model", default=None,
                        help=f"checkpoint directory (default {DEFAULT_MODEL})")
    args = parser.parse_args()

    model = args.model or (DEFAULT_MODEL if os.path.isdir(DEFAULT_MODEL) else None)
    if model is None:
        model = os.path.join(tempfile.gettempdir(), "nanovllm-tiny-qwen3")
        if not os.path.isfile(os.path.join(model, "config.json")):
            write_tiny_qwen3(model)
        print(f"No checkpoint at {DEFAULT_MODEL}: using a tiny RANDOM Qwen3 in {model}.\n"
              "Its text is meaningless; it only shows the engine working. "
              "Pass --model for real output.\n")

    questions = ["introduce yourself", "list all prime numbers within 100"]
    with LLM(model) as llm:
        outputs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                           SamplingParams(temperature=0.6, max_tokens=256))
    for question, output in zip(questions, outputs):
        print(f"\nQuestion: {question!r}\nAnswer ({output['finish_reason']}): {output['text']!r}")


if __name__ == "__main__":
    main()
