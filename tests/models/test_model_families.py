"""Qwen2 and Llama (llama3 RoPE scaling, tied and untied) against transformers on the same random
weights, float32 on CPU; architecture and feature checks at the config boundary."""

import json
import os

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.layers.rotary_embedding import rope_inv_freq
from nanovllm.models import MODELS
from nanovllm.testing.tiny_model import write_tiny_llama, write_tiny_qwen2
from tests.conftest import NUM_NEW_TOKENS, _hf_model, hf_greedy
from tests.models.test_model import our_logits

pytestmark = pytest.mark.cpu_suite  # exact against transformers on the CPU (see conftest)

FAMILIES = {
    "qwen2": lambda path: write_tiny_qwen2(path),
    "llama": lambda path: write_tiny_llama(path),
    "llama-untied": lambda path: write_tiny_llama(path, seed=1, tie_word_embeddings=False),
}
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp(f"tiny-{request.param}"))
    FAMILIES[request.param](path)
    return path


@pytest.fixture(scope="module")
def family_reference(family_model, prompts) -> list[list[int]]:
    return [hf_greedy(family_model, p, NUM_NEW_TOKENS) for p in prompts]


def test_logits_match_transformers(family_model, prompts):
    # The last prompt runs past the tiny Llama's original_max_position_embeddings (256).
    batch = prompts[:6] + [[(5 * i) % 256 for i in range(300)]]
    hf = _hf_model(family_model)
    with LLM(family_model, kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        ours = our_logits(llm, batch)
    for prompt, logits in zip(batch, ours):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_matches_transformers(family_model, prompts, family_reference, tp):
    with LLM(family_model, tensor_parallel_size=tp, kvcache_block_size=16,
             num_kvcache_blocks=64) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == family_reference


def test_qwen2_5_head_layout_on_triton_kernels(tmp_path):
    # Qwen2.5-0.5B's heads (14 query heads on 2 KV heads: groups of 7, head_dim 64), the layout that
    # runs on the Triton backend on GPU; on CPU the kernels run under Triton's interpreter.
    path = str(tmp_path)
    write_tiny_qwen2(path, hidden_size=896, num_attention_heads=14, num_key_value_heads=2)
    prompts = [[1, 2, 3, 4, 5], list(range(40, 77)), [9] * 20]
    expected = [hf_greedy(path, p, 6) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=32, attention_backend="triton") as llm:
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected


def test_llama3_inv_freq_is_transformers(tmp_path):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    write_tiny_llama(str(tmp_path))
    config = AutoConfig.from_pretrained(str(tmp_path))
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config)
    ours = rope_inv_freq(16, config)
    assert attention_factor == 1.0
    assert torch.equal(ours, expected)
    # The tiny config exercises all three bands: kept, interpolated, divided by the factor.
    ratio = (ours / rope_inv_freq(16, AutoConfig.for_model("llama", rope_theta=10000.0))).tolist()
    assert ratio[:3] == [1.0] * 3 and 0.125 < ratio[3] < 1 and ratio[4:] == [0.125] * 4


def _write_config(path, **fields) -> str:
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=320,
                  hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config.update(fields)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def test_unsupported_architecture_lists_supported(tmp_path):
    path = _write_config(tmp_path, architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(ValueError, match="MistralForCausalLM") as info:
        LLM(path)
    assert all(arch in str(info.value) for arch in MODELS)


@pytest.mark.parametrize("fields,match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 256}}, "yarn"),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True,
      "sliding_window": 64, "max_window_layers": 1}, "sliding-window"),
    ({"hidden_act": "gelu"}, "gelu"),
])
def test_unsupported_features_are_rejected(tmp_path, fields, match):
    with pytest.raises(ValueError, match=match):
        LLM(_write_config(tmp_path, **fields))


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_benchmark_checkpoint_loads_strictly_in_shards(tmp_path, architecture):
    """bench.py's fast writer (meta-device shapes, tensors drawn one by one) produces exactly the
    tensors our strict loader expects, across several shards, with a config transformers reads."""
    from transformers import AutoConfig

    from nanovllm.testing.tiny_model import tiny_qwen3_arch, write_benchmark_checkpoint

    arch = {"architectures": [architecture], **tiny_qwen3_arch(tie_word_embeddings=False)}
    path = str(tmp_path / "bench-ckpt")
    write_benchmark_checkpoint(path, arch, dtype="float32", shard_bytes=1 << 16)
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(shards) > 3
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=16) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        out = llm.generate([[1, 2, 3]], greedy, use_tqdm=False)
    assert len(out[0]["token_ids"]) == 4
    assert AutoConfig.from_pretrained(path).architectures == [architecture]
