"""Greedy agreement with transformers' float32 on the real SmolLM2-135M-Instruct, on a GPU:
for transformers' bf16 and our float32, bf16 and bf16 with an fp8 KV cache, how many of the chat
prompts give the same tokens as transformers' float32, and the mean common prefix.

    python -m benchmarks.accuracy                 # 20 prompts x 64 tokens
"""

import argparse

import torch

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.",
    "How many legs does a spider have?", "Write a haiku about the sea.",
    "What is 12 times 7?", "Explain photosynthesis in one sentence.",
    "Who wrote Romeo and Juliet?", "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?", "Translate 'good morning' into Spanish.",
    "List the planets of the solar system.", "What does a thermometer measure?",
    "Describe a cat in two sentences.", "Why is the sky blue?",
    "What is the largest ocean on Earth?", "Suggest a name for a pet goldfish.",
    "How do you make a cup of tea?", "What is the square root of 81?",
    "Name a famous painting by Leonardo da Vinci.", "What language is spoken in Brazil?",
]


def chat_prompts(path: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                          add_generation_prompt=True, return_dict=False)
            for q in QUESTIONS[:count]]


def hf_greedy(path: str, prompts: list[list[int]], num_tokens: int, dtype) -> list[list[int]]:
    """Transformers' greedy tokens, one prompt at a time (no padding), EOS not special."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids, past, out = torch.tensor([prompt], device="cuda"), None, []
            for _ in range(num_tokens):
                step = model(ids, past_key_values=past, use_cache=True)
                past = step.past_key_values
                out.append(step.logits[0, -1].argmax().item())
                ids = torch.tensor([[out[-1]]], device="cuda")
            outputs.append(out)
    del model
    torch.cuda.empty_cache()
    return outputs


def ours_greedy(path: str, prompts: list[list[int]], num_tokens: int, **options):
    from nanovllm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    with LLM(path, **options) as llm:
        return [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> tuple[int, float]:
    """(prompts identical to the reference, mean common prefix length in tokens)."""
    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    prefixes = [common(a, b) for a, b in zip(reference, tokens)]
    return sum(a == b for a, b in zip(reference, tokens)), sum(prefixes) / len(prefixes)


def measure(path: str, num_prompts: int = 20, num_tokens: int = 64) -> dict[str, tuple]:
    """{name: (identical prompts, mean common prefix)} against transformers' float32."""
    prompts = chat_prompts(path, num_prompts)
    reference = hf_greedy(path, prompts, num_tokens, torch.float32)
    runs = {
        "transformers bf16": hf_greedy(path, prompts, num_tokens, torch.bfloat16),
        "nanovllm float32": ours_greedy(path, prompts, num_tokens, dtype="float32"),
        "nanovllm bf16": ours_greedy(path, prompts, num_tokens, dtype="bfloat16"),
        "nanovllm bf16, fp8 KV": ours_greedy(path, prompts, num_tokens, dtype="bfloat16",
                                             kv_cache_dtype="fp8"),
    }
    return {name: agreement(reference, tokens) for name, tokens in runs.items()}


def main():
    from nanovllm.testing.real_model import smollm2_safetensors

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--num-tokens", type=int, default=64)
    args = parser.parse_args()
    figures = measure(smollm2_safetensors("float32"), args.num_prompts, args.num_tokens)
    print(f"| run | identical of {args.num_prompts} | mean common prefix "
          f"(of {args.num_tokens}) |\n|---|---|---|")
    for name, (identical, prefix) in figures.items():
        print(f"| {name} | {identical} | {prefix:.1f} |")


if __name__ == "__main__":
    main()
