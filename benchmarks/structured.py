"""Structured outputs' cost per decode step: a grammar on every row against none, same run, at
batch 1, 16 and 64. The grammar rows follow a regex (default [a-z]+, as free text in a JSON
string is) for up to --tokens tokens; the free rows then generate exactly as many tokens as each
grammar row did (ignore_eos), so both runs take the same steps, and a step's time is a run's time
over its longest row.

    python -m benchmarks.structured            # a GPU: the random Qwen3-0.6B, a full vocabulary
    python -m benchmarks.structured --regex '[a-z]{64}'  # a bounded repetition: xgrammar's masks
                                               # cost far more per row (BENCHMARKS.md)
    python -m benchmarks.structured --model path/to/SmolLM2-135M-Instruct.Q4_1.gguf
    python -m benchmarks.structured            # a CPU: the tiny random Qwen3
    python -m benchmarks.structured --profile  # (CUDA) decode steps' GPU time, grammar and free

The random Qwen3-0.6B is read with a tokenizer that gives every one of its 151,936 ids a token
(strings of 1-4 letters), as a real tokenizer of that size does. Its own byte tokenizer would not
do: xgrammar treats the ids a tokenizer lacks as special tokens, and every accept_token scans them.
"""

import argparse
import itertools
import string
import tempfile
import time

import torch

from nanovllm import LLM, SamplingParams, StructuredOutputsParams

QWEN3_VOCAB_SIZE = 151936
PROMPT_TOKENS = 4  # each row's prompt


def write_letters_tokenizer(path: str, vocab_size: int) -> str:
    """A tokenizer whose ids are all tokens: lowercase strings of 1-4 letters, then EOS last."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    words = ("".join(letters) for n in range(1, 5)
             for letters in itertools.product(string.ascii_lowercase, repeat=n))
    vocab = dict(zip(words, range(vocab_size - 1)))
    vocab["<|im_end|>"] = vocab_size - 1
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>").save_pretrained(
        path)
    return path


def prompts_of(batch: int) -> list[list[int]]:
    """`batch` prompts of PROMPT_TOKENS ids, most of them distinct."""
    return [[1 + (row % 200), *range(2, PROMPT_TOKENS + 1)] for row in range(batch)]


def timed(llm: LLM, prompts, params) -> tuple[float, list[int]]:
    """Seconds of one generate call after the same call as a warm-up (every kernel shape it
    meets compiled), and each row's tokens."""
    llm.generate(prompts, params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [len(o.outputs[0].token_ids) for o in outputs]


def ms_a_step(llm: LLM, batch: int, regex: str, tokens: int) -> tuple[float, float]:
    """Milliseconds a step with and without a grammar on each of `batch` rows."""
    prompts = prompts_of(batch)
    spec = StructuredOutputsParams(regex=regex)
    grammar = SamplingParams(temperature=1.0, max_tokens=tokens, structured_outputs=spec)
    seconds, lengths = timed(llm, prompts, [grammar] * batch)
    free = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in lengths]
    free_seconds, free_lengths = timed(llm, prompts, free)
    assert free_lengths == lengths
    return free_seconds / max(lengths) * 1e3, seconds / max(lengths) * 1e3


def profile(llm: LLM, batches: list[int], regex: str, tokens: int):
    """benchmarks.profiling's decode profile at each batch: every row with the grammar, then
    none (rows that end early leave the profiled batch smaller)."""
    from benchmarks.profiling import profile_decode

    spec = StructuredOutputsParams(regex=regex)
    for batch in batches:
        prompts = prompts_of(batch)
        for label, params in (
                ("grammar", SamplingParams(temperature=1.0, max_tokens=tokens,
                                           structured_outputs=spec)),
                ("free", SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True))):
            print(f"== {label}, batch {batch}")
            profile_decode(llm, prompts, [params] * batch)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint (default: a tiny random Qwen3 on the CPU)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=64, help="a grammar row's most tokens")
    parser.add_argument("--regex", default="[a-z]+", help="the grammar rows' regex")
    parser.add_argument("--profile", action="store_true",
                        help="profile decode steps at each batch, grammar rows and free (CUDA)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model, options = args.model, {}
        if model is None and torch.cuda.is_available():
            from bench import resolve_model

            model = resolve_model(None, "qwen3-0.6b")
            options["tokenizer"] = write_letters_tokenizer(folder, QWEN3_VOCAB_SIZE)
        elif model is None:
            from nanovllm.testing.tiny_model import write_tiny_qwen3

            write_tiny_qwen3(folder)
            model = folder
        max_model_len = args.tokens + 64
        with LLM(model, max_num_seqs=max(args.batches), max_model_len=max_model_len,
                 **options) as llm:
            if args.profile:  # rows as long as max_model_len allows: they outlast the profile
                return profile(llm, args.batches, args.regex, max_model_len - PROMPT_TOKENS)
            print(f"grammar rows: regex {args.regex!r}, at most {args.tokens} tokens")
            print(f"{'batch':>5} {'no grammar ms':>14} {'grammar ms':>11} {'ratio':>6}")
            for batch in args.batches:
                free, constrained = ms_a_step(llm, batch, args.regex, args.tokens)
                print(f"{batch:>5} {free:>14.3f} {constrained:>11.3f} {constrained / free:>6.2f}")


if __name__ == "__main__":
    main()
