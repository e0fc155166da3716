"""GGUF checkpoints on tiny random models written as llama.cpp does (F32 and Q8_0), against
transformers: names mapped, llama's Q/K rows unpermuted, config and tokenizer from the metadata;
and the errors for what cannot be read."""

import os
import shutil
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoint import gguf as gguf_checkpoint
from nanovllm.checkpoint.gguf import gguf_weights
from nanovllm.checkpoint.hf_config import head_dim
from nanovllm.config import Config
from nanovllm.testing.tiny_model import write_tiny_llama, write_tiny_qwen2, write_tiny_qwen3
from tests.conftest import NUM_NEW_TOKENS, hf_greedy
from tests.models.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.cpu_suite  # exact against transformers on the CPU (see conftest)

GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
ENGINE = dict(kvcache_block_size=16, num_kvcache_blocks=64)
WRITERS = {  # GGUF has no llama3 RoPE scaling metadata: the tiny Llama gets the default RoPE
    "llama": lambda path: write_tiny_llama(path, rope_scaling={}),
    "llama-untied": lambda path: write_tiny_llama(path, seed=1, rope_scaling={},
                                                  tie_word_embeddings=False),
    "qwen2": write_tiny_qwen2,
    "qwen3": write_tiny_qwen3,
}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def tiny_gguf(request, tmp_path_factory) -> tuple[str, str]:
    """(safetensors checkpoint, the same weights as an F32 GGUF file)."""
    checkpoint = str(tmp_path_factory.mktemp(f"tiny-{request.param}"))
    WRITERS[request.param](checkpoint)
    path = str(tmp_path_factory.mktemp(f"gguf-{request.param}") / "tiny.gguf")
    write_tiny_gguf(checkpoint, path)
    return checkpoint, path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    checkpoint = str(tmp_path_factory.mktemp("tiny-llama-source"))
    write_tiny_llama(checkpoint, rope_scaling={})
    return checkpoint


def test_f32_tensors_are_the_checkpoints_under_hf_names(tiny_gguf):
    checkpoint, path = tiny_gguf
    expected = load_file(os.path.join(checkpoint, "model.safetensors"))
    ours = dict(gguf_weights(path))
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name


def test_config_from_metadata_matches_the_checkpoints(tiny_gguf):
    checkpoint, path = tiny_gguf
    ours, source = Config(path, device="cpu").hf_config, Config(checkpoint, device="cpu").hf_config
    assert ours.architectures == source.architectures
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                 "tie_word_embeddings", "max_position_embeddings", "eos_token_id"):
        assert getattr(ours, name) == pytest.approx(getattr(source, name)), name
    assert head_dim(ours) == head_dim(source)
    assert ours.rope_parameters["rope_theta"] == source.rope_parameters["rope_theta"]


def test_f32_gguf_greedy_equals_transformers_on_the_source_checkpoint(tiny_gguf, prompts):
    checkpoint, path = tiny_gguf
    expected = [hf_greedy(checkpoint, p, NUM_NEW_TOKENS) for p in prompts[:4]]
    with LLM(path, **ENGINE) as llm:
        outputs = llm.generate(prompts[:4], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected


def test_gguf_under_tensor_parallelism(tiny_llama, prompts, tmp_path):
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(tiny_llama, path)
    with LLM(path, tensor_parallel_size=2, **ENGINE) as llm:
        outputs = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [hf_greedy(tiny_llama, p, NUM_NEW_TOKENS)
                                                 for p in prompts[:2]]


def test_q8_0_gguf_greedy_equals_transformers_on_the_same_file(tiny_llama, prompts, tmp_path):
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / "tiny-q8_0.gguf")
    write_tiny_gguf(tiny_llama, path, qtype="Q8_0")
    q_proj = dict(gguf_weights(path))["model.layers.0.self_attn.q_proj.weight"]
    source = load_file(os.path.join(tiny_llama, "model.safetensors"))
    exact = source["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q_proj, exact)  # quantized, and dequantized in HF row order:
    torch.testing.assert_close(q_proj, exact, atol=0.02, rtol=0)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny-q8_0.gguf",
                                              dtype=torch.float32).eval()
    with LLM(path, **ENGINE) as llm:
        outputs = llm.generate(prompts[:4], GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts[:4], outputs):
        assert output["token_ids"] == greedy(hf, prompt, NUM_NEW_TOKENS)


def test_chat_uses_the_gguf_tokenizer_and_template(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(tiny_llama, path)
    conversation = [{"role": "user", "content": "What is 2 + 2?"}]
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                           return_dict=False)
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    with LLM(path, **ENGINE) as llm:
        (output,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert output["token_ids"] == hf_greedy(tiny_llama, prompt, NUM_NEW_TOKENS)


def test_a_directory_holding_one_gguf_loads_it(tiny_llama, tmp_path):
    write_tiny_gguf(tiny_llama, str(tmp_path / "model.gguf"))
    assert Config(str(tmp_path), device="cpu").model == str(tmp_path / "model.gguf")


# ---- errors --------------------------------------------------------------------------------------

def test_unsupported_architecture_names_the_file(tiny_llama, tmp_path):
    path = str(tmp_path / "gpt2.gguf")
    write_tiny_gguf(tiny_llama, path, arch="gpt2")
    with pytest.raises(ValueError, match=f"unsupported GGUF architecture 'gpt2' in '{path}'; "
                                         "supported: llama, qwen2, qwen3"):
        LLM(path)


@pytest.mark.parametrize("keep", ["header", "tensors"])
def test_truncated_gguf_names_the_file(tiny_llama, tmp_path, keep):
    whole = str(tmp_path / "whole.gguf")
    write_tiny_gguf(tiny_llama, whole)
    size = os.path.getsize(whole)
    path = str(tmp_path / "cut.gguf")
    with open(whole, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(100 if keep == "header" else size - 1000))
    with pytest.raises(ValueError, match=f"cannot read '{path}': truncated or not a GGUF file"):
        LLM(path)


def test_llama3_rope_frequencies_are_refused(tiny_llama, tmp_path):
    path = str(tmp_path / "rope.gguf")
    write_tiny_gguf(tiny_llama, path, extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="rope_freqs"):
        LLM(path)


def test_split_gguf_is_refused(tiny_llama, tmp_path):
    path = str(tmp_path / "model-00001-of-00002.gguf")
    write_tiny_gguf(tiny_llama, path, extra_uint16={"split.count": 2})
    with pytest.raises(ValueError, match=f"'{path}' is one part of a split GGUF"):
        LLM(path)


def test_unknown_tensor_names_the_tensor_and_file(tiny_llama, tmp_path):
    path = str(tmp_path / "extra.gguf")
    extra = {"blk.0.mystery.weight": np.ones(8, np.float32)}
    write_tiny_gguf(tiny_llama, path, extra_tensors=extra)
    with pytest.raises(ValueError, match=f"unexpected tensor 'blk.0.mystery.weight' in '{path}'"):
        list(gguf_weights(path))


def test_missing_gguf_package_says_how_to_install_it(tiny_llama, tmp_path, monkeypatch):
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(tiny_llama, path)
    gguf_checkpoint._reader.cache_clear()
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match=f"'{path}' is a GGUF file; reading it needs the gguf "
                                          "package: pip install 'nanovllm\\[gguf\\]'"):
        LLM(path)


def test_several_ggufs_in_a_directory_need_gguf_file(tiny_llama, tmp_path):
    write_tiny_gguf(tiny_llama, str(tmp_path / "a.gguf"))
    shutil.copy(tmp_path / "a.gguf", tmp_path / "b.gguf")
    with pytest.raises(ValueError, match="several GGUF files \\(a.gguf, b.gguf\\); pick one"):
        LLM(str(tmp_path))
    assert Config(str(tmp_path), gguf_file="b.gguf", device="cpu").model == str(tmp_path / "b.gguf")


def greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation, argmax token by token (as tests.conftest.hf_greedy)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(num_tokens):
            token = model(ids).logits[0, -1].argmax().view(1, 1)
            ids = torch.cat([ids, token], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_dequantized_floats_are_ggufs_bit_for_bit(qtype, tmp_path):
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    weights = np.random.default_rng(0).standard_normal((8, 96)).astype(np.float32) * 3
    path = str(tmp_path / "q.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("w", gguf.quants.quantize(weights, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = gguf_checkpoint.open_gguf(path).tensors
    expected = gguf.quants.dequantize(gguf.quants.quantize(weights, kind), kind)
    ours = gguf_checkpoint.dequantize(gguf, tensor, path)
    assert ours.shape == (8, 96)
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))
