"""Our Qwen3 against transformers on the same random weights (float32, CPU)."""

import pytest
import torch

from nanovllm import LLM
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from tests.conftest import _hf_model

pytestmark = pytest.mark.cpu_suite  # exact against transformers on the CPU (see conftest)


def our_logits(llm, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits at every position of every prompt from one batched prefill."""
    runner = llm.model_runner
    seqs = []
    for prompt in prompts:
        seq = Sequence(prompt, SamplingParams(), llm.config.kvcache_block_size)
        llm.scheduler.block_manager.allocate(seq, [])
        seq.num_scheduled_tokens = len(prompt)
        seqs.append(seq)
    input_ids, positions, meta, _ = runner.prepare_prefill(seqs)
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.model(input_ids, positions, meta))
    for seq in seqs:
        llm.scheduler.block_manager.deallocate(seq)
    return list(logits.split([len(p) for p in prompts]))


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_untied"])
def test_logits_match_transformers(fixture, prompts, request):
    path = request.getfixturevalue(fixture)
    hf = _hf_model(path)
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        ours = our_logits(llm, prompts[:6])
    for prompt, logits in zip(prompts[:6], ours):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_each_linear_layer_prefetches_the_next_ones_weight(tiny_model, prompts, monkeypatch):
    """The decoder gives each linear layer the weight of the one that runs after it (the skinny GEMM's
    `prefetch`): qkv -> o_proj -> gate_up -> down -> the next layer's qkv; the last layer's down_proj none."""
    from nanovllm.layers import linear as linear_module

    calls = []
    real_linear = linear_module.linear

    def spy(x, weight, bias=None, defer_sum=False, prefetch=None):
        calls.append((weight, prefetch))
        return real_linear(x, weight, bias, defer_sum, prefetch)

    monkeypatch.setattr(linear_module, "linear", spy)
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        calls.clear()
        our_logits(llm, prompts[:1])
        layers = llm.model_runner.model.model.layers
    expected = [w for layer in layers for w in (layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
                                                layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight)]
    assert len(calls) == len(expected) == 4 * len(layers)
    assert all(weight is layer_weight for (weight, _), layer_weight in zip(calls, expected))
    assert all(prefetch is next_weight for (_, prefetch), next_weight in zip(calls, [*expected[1:], None]))
