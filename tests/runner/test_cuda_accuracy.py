"""On an NVIDIA GPU (skipped without CUDA), judged by transformers: float32 end to end gives
transformers' float32 tokens; bf16 and the fp8 KV cache agree with transformers' float32 on a real
model no worse than transformers' own bf16 does."""

import pytest
import torch

from benchmarks.accuracy import chat_prompts, hf_greedy, measure
from nanovllm import LLM, SamplingParams
from tests.conftest import needs_cuda
from tests.models.test_model import our_logits

pytestmark = needs_cuda  # conftest adds the `cuda` marker
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Stated margins against transformers' bf16: prompts identical to float32, mean common prefix.
BF16_MARGIN = (3, 8.0)
FP8_KV_MARGIN = (5, 12.0)


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_untied"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_float32_on_cuda_equals_transformers(fixture, enforce_eager, prompts, request):
    """Graphs, overlapped steps and the sampler in float32, against transformers' float32."""
    path = request.getfixturevalue(fixture)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens, torch.float32)
    with LLM(path, dtype="float32", enforce_eager=enforce_eager, max_model_len=512) as llm:
        assert llm.llm_engine.config.attention_backend == "triton"
        ours = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7, max_tokens=16)
        first, again = (llm.generate(prompts, seeded, use_tqdm=False) for _ in range(2))
    assert ours == expected
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in again]


def test_flash_attn_refuses_float32(tiny_model):
    with pytest.raises(ValueError, match="flash_attn.*float32"):
        LLM(tiny_model, dtype="float32", attention_backend="flash_attn")


def test_real_model_agrees_with_transformers_float32(smollm2_dir):
    """Greedy over 20 chat prompts x 64 tokens: our float32 is transformers' float32; our bf16
    and fp8-KV runs stay within the stated margins of transformers' own bf16."""
    figures = measure(smollm2_dir, num_prompts=20, num_tokens=64)
    print(figures)
    assert figures["nanovllm float32"][0] == 20, figures
    hf_identical, hf_prefix = figures["transformers bf16"]
    for name, (prompts, tokens) in (("nanovllm bf16", BF16_MARGIN),
                                    ("nanovllm bf16, fp8 KV", FP8_KV_MARGIN)):
        identical, prefix = figures[name]
        assert identical >= hf_identical - prompts and prefix >= hf_prefix - tokens, figures


def test_real_model_clear_winners_agree(smollm2_dir):
    """Along transformers' float32 greedy path, wherever its top-2 margin exceeds 4x the bf16
    logit error (ours or transformers'), our bf16 top-1 token is float32's."""
    from transformers import AutoModelForCausalLM

    prompts = chat_prompts(smollm2_dir, 8)
    paths = [p + c for p, c in zip(prompts, hf_greedy(smollm2_dir, prompts, 32, torch.float32))]
    with LLM(smollm2_dir, dtype="bfloat16", enforce_eager=True) as llm:
        ours = our_logits(llm, paths)
    hf32 = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).cuda().eval()
    hf16 = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).cuda().eval()
    clear = checked = 0
    for prompt, path, logits in zip(prompts, paths, ours):
        with torch.no_grad():
            ids = torch.tensor([path], device="cuda")
            ref, theirs = hf32(ids).logits[0].float(), hf16(ids).logits[0].float()
        start = len(prompt) - 1  # the positions that predict the completion
        error = torch.maximum((logits.float() - ref).abs().amax(-1), (theirs - ref).abs().amax(-1))
        top2 = ref.topk(2, dim=-1).values
        is_clear = (top2[:, 0] - top2[:, 1] > 4 * error)[start:]
        agree = (logits.float().argmax(-1) == ref.argmax(-1))[start:]
        clear += int(is_clear.sum())
        checked += is_clear.numel()
        assert bool(agree[is_clear].all()), (prompt, agree, is_clear)
    assert clear >= checked // 4, f"only {clear} of {checked} positions had a clear winner"
