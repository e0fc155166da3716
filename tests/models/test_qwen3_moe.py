"""Qwen3-MoE against transformers on tiny random checkpoints (float32 on CPU): logits, greedy tokens
through chunked prefill, preemption and prefix hits, tensor- and expert-parallel over gloo; the
per-expert loading and the configuration checks."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoint.loader import load_model
from nanovllm.config import Config
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeSparseMoeBlock
from nanovllm.testing.tiny_model import (
    QWEN3_30B_A3B,
    tiny_qwen3_arch,
    write_benchmark_checkpoint,
    write_tiny_qwen3_moe,
)
from tests.conftest import NUM_NEW_TOKENS, _hf_model, hf_greedy
from tests.engine.test_generate import greedy_twice_under_preemption
from tests.models.test_model import our_logits

pytestmark = pytest.mark.cpu_suite  # exact against transformers on the CPU (see conftest)

GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
# Top-1 without renormalization, experts on every second layer (1 and 3 of 4).
TOP1_SPARSE_STEP_2 = dict(num_experts_per_tok=1, norm_topk_prob=False, decoder_sparse_step=2,
                          mlp_only_layers=[], num_hidden_layers=4)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-qwen3-moe"))
    write_tiny_qwen3_moe(path)
    return path


@pytest.fixture(scope="module")
def moe_reference(tiny_moe, prompts) -> list[list[int]]:
    return [hf_greedy(tiny_moe, p, NUM_NEW_TOKENS) for p in prompts]


def test_checkpoint_holds_per_expert_tensors_and_a_dense_layer(tiny_moe):
    names = set(load_file(os.path.join(tiny_moe, "model.safetensors")))
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names  # mlp_only_layers=[1]
    assert not any(".experts.gate_up_proj" in name for name in names)


def test_benchmark_writer_stores_experts_as_the_hub_does(tmp_path):
    arch = tiny_qwen3_arch(architectures=QWEN3_30B_A3B["architectures"], num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=16)
    write_benchmark_checkpoint(str(tmp_path), arch, dtype="float32", initializer_range=0.3,
                               shard_bytes=200_000)
    with open(tmp_path / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    shapes = {name: tuple(t.shape) for file in sorted(set(weight_map.values()))
              for name, t in load_file(tmp_path / file).items()}
    assert len(set(weight_map.values())) > 1 and set(weight_map) == set(shapes)
    assert shapes["model.layers.1.mlp.experts.3.gate_proj.weight"] == (16, 64)
    assert shapes["model.layers.1.mlp.experts.3.down_proj.weight"] == (64, 16)
    assert sum(".experts." in name for name in shapes) == 2 * 4 * 3
    expected = hf_greedy(str(tmp_path), [1, 2, 3], 8)  # transformers loads it by the index
    with LLM(str(tmp_path), kvcache_block_size=16, num_kvcache_blocks=8) as llm:  # strict load
        output = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8,
                                                           ignore_eos=True), use_tqdm=False)
    assert output[0]["token_ids"] == expected


@pytest.mark.parametrize("variant", ["top2", "top1-sparse-step-2"])
def test_layer_kinds_and_logits_match_transformers(variant, prompts, tmp_path):
    path = str(tmp_path)
    write_tiny_qwen3_moe(path, seed=3, **(TOP1_SPARSE_STEP_2 if variant != "top2" else {}))
    hf = _hf_model(path)
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        layers = llm.llm_engine.model_runner.model.model.layers
        ours = our_logits(llm, prompts[:6])
    theirs = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in layers] == theirs
    assert theirs == ([True, False, True] if variant == "top2" else [False, True, False, True])
    for prompt, logits in zip(prompts[:6], ours):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_greedy_through_chunking_preemption_and_prefix_hits(tiny_moe, prompts, moe_reference):
    # 8 blocks of 16 tokens hold at most two requests: preemption; a 20-token budget chunks
    # prompts; the second pass hits the prefix cache.
    with LLM(tiny_moe, kvcache_block_size=16, num_kvcache_blocks=8,
             max_num_batched_tokens=20) as llm:
        first, second = greedy_twice_under_preemption(llm, prompts)
    assert first == moe_reference
    assert second == moe_reference[::-1]


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_match_transformers(tiny_moe, prompts, moe_reference, expert_parallel):
    with LLM(tiny_moe, tensor_parallel_size=2, expert_parallel=expert_parallel,
             kvcache_block_size=16, num_kvcache_blocks=16, max_num_batched_tokens=40) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == moe_reference


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_holds_its_experts_or_slices(tiny_moe, monkeypatch, expert_parallel):
    hf = Config(tiny_moe, device="cpu").hf_config
    ckpt = load_file(os.path.join(tiny_moe, "model.safetensors"))
    pre, inter = "model.layers.2.mlp.experts", hf.moe_intermediate_size
    for rank in range(2):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=rank: r)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
        model = Qwen3MoeForCausalLM(hf, "torch", expert_parallel=expert_parallel)
        load_model(model, tiny_moe)
        params = dict(model.named_parameters())
        experts = range(4 * rank, 4 * rank + 4) if expert_parallel else range(8)
        cols = slice(None) if expert_parallel else slice(rank * inter // 2, (rank + 1) * inter // 2)
        gate_up = torch.stack([torch.cat([ckpt[f"{pre}.{e}.gate_proj.weight"][cols],
                                          ckpt[f"{pre}.{e}.up_proj.weight"][cols]])
                               for e in experts])
        down = torch.stack([ckpt[f"{pre}.{e}.down_proj.weight"][:, cols] for e in experts])
        torch.testing.assert_close(params[f"{pre}.gate_up_proj"], gate_up, rtol=0, atol=0)
        torch.testing.assert_close(params[f"{pre}.down_proj"], down, rtol=0, atol=0)
        torch.testing.assert_close(params["model.layers.2.mlp.gate.weight"],
                                   ckpt["model.layers.2.mlp.gate.weight"], rtol=0, atol=0)


def _rewrite(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_or_misshapen_expert_tensor_is_an_error(tiny_moe, tmp_path):
    import shutil

    for name, edit, message in [
        ("missing", lambda t: t.pop("model.layers.0.mlp.experts.5.up_proj.weight"),
         r"missing tensors for: model\.layers\.0\.mlp\.experts\.gate_up_proj "
         r"\(shard \(5, 'up'\)\)"),
        ("extra", lambda t: t.update({"model.layers.0.mlp.experts.8.up_proj.weight":
                                      torch.zeros(32, 64)}),
         "expert 8 out of range: the model has 8"),
        ("shape", lambda t: t.update({"model.layers.2.mlp.experts.1.down_proj.weight":
                                      torch.zeros(64, 16)}),
         r"expert 1's down_proj: expected \(64, 32\), checkpoint has \(64, 16\)"),
        ("stacked", lambda t: t.update({"model.layers.0.mlp.experts.down_proj":
                                        torch.zeros(8, 64, 32)}),
         r"'model\.layers\.0\.mlp\.experts\.down_proj'.*stacked expert tensors are not supp"),
    ]:
        path = str(tmp_path / name)
        shutil.copytree(tiny_moe, path)
        _rewrite(path, edit)
        with pytest.raises(ValueError, match=message):
            LLM(path, kvcache_block_size=16, num_kvcache_blocks=8)


def test_expert_parallel_options_are_checked(tiny_moe, tiny_model, tmp_path):
    with pytest.raises(TypeError, match="expert_parallel must be a bool, got 1"):
        Config(tiny_moe, expert_parallel=1)
    with pytest.raises(ValueError, match="expert_parallel=True needs a mixture-of-experts"):
        Config(tiny_model, expert_parallel=True)
    path = str(tmp_path / "six-experts")
    write_tiny_qwen3_moe(path, num_experts=6, moe_intermediate_size=18, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=8)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide num_experts=6 "
                                         r"\(expert_parallel=True\)"):
        Config(path, tensor_parallel_size=4, expert_parallel=True, device="cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide "
                                         "moe_intermediate_size=18"):
        Config(path, tensor_parallel_size=4, device="cpu")
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["num_experts_per_tok"] = 7
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match="num_experts_per_tok=7 must be in 1..num_experts=6"):
        Config(path, device="cpu")

