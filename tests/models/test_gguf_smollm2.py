"""The real SmolLM2-135M-Instruct Q4_1 GGUF: greedy tokens and the chat template against
transformers loading the same file, float32 on the CPU; bfloat16 on a GPU."""

import os

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.conftest import needs_cuda
from tests.models.test_gguf import greedy

NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def transformers_smollm2(smollm2_gguf):
    """(model, tokenizer) as transformers loads them from the GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(smollm2_gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    with LLM(smollm2_gguf, dtype="float32", max_model_len=512, kvcache_block_size=16,
             num_kvcache_blocks=64) as llm:
        yield llm


@pytest.mark.cpu_suite  # exact against transformers on the CPU (see conftest)
def test_greedy_tokens_equal_transformers_on_the_same_file(smollm2, transformers_smollm2):
    model, tokenizer = transformers_smollm2
    outputs = smollm2.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        expected = greedy(model, tokenizer.encode(prompt), NUM_TOKENS)
        assert output["token_ids"] == expected, prompt
        assert output["text"] == tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.cpu_suite
def test_chat_uses_the_files_template(smollm2, transformers_smollm2):
    model, tokenizer = transformers_smollm2
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                           return_dict=False)
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(prompt)
    (output,) = smollm2.chat(conversation, GREEDY, use_tqdm=False)
    assert output["token_ids"] == greedy(model, prompt, NUM_TOKENS)


@needs_cuda
def test_gguf_runs_on_the_gpu_in_bfloat16(smollm2_gguf):
    with LLM(smollm2_gguf, max_model_len=512) as llm:
        assert llm.llm_engine.config.dtype == "bfloat16"  # the default for a GGUF on CUDA
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert "Paris" in outputs[0]["text"]
    assert [len(o["token_ids"]) for o in outputs] == [NUM_TOKENS] * len(PROMPTS)
