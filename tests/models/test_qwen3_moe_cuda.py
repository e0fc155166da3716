"""Qwen3-MoE on an NVIDIA GPU (skipped without CUDA): the fused Triton experts in bf16, eagerly and
in the decode graphs, against transformers and against each other."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.testing.tiny_model import write_benchmark_checkpoint, write_tiny_qwen3_moe
from tests.conftest import needs_cuda
from tests.models.test_model import our_logits

pytestmark = needs_cuda  # conftest adds the `cuda` marker
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_moe_bf16(tmp_path_factory) -> str:
    """head_dim 128, 16 experts of 128 rows, top 4: tiles of the decode and prefill configs."""
    path = str(tmp_path_factory.mktemp("tiny-moe-bf16"))
    write_tiny_qwen3_moe(path, dtype="bfloat16", hidden_size=256, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=128, intermediate_size=512,
                         moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4)
    return path


def test_decode_graphs_give_the_eager_tokens(tiny_moe_bf16):
    """12 rows padded to the graphs' 16: the padding rows' experts change no real row."""
    prompts = [[(7 * i + j) % 256 for j in range(5 + 18 * i)] for i in range(12)]
    outputs = {}
    for eager in (True, False):  # max_model_len 256: one split of the keys, as in eager steps
        with LLM(tiny_moe_bf16, max_model_len=256, enforce_eager=eager) as llm:
            outputs[eager] = [o["token_ids"]
                              for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert outputs[True] == outputs[False]


def test_bf16_logits_as_close_to_float32_as_transformers_bf16(tiny_moe_bf16):
    """Mean errors, not max: a near tie in the router may pick another expert in bf16, at
    different positions in either engine."""
    from transformers import AutoModelForCausalLM

    prompts = [[1, 2, 3, 4, 5], list(range(40, 140)), [9] * 300]  # 20 to 1,200 assignments
    hf16 = AutoModelForCausalLM.from_pretrained(tiny_moe_bf16, dtype=torch.bfloat16).cuda().eval()
    hf32 = AutoModelForCausalLM.from_pretrained(tiny_moe_bf16, dtype=torch.float32).cuda().eval()
    with LLM(tiny_moe_bf16, max_model_len=1024, enforce_eager=True) as llm:
        ours = our_logits(llm, prompts)
    for prompt, logits in zip(prompts, ours):
        with torch.no_grad():
            ids = torch.tensor([prompt], device="cuda")
            ref, theirs = hf32(ids).logits[0].float(), hf16(ids).logits[0].float()
        our_err, their_err = (logits.float() - ref).abs().mean(), (theirs - ref).abs().mean()
        assert our_err <= 2 * their_err + 1e-3, (our_err, their_err)


def test_random_30b_a3b_layer_shape_runs(tmp_path):
    """One layer of Qwen3-30B-A3B's shape (a small vocabulary), from the benchmark writer's
    per-expert tensors, through prefill and the decode graphs."""
    from nanovllm.testing.tiny_model import QWEN3_30B_A3B

    write_benchmark_checkpoint(str(tmp_path), dict(QWEN3_30B_A3B, num_hidden_layers=1,
                                                   vocab_size=1024))
    with LLM(str(tmp_path), max_model_len=1024) as llm:
        outputs = llm.generate([[1, 2, 3], list(range(500))], GREEDY, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [24, 24]
