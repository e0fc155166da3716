"""LLM.sleep / wake_up on the CPU: the KV pool (and at level 2 the weights) freed and restored, and
the API's errors. The GPU's memory figures and graphs: tests/runner/test_rollout_cuda.py."""

import pytest

from nanovllm import LLM, SamplingParams
from tests.conftest import _hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def weight_bytes(llm) -> int:
    """The bytes of the weights' storages (one shared storage once they are packed)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in llm.llm_engine.model_runner.model.parameters()}
    return sum(storages.values())


@pytest.mark.cpu_suite
def test_sleep_and_wake_on_cpu(tiny_model, prompts):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=32) as llm:
        before = tokens(llm.generate(prompts[5:7], GREEDY, use_tqdm=False))
        weights = weight_bytes(llm)
        llm.sleep(1)
        assert llm.llm_engine.model_runner.kv_cache.untyped_storage().nbytes() == 0
        assert weight_bytes(llm) == weights  # on the CPU, already in host memory
        asleep = r"asleep \(sleep\(level=1\); kv_cache and weights not woken\): call wake_up"
        with pytest.raises(RuntimeError, match=asleep):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        with pytest.raises(RuntimeError, match=r"already asleep"):
            llm.sleep(2)
        with pytest.raises(RuntimeError, match=r"update_weights\(\) while asleep"):
            llm.update_weights([])
        llm.wake_up()
        llm.wake_up()  # awake: nothing to do
        # The KV pool came back zeroed: a prefix cached before sleeping must not be hit.
        assert tokens(llm.generate(prompts[5:7], GREEDY, use_tqdm=False)) == before
        llm.sleep(2)
        assert weight_bytes(llm) == 0
        llm.wake_up()
        with pytest.raises(RuntimeError, match=r"weights discarded by sleep\(level=2\) are not "
                                               "loaded again"):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        state_dict = _hf_model(tiny_model).state_dict()
        names = sorted(state_dict)
        assert names[0] == "lm_head.weight"  # tied: not one of the weights to load
        llm.update_weights((n, state_dict[n]) for n in names[:3])
        with pytest.raises(RuntimeError, match=f"{len(names) - 3} weights discarded"):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        llm.update_weights((n, state_dict[n]) for n in names[3:])
        assert tokens(llm.generate(prompts[5:7], GREEDY, use_tqdm=False)) == before


@pytest.mark.cpu_suite
def test_sleep_errors(tiny_model, prompts):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=32) as llm:
        for level in (0, 3, True, "1"):
            with pytest.raises(ValueError, match=f"level must be 1 or 2, got {level!r}"):
                llm.sleep(level)
        stream = llm.stream(prompts[:3], SamplingParams(max_tokens=20, ignore_eos=True))
        next(stream)
        with pytest.raises(RuntimeError, match=r"sleep\(\) refused: 3 requests are unfinished"):
            llm.sleep()
        stream.close()
        llm.sleep()
    with pytest.raises(RuntimeError, match="has exited"):
        llm.wake_up()


@pytest.mark.cpu_suite
def test_wake_up_by_tags_in_vllms_rl_order(tiny_model, prompts):
    """sleep, wake the weights, update them, wake the KV cache: vLLM's RL loop."""
    state_dict = _hf_model(tiny_model).state_dict()
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=32) as llm:
        before = tokens(llm.generate(prompts[5:7], GREEDY, use_tqdm=False))
        llm.sleep(2)
        with pytest.raises(ValueError, match=r"tags must be None or a list of \('weights', "):
            llm.wake_up(["everything"])
        llm.wake_up(tags=["weights"])
        with pytest.raises(RuntimeError, match="kv_cache not woken"):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        llm.update_weights(state_dict)  # the weights are awake: they take the update
        assert llm.llm_engine.model_runner.kv_cache.untyped_storage().nbytes() == 0
        llm.wake_up(tags=["kv_cache"])
        assert tokens(llm.generate(prompts[5:7], GREEDY, use_tqdm=False)) == before


@pytest.mark.cpu_suite
def test_sleep_cycles_reuse_the_packed_buffers(tiny_model, prompts):
    """Each group (weights, KV pool) moves into one flat buffer at its first wake; later cycles
    free and refill that same buffer, and every cycle leaves generation unchanged."""
    state_dict = _hf_model(tiny_model).state_dict()
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=32) as llm:
        runner = llm.llm_engine.model_runner
        before = tokens(llm.generate(prompts[5:7], GREEDY, use_tqdm=False))
        params = list(runner.model.parameters())
        llm.sleep(2)
        llm.wake_up()
        llm.update_weights(state_dict)
        assert tokens(llm.generate(prompts[5:7], GREEDY, use_tqdm=False)) == before
        packed = runner.sleeper.packed
        weights, kv = packed["weights"].buffer, packed["kv_cache"].buffer
        assert {p.untyped_storage().data_ptr() for p in params} == {weights.flat.data_ptr()}
        assert runner.kv_cache.untyped_storage().data_ptr() == kv.flat.data_ptr()
        for level in (1, 1, 2):
            llm.sleep(level)
            assert kv.flat.untyped_storage().nbytes() == 0
            assert (weights.flat.untyped_storage().nbytes() == 0) == (level == 2)
            assert runner.sleeper.host_weights is None  # on the CPU the weights stay where they are
            llm.wake_up()
            assert not runner.kv_cache.any()  # the pool comes back zeroed
            if level == 2:
                llm.update_weights(state_dict)
            assert packed["weights"].buffer is weights and packed["kv_cache"].buffer is kv
            assert tokens(llm.generate(prompts[5:7], GREEDY, use_tqdm=False)) == before
