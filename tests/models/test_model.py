"""Our Qwen3 against transformers on the same random weights (float32, CPU)."""

import pytest
import torch

from nanovllm import LLM
from nanovllm.engine.scheduler import scheduled_step
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from tests.conftest import _hf_model

pytestmark = pytest.mark.cpu_suite  # exact against transformers on the CPU (see conftest)


def our_logits(llm, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits at every position of every prompt from one batched prefill."""
    runner = llm.llm_engine.model_runner
    seqs = []
    for prompt in prompts:
        seq = Sequence(prompt, SamplingParams(), llm.llm_engine.config.kvcache_block_size)
        llm.llm_engine.scheduler.block_manager.allocate(seq, [])
        seq.num_scheduled_tokens = len(prompt)
        seqs.append(seq)
    input_ids, positions, meta, _ = runner.inputs.prepare_prefill(scheduled_step(seqs, True))
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.model(input_ids, positions, meta))
    for seq in seqs:
        llm.llm_engine.scheduler.block_manager.deallocate(seq)
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
