"""Where the tiny bf16 Qwen3-MoE's decode graphs part from its eager decode (CUDA): the first
differing prompt and token, then the same comparison with one suspect made equal in both modes at a
time (attention splits fixed, the MoE partials summed in place, the MoE tiles fixed).

    python -m tools.moe_graphs_vs_eager
"""

import tempfile
from contextlib import ExitStack
from unittest import mock

from nanovllm import LLM, SamplingParams
from nanovllm.kernels import moe
from nanovllm.kernels.attention import decode
from nanovllm.layers import fused_moe
from nanovllm.utils.tiny_model import write_tiny_qwen3_moe

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 256 for j in range(5 + 40 * i)] for i in range(12)]


def first_difference(path: str) -> str:
    tokens = {}
    for eager in (True, False):
        with LLM(path, max_model_len=1024, enforce_eager=eager) as llm:
            tokens[eager] = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    for p, (a, b) in enumerate(zip(tokens[True], tokens[False])):
        if a != b:
            t = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            return f"prompt {p} parts at token {t}"
    return "identical"


def summed_in_place(original):
    def call(*args, **kwargs):
        return original(*args, **{**kwargs, "defer_sum": False})
    return call


SUSPECTS = {
    "none": [],
    "attention: 1 split": [mock.patch.object(decode, "_decode_num_splits",
                                             lambda *args, **kwargs: 1)],
    "MoE: partials summed in place": [mock.patch.object(
        fused_moe, "fused_moe", summed_in_place(fused_moe.fused_moe))],
    "MoE: decode tiles always": [mock.patch.object(moe, "moe_tiles",
                                                   lambda *args: moe.DECODE_TILES)],
}


def main():
    with tempfile.TemporaryDirectory() as path:
        write_tiny_qwen3_moe(path, dtype="bfloat16", hidden_size=256, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=128, intermediate_size=512,
                             moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4)
        for name, patches in SUSPECTS.items():
            with ExitStack() as stack:
                for patch in patches:
                    stack.enter_context(patch)
                print(f"{name:>32}: {first_difference(path)}", flush=True)


if __name__ == "__main__":
    main()
