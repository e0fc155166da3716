"""The RL rollout features on an NVIDIA GPU (skipped without CUDA): forks' copied blocks in every
KV layout, weights updated under the CUDA graphs, memory freed by sleep, addresses kept on waking
(the graphs not captured again), and the fallback that captures them again."""

import pytest
import torch
from safetensors.torch import load_file

from nanovllm import LLM, SamplingParams
from tests.conftest import needs_cuda, write_tiny_bf16

pytestmark = needs_cuda  # conftest adds the `cuda` marker
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# Greedy through the sampler's general path (its own graphs): logprobs are asked for.
GREEDY_LOGPROBS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)


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


def device_used() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def count_captures(runner) -> list[int]:
    count = [0]
    inner = runner._capture_graphs

    def counting():
        count[0] += 1
        return inner()

    runner._capture_graphs = counting
    return count


def remaining_bytes(runner) -> int:
    """What docs/architecture.md says stays allocated while asleep: the model's buffers (the RoPE
    table) and the decode graphs' static inputs, outputs and sampled tokens."""
    graphs = runner.graphs
    static = [graphs.inputs, *graphs.outputs.values()]
    if graphs.tokens is not None:
        static.append(graphs.tokens)
    return sum(b.nbytes for b in runner.model.buffers()) + sum(t.nbytes for t in static)


# Besides what remaining_bytes counts: cuBLAS workspaces (one per stream) and small buffers.
ASLEEP_SLACK = 96 << 20


def test_sleep_keeps_addresses_so_the_graphs_stay(tiny_bf16, prompts):
    baseline = torch.cuda.memory_allocated()
    with LLM(tiny_bf16, max_model_len=1024, num_kvcache_blocks=64) as llm:
        runner = llm.llm_engine.model_runner
        before = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        params = list(runner.model.parameters())
        weights, kv_bytes = sum(p.nbytes for p in params), runner.kv_cache.nbytes
        captures = count_captures(runner)
        awake = torch.cuda.memory_allocated()
        llm.sleep(1)  # the first sleep frees the tensors' own storages
        assert awake - torch.cuda.memory_allocated() >= weights + kv_bytes
        llm.wake_up()  # ... and the first wake moves them into virtual memory
        assert captures[0] == 1
        assert runner.sleeper.packed["weights"].buffer.memory is not None
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == before
        graphs, host = runner.graphs, runner.sleeper.host_weights.flat.data_ptr()
        addresses = [p.data_ptr() for p in params] + [runner.kv_cache.data_ptr()]
        for cycle in range(3):
            used = device_used()
            llm.sleep(1)
            assert used - device_used() >= weights + kv_bytes  # physical memory given back
            asleep = torch.cuda.memory_allocated() - baseline
            assert asleep <= remaining_bytes(runner) + ASLEEP_SLACK, asleep
            # A trainer's tensor in the memory sleep freed moves nothing.
            blocker = torch.empty(weights + kv_bytes, dtype=torch.uint8, device="cuda") \
                if cycle == 2 else None
            llm.wake_up()
            del blocker
            assert [p.data_ptr() for p in params] + [runner.kv_cache.data_ptr()] == addresses
            assert runner.graphs is graphs and captures[0] == 1  # no capture: same addresses
            assert runner.sleeper.host_weights.flat.data_ptr() == host  # refilled, not new
            replays = count_replays(runner.graphs)
            assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == before
            assert replays[0] > 0
            assert not runner.sampler_graphs.captured  # freed by sleep, captured on use
            assert tokens(llm.generate(prompts, GREEDY_LOGPROBS, use_tqdm=False)) == before
            assert runner.sampler_graphs.captured
        state_dict = {k: v.cuda() for k, v in load_file(f"{tiny_bf16}/model.safetensors").items()}
        used = device_used()
        llm.sleep(2)
        assert runner.sleeper.host_weights is None
        assert used - device_used() >= weights + kv_bytes
        llm.wake_up(["weights"])
        llm.update_weights(state_dict)
        llm.wake_up(["kv_cache"])
        assert [p.data_ptr() for p in params] + [runner.kv_cache.data_ptr()] == addresses
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == before
        assert captures[0] == 1


def test_sleep_without_virtual_memory_captures_the_graphs_again(tiny_bf16, prompts, monkeypatch):
    monkeypatch.setenv("NANOVLLM_SLEEP_VMM", "0")  # the caching allocator: addresses may change
    with LLM(tiny_bf16, max_model_len=1024, num_kvcache_blocks=64) as llm:
        runner = llm.llm_engine.model_runner
        before = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        kv_bytes = runner.kv_cache.nbytes
        weights = sum(p.nbytes for p in runner.model.parameters())
        for _ in range(2):
            llm.sleep(1)
            # A trainer's tensor takes the freed memory: the buffers come back elsewhere.
            blocker = torch.empty(kv_bytes + weights, dtype=torch.uint8, device="cuda")
            llm.wake_up()
            del blocker
            assert runner.sleeper.packed["weights"].buffer.memory is None
            replays = count_replays(runner.graphs)
            assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == before
            assert replays[0] > 0  # decode ran in the graphs captured on waking
        state_dict = {k: v.cuda() for k, v in load_file(f"{tiny_bf16}/model.safetensors").items()}
        llm.sleep(2)
        llm.wake_up()
        llm.update_weights(state_dict)
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == before
