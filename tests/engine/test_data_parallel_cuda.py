"""One replica through Ray on the GPU gives the in-process engine's greedy tokens."""

import pytest

from nanovllm import LLM, SamplingParams
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
            assert llm.replicas[0].limits[2] > 0
            assert llm.generate(prompts, params, use_tqdm=False) == expected
    finally:
        ray.shutdown()
