"""Generate text with nanovllm.

    python example.py                      # ~/huggingface/Qwen3-0.6B if present, else a tiny random model
    python example.py --model /path/to/Qwen3-0.6B
"""

import argparse
import os
import tempfile

from nanovllm import LLM, SamplingParams
from nanovllm.utils.tiny_model import write_tiny_qwen3

DEFAULT_MODEL = os.path.expanduser("~/huggingface/Qwen3-0.6B")


def main():
    parser = argparse.ArgumentParser(description="Generate completions for a few chat prompts.")
    parser.add_argument("--model", default=None, help=f"checkpoint directory (default {DEFAULT_MODEL})")
    args = parser.parse_args()

    model = args.model or (DEFAULT_MODEL if os.path.isdir(DEFAULT_MODEL) else None)
    if model is None:
        model = os.path.join(tempfile.gettempdir(), "nanovllm-tiny-qwen3")
        if not os.path.isfile(os.path.join(model, "config.json")):
            write_tiny_qwen3(model)
        print(f"No checkpoint at {DEFAULT_MODEL}: using a tiny RANDOM Qwen3 in {model}.\n"
              "Its text is meaningless; it only shows the engine working. Pass --model for real output.\n")

    with LLM(model) as llm:
        tokenizer = llm.tokenizer
        questions = ["introduce yourself", "list all prime numbers within 100"]
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                 add_generation_prompt=True) for q in questions]
        outputs = llm.generate(prompts, SamplingParams(temperature=0.6, max_tokens=256))
    for prompt, output in zip(prompts, outputs):
        print(f"\nPrompt: {prompt!r}\nCompletion ({output['finish_reason']}): {output['text']!r}")


if __name__ == "__main__":
    main()
