"""Bad input gets a clear error before anything is queued; the engine never hangs nor leaks."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence
from tests.conftest import NUM_NEW_TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def llm(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=128) as engine:
        yield engine


def copy_checkpoint(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


# ---- model directory and weights ---------------------------------------------------------------

def test_missing_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model, tmp_path / "ckpt")
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["architectures"] = ["GPT2LMHeadModel"]
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError,
                       match=r"unsupported architecture \['GPT2LMHeadModel'\].*Qwen3ForCausalLM"):
        LLM(path)


def _edit_weights(tiny_model, tmp_path, edit) -> str:
    path = copy_checkpoint(tiny_model, tmp_path / "ckpt")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def test_missing_tensor_is_named(tiny_model, tmp_path):
    path = _edit_weights(tiny_model, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors for: "
                       r"model.layers.1.mlp.gate_up_proj.weight \(shard 1\)"):
        LLM(path, num_kvcache_blocks=8)


def test_unexpected_tensor_is_named(tiny_model, tmp_path):
    path = _edit_weights(tiny_model, tmp_path,
                         lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.extra.weight'"):
        LLM(path, num_kvcache_blocks=8)


def test_shape_mismatch_is_named(tiny_model, tmp_path):
    def shrink(tensors):
        name = "model.layers.0.self_attn.o_proj.weight"
        tensors[name] = tensors[name][:, :8].clone()

    path = _edit_weights(tiny_model, tmp_path, shrink)
    with pytest.raises(ValueError, match=r"cannot load 'model.layers.0.self_attn.o_proj.weight'"
                       r".*shape mismatch"):
        LLM(path, num_kvcache_blocks=8)


def test_no_safetensors(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model, tmp_path / "ckpt")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        LLM(path, num_kvcache_blocks=8)


@pytest.mark.parametrize("options,error,message", [
    ({"max_num_seqz": 4}, TypeError,
     "unknown option 'max_num_seqz'; valid options are: max_num_batched_tokens"),
    ({"max_num_seqs": "8"}, TypeError, "max_num_seqs must be an int, got '8'"),
    ({"enforce_eager": 1}, TypeError, "enforce_eager must be a bool"),
    ({"kvcache_block_size": 24}, ValueError, "kvcache_block_size must be a power of two, got 24"),
    ({"gpu_memory_utilization": 0}, ValueError,
     r"gpu_memory_utilization must be in \(0, 1\], got 0"),
    ({"gpu_memory_utilization": 1.5}, ValueError,
     r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
    ({"max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens must be >= 1, got 0"),
    ({"num_kvcache_blocks": 0}, ValueError,
     "num_kvcache_blocks must be -1 \\(auto\\) or a positive int, got 0"),
    ({"tensor_parallel_size": 9}, ValueError, "tensor_parallel_size must be in 1..8, got 9"),
    ({"tensor_parallel_size": 3}, ValueError,
     "tensor_parallel_size=3 does not divide num_attention_heads=4"),
    ({"device": "tpu"}, ValueError, "device='tpu' is not one of"),
    ({"attention_backend": "flash_attn", "device": "cpu"}, ValueError, "needs device='cuda'"),
    ({"kv_cache_dtype": "fp16"}, ValueError,
     r"kv_cache_dtype='fp16' is not one of \('auto', 'fp8'\)"),
    ({"kv_cache_dtype": "fp8", "attention_backend": "flash_attn"}, ValueError,
     "kv_cache_dtype='fp8' needs attention_backend='triton' .* "
     "flash-attn cannot read an fp8 KV cache"),
])
def test_bad_options(tiny_model, options, error, message):
    with pytest.raises(error, match=message):
        LLM(tiny_model, **options)


def test_max_model_len_is_capped_by_the_checkpoint(tiny_model):
    with LLM(tiny_model, max_model_len=100_000, num_kvcache_blocks=8,
             kvcache_block_size=16) as engine:
        # the checkpoint's max_position_embeddings
        assert engine.llm_engine.config.max_model_len == 1024


@pytest.mark.parametrize("kwargs,error,message", [
    ({"temperature": -0.1}, ValueError, "temperature must be >= 0"),
    ({"temperature": float("nan")}, ValueError, "temperature must be >= 0"),
    ({"max_tokens": 0}, ValueError, "max_tokens must be >= 1, got 0"),
    ({"max_tokens": 2.5}, TypeError, "max_tokens must be an int"),
])
def test_bad_sampling_params(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompts,params,error,message", [
    (["ok", ""], GREEDY, ValueError, "prompt 1 is empty"),
    ([[1, 2], []], GREEDY, ValueError, "prompt 1 is empty"),
    ([[1, 320]], GREEDY, ValueError,
     r"prompt 0 has token id 320 outside the vocabulary \[0, 320\)"),
    ([[1, -1]], GREEDY, ValueError, r"prompt 0 has token id -1 outside the vocabulary"),
    ([[1, 2.0]], GREEDY, ValueError, "prompt 0 has token id 2.0"),
    (["ok", 7], GREEDY, TypeError, "prompt 1 must be a str, a token-id list or a prompt dict"),
    (42, GREEDY, TypeError, "prompts must be a str, a token-id list, a {'prompt': ...}"),
    ([{"prompt": 3}], GREEDY, TypeError, "prompt 0 must hold 'prompt' \\(a str\\)"),
    ([{"prompt": "a", "multi_modal_data": {}}], GREEDY, ValueError,
     "prompt 0 has 'multi_modal_data': only 'prompt' and 'prompt_token_ids'"),
    (["a", "b"], [GREEDY], ValueError, "got 1 sampling params for 2 prompts"),
    (["a"], {"temperature": 0}, TypeError, "sampling_params must be a SamplingParams"),
    ([[1] * 129], GREEDY, ValueError,
     r"prompt 0: prompt length 129 \+ max_tokens 8 = 137 exceeds max_model_len=128"),
    ([[1] * 100], SamplingParams(max_tokens=29), ValueError, "= 129 exceeds max_model_len=128"),
])
def test_bad_requests_are_rejected_before_anything_is_queued(llm, prompts, params, error, message):
    before = dict(llm.llm_engine.scheduler.block_manager.hash_to_block_id)
    with pytest.raises(error, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.llm_engine.scheduler.waiting and not llm.llm_engine.scheduler.running
    assert llm.llm_engine.scheduler.block_manager.hash_to_block_id == before
    assert llm.llm_engine.scheduler.block_manager.num_free_blocks == 16


def test_engine_keeps_working_with_its_prefix_cache_after_a_bad_batch(llm, prompts, hf_reference):
    good = llm.generate([prompts[5]], GREEDY, use_tqdm=False)
    cached = llm.llm_engine.scheduler.block_manager.cached_prefix(Sequence(prompts[5], GREEDY, 16))
    assert len(cached) == 2
    with pytest.raises(ValueError):
        llm.generate([prompts[5], [999]], GREEDY, use_tqdm=False)
    block_manager = llm.llm_engine.scheduler.block_manager
    assert block_manager.cached_prefix(Sequence(prompts[5], GREEDY, 16)) == cached
    again = llm.generate([prompts[5]], GREEDY, use_tqdm=False)
    assert good[0]["token_ids"] == again[0]["token_ids"] == hf_reference[5][:8]


def test_request_larger_than_the_pool_is_rejected_with_the_numbers(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=4) as engine:
        with pytest.raises(ValueError,
                           match="needs 5 KV blocks of 16 tokens .* but the pool has only 4"):
            engine.generate([[1] * 60], SamplingParams(max_tokens=20), use_tqdm=False)
        assert engine.llm_engine.scheduler.is_finished()


def test_batch_three_times_the_pool_completes_identically(tiny_model, prompts):
    requests = [p + [i] for i in range(3) for p in prompts]  # 30 requests, up to 5 blocks each
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=256) as big:
        expected = [o["token_ids"] for o in big.generate(requests, params, use_tqdm=False)]
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=6) as small:
        outputs = [o["token_ids"] for o in small.generate(requests, params, use_tqdm=False)]
        assert small.llm_engine.scheduler.block_manager.num_free_blocks == 6
    assert outputs == expected


def test_a_second_live_engine_in_one_process_is_refused(llm, tiny_model):
    with pytest.raises(RuntimeError, match="another LLM is still alive in this process"):
        LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=8)
    assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]["finish_reason"] == "length"


def test_exit_twice_is_harmless_and_an_exited_engine_refuses_work(tiny_model):
    engine = LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=8)
    engine.exit()
    engine.exit()
    with pytest.raises(RuntimeError, match="this LLM has exited"):
        engine.generate(["hi"], GREEDY, use_tqdm=False)


def test_failing_step_surfaces_and_releases_the_engine(tiny_model):
    engine = LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=8)

    def broken_forward(*args, **kwargs):
        raise RuntimeError("kernel failed")

    engine.llm_engine.model_runner.model.forward = broken_forward
    with pytest.raises(RuntimeError, match="kernel failed"):
        engine.generate(["hi"], GREEDY, use_tqdm=False)
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="has exited"):
        engine.generate(["hi"], GREEDY, use_tqdm=False)
