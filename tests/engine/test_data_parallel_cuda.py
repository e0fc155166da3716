"""Ray replicas on GPUs: one gives the in-process engine's greedy tokens; of two, one killed
mid-batch changes no output."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.ray.data_parallel import balance
from tests.conftest import needs_cuda

OPTIONS = dict(gpu_memory_utilization=0.3, max_model_len=512)


@needs_cuda
def test_one_ray_replica_equals_the_plain_engine_on_the_gpu(tiny_model, prompts):
    ray = pytest.importorskip("ray")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with LLM(tiny_model, **OPTIONS) as llm:
        expected = llm.generate(prompts, params, use_tqdm=False)
    ray.init(include_dashboard=False)
    try:
        with LLM(tiny_model, data_parallel_backend="ray", **OPTIONS) as llm:
            assert llm.llm_engine.limits.num_blocks > 0
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert [o.outputs for o in outputs] == [o.outputs for o in expected]
    finally:
        ray.shutdown()


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_replica_killed_on_its_gpu(tiny_model, prompts):
    """Two replicas on two GPUs, one killed mid-batch: every output equals one engine's."""
    ray = pytest.importorskip("ray")
    params = [SamplingParams(temperature=0, max_tokens=40 + 40 * (i % 4), ignore_eos=True)
              for i in range(len(prompts))]
    batch = [p[:40] for p in prompts]
    with LLM(tiny_model, **OPTIONS) as llm:
        expected = llm.generate(batch, params, use_tqdm=False)
    ray.init(include_dashboard=False)
    try:
        with LLM(tiny_model, data_parallel_size=2, **OPTIONS) as llm:
            engine = llm.llm_engine
            costs = [len(p) + sp.max_tokens for p, sp in zip(batch, params)]
            victims = set(balance(costs, 2)[0])
            outputs = {}
            for index, output in llm.as_completed(batch, params):
                outputs[index] = output
                if index in victims and engine.data_parallel_size == 2:
                    ray.kill(engine.replicas[0].actor)  # one of its requests came back
            assert engine.num_rerun_requests > 0 and engine.data_parallel_size == 1
            assert [outputs[i].outputs for i in range(len(batch))] == [o.outputs for o in expected]
    finally:
        ray.shutdown()
