"""tools/workload_floor.py: the least time bench.py's workload could take, by phase (no GPU)."""

import numpy as np
import pytest

from tools.workload_floor import (
    LAYER_PARAMS,
    LAYERS,
    LM_HEAD_PARAMS,
    WEIGHT_BYTES,
    floor_by_phase,
    kv_bytes_per_key,
    workload_lengths,
)


def test_qwen3_0_6b_sizes():
    # Qwen3-0.6B's published 0.44B non-embedding parameters, less norms
    assert LAYERS * LAYER_PARAMS == 440_401_920
    assert WEIGHT_BYTES == 2 * (440_401_920 + 151_936 * 1_024)  # and the tied lm_head
    assert kv_bytes_per_key("bf16") == 28 * 2 * 8 * 128 * 2
    assert kv_bytes_per_key("fp8") == 28 * 2 * 8 * (128 + 4)


def test_two_requests_by_hand():
    bandwidth, flop_rate = 1e12, 1e14
    phases = floor_by_phase(np.array([10, 20]), np.array([3, 1]), bandwidth, flop_rate)
    # request 1 decodes at contexts 11 and 12, request 2 never; each step reads the weights
    weights = WEIGHT_BYTES / bandwidth
    assert weights > 2 * (LAYERS * LAYER_PARAMS + LM_HEAD_PARAMS) / flop_rate
    steps, bf16, fp8 = phases["decode, batch 1-16"]
    assert steps == 2
    assert bf16 == pytest.approx(23 * kv_bytes_per_key("bf16") / bandwidth + 2 * weights)
    assert fp8 == pytest.approx(23 * kv_bytes_per_key("fp8") / bandwidth + 2 * weights)
    attention = LAYERS * 4 * 16 * 128 * (10 * 11 // 2 + 20 * 21 // 2)
    prefill = 2 * (LAYERS * LAYER_PARAMS * 30 + LM_HEAD_PARAMS * 2) + attention
    assert phases["prefill"] == [0, pytest.approx(prefill / flop_rate),
                                 pytest.approx(prefill / flop_rate)]
    assert set(phases) == {"prefill", "decode, batch 1-16"}


def test_a_full_batch_is_bound_by_its_flops():
    bandwidth, flop_rate = 1e12, 1e14
    phases = floor_by_phase(np.full(256, 1), np.full(256, 2), bandwidth, flop_rate)
    steps, bf16, _ = phases["decode, batch 129-256"]
    flops = 256 * 2 * (LAYERS * LAYER_PARAMS + LM_HEAD_PARAMS) / flop_rate
    assert steps == 1 and flops > WEIGHT_BYTES / bandwidth
    assert bf16 == pytest.approx(256 * 2 * kv_bytes_per_key("bf16") / bandwidth + flops)


def test_bench_workload_steps_are_the_engines():
    # the decode steps by phase that `bench.py --breakdown` counts on this workload
    prompt_lens, output_lens = workload_lengths()
    phases = floor_by_phase(prompt_lens, output_lens, 4.3e12, 790e12)
    assert {phase: entry[0] for phase, entry in phases.items() if phase != "prefill"} == {
        "decode, batch 129-256": 497, "decode, batch 65-128": 253, "decode, batch 17-64": 219,
        "decode, batch 1-16": 54}
    assert output_lens.sum() == 133_966
