"""The RL rollout features on an NVIDIA GPU (skipped without CUDA): forks' copied blocks in every
KV layout, weights updated under the CUDA graphs, memory freed by sleep and graphs after waking."""

import pytest
import torch
from safetensors.torch import load_file

from nanovllm import LLM, SamplingParams
from tests.conftest import needs_cuda, write_tiny_bf16

pytestmark = needs_cuda  # conftest adds the `cuda` marker
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_bf16_b(tmp_path_factory) -> str:
    return write_tiny_bf16(str(tmp_path_factory.mktemp("tiny-bf16-b")), seed=7)


def tokens(outputs) -> list:
    """Each prompt's token ids; with n > 1 the list of its samples'."""
    return [[c.token_ids for c in out.outputs] if len(out.outputs) > 1 else out["token_ids"]
            for out in outputs]


def count_replays(graphs) -> list[int]:
    count = [0]
    inner = graphs.replay

    def counting(*args):
        count[0] += 1
        return inner(*args)

    graphs.replay = counting
    return count


@pytest.mark.parametrize("options", [{"attention_backend": "flash_attn"},
                                     {"attention_backend": "triton"},
                                     {"kv_cache_dtype": "fp8"}])
def test_greedy_forks_agree_and_prefill_once(tiny_bf16, prompts, options):
    if options.get("attention_backend") == "flash_attn":
        pytest.importorskip("flash_attn")
    with LLM(tiny_bf16, max_model_len=1024, **options) as llm:
        single = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        llm.reset_prefix_cache()
        prefilled = llm.llm_engine.num_prefilled_tokens
        n3 = SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True)
        forked = tokens(llm.generate(prompts, n3, use_tqdm=False))
        assert llm.llm_engine.num_prefilled_tokens - prefilled == sum(len(p) for p in prompts)
    # A sample reading a wrongly copied last block would part from its parent at once.
    assert all(samples == [samples[0]] * 3 for samples in forked)
    # The same prefill batch: the first tokens come from the same logits.
    assert [samples[0][0] for samples in forked] == [s[0] for s in single]


def test_update_weights_under_cuda_graphs(tiny_bf16, tiny_bf16_b, prompts):
    with LLM(tiny_bf16_b, max_model_len=1024) as fresh:
        expected_b = tokens(fresh.generate(prompts, GREEDY, use_tqdm=False))
    with LLM(tiny_bf16, max_model_len=1024) as llm:
        replays = count_replays(llm.llm_engine.model_runner.graphs)
        under_a = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        weights_b = {k: v.cuda() for k, v in load_file(f"{tiny_bf16_b}/model.safetensors").items()}
        llm.update_weights(weights_b)
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected_b
        llm.update_weights_from_path(tiny_bf16)
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == under_a
        assert replays[0] > 0
    assert under_a != expected_b


def test_sleep_frees_memory_and_graphs_work_after_waking(tiny_bf16, prompts):
    with LLM(tiny_bf16, max_model_len=1024, num_kvcache_blocks=64) as llm:
        runner = llm.llm_engine.model_runner
        before = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        kv_bytes = runner.kv_cache.nbytes
        weights = sum(p.nbytes for p in runner.model.parameters())
        torch.cuda.synchronize()
        awake = torch.cuda.memory_allocated()
        llm.sleep(1)
        assert awake - torch.cuda.memory_allocated() >= kv_bytes + weights
        with pytest.raises(RuntimeError, match="asleep"):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        llm.wake_up()
        assert runner.graphs is not None and runner.graphs.graphs
        replays = count_replays(runner.graphs)
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == before
        assert replays[0] > 0  # decode ran in the graphs kept or captured on waking
        llm.sleep(1)
        # A trainer's tensor takes the freed memory: the pool comes back elsewhere.
        blocker = torch.empty(kv_bytes + weights, dtype=torch.uint8, device="cuda")
        llm.wake_up()
        del blocker
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == before
        state_dict = {k: v.cuda() for k, v in load_file(f"{tiny_bf16}/model.safetensors").items()}
        torch.cuda.synchronize()
        awake = torch.cuda.memory_allocated()
        llm.sleep(2)
        assert awake - torch.cuda.memory_allocated() >= kv_bytes + weights
        llm.wake_up()
        llm.update_weights(state_dict)
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == before
