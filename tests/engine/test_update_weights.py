"""LLM.update_weights: a running engine takes a trainer's state dict in place, through the loader
that start-up uses; a bad update is refused whole."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from nanovllm import LLM, SamplingParams
from nanovllm.testing.tiny_model import write_tiny_qwen3
from tests.conftest import _hf_model, hf_greedy

pytestmark = pytest.mark.cpu_suite

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model_b(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-qwen3-b"))
    write_tiny_qwen3(path, seed=5)
    return path


@pytest.fixture(scope="module")
def update_prompts(prompts) -> list[list[int]]:
    # prompts[5] + [1, 2, 3] and prompts[6] share 40 tokens: 2 full blocks cached under A.
    return [prompts[5], prompts[6], prompts[2]]


def tokens(outputs) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def test_updated_engine_equals_a_fresh_one(tiny_model, model_b, update_prompts):
    expected = [hf_greedy(model_b, p, NUM_TOKENS) for p in update_prompts]
    state_dict = _hf_model(model_b).state_dict()  # tied: lm_head.weight is in it too
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=32) as llm:
        under_a = tokens(llm.generate(update_prompts[:1], GREEDY, use_tqdm=False))
        assert under_a != expected[:1]
        llm.update_weights(state_dict)
        assert tokens(llm.generate(update_prompts, GREEDY, use_tqdm=False)) == expected
        # Back to A from its files, in two partial updates.
        files = load_file(f"{tiny_model}/model.safetensors")
        names = sorted(files)
        llm.update_weights((n, files[n]) for n in names[:5])
        llm.update_weights([(n, files[n]) for n in names[5:]])
        assert tokens(llm.generate(update_prompts[:1], GREEDY, use_tqdm=False)) == under_a
        llm.update_weights_from_path(model_b)
        assert tokens(llm.generate(update_prompts, GREEDY, use_tqdm=False)) == expected


def test_tp2_update_over_gloo(tiny_model, model_b, update_prompts):
    expected = [hf_greedy(model_b, p, NUM_TOKENS) for p in update_prompts]
    state_dict = _hf_model(model_b).state_dict()
    with LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=16,
             num_kvcache_blocks=32) as llm:
        llm.generate(update_prompts[:1], GREEDY, use_tqdm=False)
        llm.update_weights(state_dict)
        assert tokens(llm.generate(update_prompts, GREEDY, use_tqdm=False)) == expected
        llm.sleep(2)
        llm.wake_up()
        llm.update_weights(state_dict)
        assert tokens(llm.generate(update_prompts, GREEDY, use_tqdm=False)) == expected
        # Forks on every rank: each copies the partial last block of its parent's prompt.
        pairs = SamplingParams(n=2, temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outputs = llm.generate(update_prompts, pairs, use_tqdm=False)
        assert [[o.token_ids for o in samples.outputs] for samples in outputs] == [
            [e, e] for e in expected]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=32) as llm:
        yield llm


def weights_of(llm) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in llm.llm_engine.model_runner.model.state_dict().items()}


@pytest.mark.parametrize("bad,error,message", [
    ([("model.layers.0.mlp.up_proj.bias", torch.zeros(64))], ValueError,
     "unknown weight 'model.layers.0.mlp.up_proj.bias': the checkpoint has no such tensor"),
    ([("model.norm.weight", torch.zeros(7))], ValueError,
     r"weight 'model.norm.weight' has shape \(7,\), the checkpoint's has \(64,\)"),
    ([("model.norm.weight", torch.zeros(64))] * 2, ValueError,
     "weight 'model.norm.weight' is given more than once"),
    ([("model.norm.weight", [0.0] * 64)], TypeError,
     r"weight 'model.norm.weight' is a list, not a torch.Tensor"),
    ([("model.norm.weight",)], TypeError, r"weights\[1\] must be a \(name, tensor\) pair"),
    ([("model.norm.weight", None)], TypeError, "weight 'model.norm.weight' is None"),
    ([("model.norm.weight", np.zeros(64, np.float32))], TypeError,
     r"is a ndarray, not a torch.Tensor \(torch.from_numpy makes one\)"),
    ([("model.norm.weight", torch.zeros(64, device="meta"))], ValueError,
     "'model.norm.weight' is on the meta device"),
    ([("model.norm.weight", torch.zeros(64).to_sparse())], TypeError,
     r"is a torch.sparse_coo tensor: pass a dense one"),
    ([("model.norm.weight", torch.zeros(64, dtype=torch.complex64))], TypeError,
     "has dtype torch.complex64: weights are real floating point"),
    ([("model.norm.weight", torch.zeros(64, dtype=torch.int64))], TypeError,
     "has dtype torch.int64"),
])
def test_bad_updates_change_nothing(llm, prompts, bad, error, message):
    before = tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False))
    weights = weights_of(llm)
    good = ("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64))
    with pytest.raises(error, match=message):
        llm.update_weights([good] + bad)
    after = weights_of(llm)
    assert all(torch.equal(weights[k], after[k]) for k in weights)
    assert tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == before


def test_tied_lm_head_is_the_embedding(llm, prompts):
    """The tiny checkpoint ties lm_head to the embedding: lm_head.weight alone loads into it; both,
    differing, are refused."""
    model = llm.llm_engine.model_runner.model
    assert model.tie_word_embeddings
    embedding = model.model.embed_tokens.weight.detach().clone()
    before = tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False))
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        llm.update_weights({"model.embed_tokens.weight": embedding,
                            "lm_head.weight": embedding * 2})
    llm.update_weights({"lm_head.weight": embedding * 2})
    assert torch.equal(model.model.embed_tokens.weight, embedding * 2)
    assert tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) != before
    llm.update_weights({"lm_head.weight": embedding, "model.embed_tokens.weight": embedding})
    assert tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == before


def test_refused_while_requests_are_unfinished(llm, prompts):
    stream = llm.stream(prompts[:2], SamplingParams(max_tokens=20, ignore_eos=True))
    next(stream)
    with pytest.raises(RuntimeError, match=r"update_weights\(\) refused: 2 requests are "
                                           "unfinished"):
        llm.update_weights([])
    stream.close()
    llm.update_weights([])  # nothing left in flight
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files in '/nonexistent'"):
        llm.update_weights_from_path("/nonexistent")
