"""N-gram speculative decoding against plain decoding, same run, on the real SmolLM2-135M-Instruct:
a copy-heavy workload (edit a given text of about 150 words: most of the answer repeats it) and
a no-copy one (answers written from scratch), greedy, every row --max-tokens long, single stream
and a batch of 64.

    python -m benchmarks.speculative                          # SmolLM2 from the nanovllm cache
    python -m benchmarks.speculative --model path/to/SmolLM2-135M-Instruct.Q4_1.gguf --k 4
    python -m benchmarks.speculative --profile --batches 1 16  # (CUDA) decode steps' GPU time

Reports output tokens/s without and with drafts, their ratio, the acceptance length (the tokens a
verified draft yields: 1 + its accepted tokens, on average) and the share of draft tokens accepted.
"""

import argparse
import statistics
import time

import torch

from nanovllm import LLM, SamplingParams

PASSAGES = [
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, the members agreed to increase funding for the library and the public parks, "
    "while reducing the amount spent on office supplies and travel. The final vote was seven to "
    "two, and the new budget will take effect on the first of January.",
    "To make bread, mix four cups of flour with a teaspoon of salt and a packet of yeast. Add "
    "warm water slowly until the dough is soft but not sticky. Knead it for ten minutes, then "
    "let it rise in a warm place for an hour. Shape the loaf, let it rise again, and bake it at "
    "two hundred degrees for thirty five minutes.",
    "The river starts high in the mountains, where snow melts each spring and feeds a hundred "
    "small streams. It flows through forests and farmland, past three old towns and a large "
    "city, before it reaches the sea. Fishermen, farmers and travellers have depended on it for "
    "thousands of years, and many stories are told about it.",
    "Our new phone has a larger screen, a faster processor and a battery that lasts two full "
    "days. The camera takes sharp pictures even in low light, and the case is made from "
    "recycled aluminium. It comes in four colours and will be available in stores next month, "
    "starting at a price of six hundred dollars.",
]
EDITS = ["Rewrite this text, changing only the word 'the' to 'THE':",
         "Repeat this text exactly, then add one sentence at the end:",
         "Copy this text word for word, fixing any spelling mistakes:",
         "Repeat the following text exactly:"]
QUESTIONS = ["Write a short poem about the sea.", "Explain how a rainbow forms.",
             "Give three tips for learning a new language.", "Describe your ideal weekend.",
             "What are the benefits of regular exercise?", "Tell a short story about a robot.",
             "Why do leaves change colour in autumn?", "How does a refrigerator keep food cold?"]


def workload(kind: str, count: int) -> list[list[dict]]:
    if kind == "copy":  # two passages a prompt: about 150 words to repeat
        return [[{"role": "user", "content": f"{EDITS[i % len(EDITS)]}\n\n"
                                             f"{PASSAGES[i % len(PASSAGES)]}\n\n"
                                             f"{PASSAGES[(i + 1) % len(PASSAGES)]}"}]
                for i in range(count)]
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(count)]


def timed(llm: LLM, conversations, params: SamplingParams, repeats: int) -> tuple[float, int]:
    """Median seconds and output tokens of `repeats` chat calls, after a warm-up of the same
    batch (greedy: every call makes the same tokens)."""
    llm.chat(conversations, params, use_tqdm=False)
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.chat(conversations, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times), sum(len(o.outputs[0].token_ids) for o in outputs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="the SmolLM2 GGUF (default: the nanovllm cache's)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=3, help="timed calls (the median counts)")
    parser.add_argument("--disable-by-batch-size", type=int,
                        help="drafting stops above this batch (default: the config's)")
    parser.add_argument("--profile", action="store_true",
                        help="profile decode steps of each workload and batch, plain and with "
                             "drafts (CUDA): wall and GPU time a step, kernels, host time")
    args = parser.parse_args()
    if args.model is None:
        from nanovllm.testing.real_model import smollm2_gguf

        args.model = smollm2_gguf()
    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    if args.profile:
        return profile(args.model, spec, args.batches)
    # Every row makes max_tokens (ignore_eos), so both runs do the same work: on a GPU, a verify
    # step's rows may break a near tie unlike a single decode row, and the answers then differ.
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rates = {}
    for label, config in (("plain", None), ("ngram", spec)):
        with LLM(args.model, max_model_len=1024, speculative_config=config) as llm:
            engine = llm.llm_engine
            for kind in ("copy", "free"):
                for batch in args.batches:
                    before = (engine.num_drafts, engine.num_draft_tokens,
                              engine.num_accepted_tokens)
                    seconds, tokens = timed(llm, workload(kind, batch), params, args.repeats)
                    after = (engine.num_drafts, engine.num_draft_tokens, engine.num_accepted_tokens)
                    # Over the timed calls and the warm-up (the same work each, greedy).
                    counts = [a - b for a, b in zip(after, before)]
                    rates[label, kind, batch] = (tokens / seconds, *counts)
    print(f"k={args.k}, prompt_lookup {args.lookup_min}-{args.lookup_max}, greedy, "
          f"max_tokens {args.max_tokens}; output tok/s")
    print(f"{'workload':>8} {'batch':>5} {'plain':>9} {'ngram':>9} {'ratio':>6} "
          f"{'accept len':>10} {'accepted':>9}")
    for kind in ("copy", "free"):
        for batch in args.batches:
            plain = rates["plain", kind, batch][0]
            ours, drafts, drafted, accepted = rates["ngram", kind, batch]
            length = 1 + accepted / drafts if drafts else 1.0
            share = accepted / drafted if drafted else 0.0
            print(f"{kind:>8} {batch:>5} {plain:>9,.0f} {ours:>9,.0f} {ours / plain:>6.2f} "
                  f"{length:>10.2f} {share:>9.0%}")


def profile(model: str, spec: dict, batches: list[int]):
    """benchmarks.profiling's decode profile of each workload and batch, plain and with drafts
    (greedy, ignore_eos, so every row runs through the profiled steps)."""
    from benchmarks.profiling import profile_decode
    from nanovllm.llm import conversation_texts

    params = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)
    for label, config in (("plain", None), ("ngram", spec)):
        with LLM(model, max_model_len=1024, speculative_config=config) as llm:
            for kind in ("copy", "free"):
                for batch in batches:
                    print(f"== {label}, {kind}, batch {batch}")
                    prompts = conversation_texts(llm.get_tokenizer(), workload(kind, batch))
                    profile_decode(llm, prompts, [params] * batch)


if __name__ == "__main__":
    main()
