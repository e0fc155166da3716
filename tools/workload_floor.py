"""The time below which `bench.py`'s workload cannot run, by the phases of `bench.py --breakdown` (no GPU needed).

    PYTHONPATH=. python3 scripts/workload_floor.py [--bandwidth TB/s] [--tflops TFLOP/s]

Each decode step must read its rows' K/V (every key of every context, the newest included; with an fp8 cache
also the float32 scales of K and V) and the weights once, and do the projections' and lm_head's FLOPs; a step
costs at least its K/V bytes at the bandwidth plus the larger of its weight bytes and its FLOPs at their
ceilings. A prefill costs at least its FLOPs (the projections for every prompt token, causal attention,
lm_head for a prompt's last token). The defaults are the H200's measured ceilings (shared/device/README.md):
device-to-device copy 4.3 TB/s, a bf16 8192-cube matrix product 790 TFLOP/s. Nothing overlaps the attention's
reads with the rest, as one stream of kernels does not (BENCHMARKS.md, thirty-third session).
"""

import argparse

import numpy as np
import torch

from bench import decode_phase, upstream_workload
from nanovllm.kernels.attention.kv_cache import bytes_per_token
from nanovllm.utils.tiny_model import QWEN3_0_6B as ARCH

LAYERS, HIDDEN, INTER = ARCH["num_hidden_layers"], ARCH["hidden_size"], ARCH["intermediate_size"]
HEAD_DIM, HEADS, KV_HEADS = ARCH["head_dim"], ARCH["num_attention_heads"], ARCH["num_key_value_heads"]
LAYER_PARAMS = HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN + 3 * HIDDEN * INTER
LM_HEAD_PARAMS = ARCH["vocab_size"] * HIDDEN
DECODE_PARAMS = LAYERS * LAYER_PARAMS + LM_HEAD_PARAMS  # what a decode row multiplies by (2 FLOPs each)
WEIGHT_BYTES = 2 * DECODE_PARAMS  # bf16
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def kv_bytes_per_key(cache_dtype: str) -> int:
    """What attention reads of one cached token: its K and V heads in every layer (and their fp8 scales)."""
    return bytes_per_token(LAYERS, KV_HEADS, HEAD_DIM, CACHE_DTYPES[cache_dtype])


def floor_by_phase(prompt_lens: np.ndarray, output_lens: np.ndarray, bandwidth: float,
                   flop_rate: float) -> dict[str, list[float]]:
    """phase -> [steps, bf16-cache seconds, fp8-cache seconds] for requests of these prompt and output
    lengths, all admitted at once (bandwidth in bytes/s, flop_rate in FLOP/s)."""
    phases: dict[str, list[float]] = {}
    prefill_flops = 2 * (LAYERS * LAYER_PARAMS * prompt_lens.sum() + LM_HEAD_PARAMS * len(prompt_lens))
    prefill_flops += LAYERS * 4 * HEADS * HEAD_DIM * (prompt_lens * (prompt_lens + 1) // 2).sum()
    phases["prefill"] = [0, prefill_flops / flop_rate, prefill_flops / flop_rate]  # its step count is the scheduler's
    key_bytes = kv_bytes_per_key("bf16"), kv_bytes_per_key("fp8")
    for step in range(1, output_lens.max()):  # the prefill sampled each request's first token
        alive = output_lens > step
        rows, keys = int(alive.sum()), (prompt_lens[alive] + step).sum()
        rest = max(WEIGHT_BYTES / bandwidth, rows * 2 * DECODE_PARAMS / flop_rate)
        entry = phases.setdefault(decode_phase(rows), [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += keys * key_bytes[0] / bandwidth + rest
        entry[2] += keys * key_bytes[1] / bandwidth + rest
    return phases


def workload_lengths() -> tuple[np.ndarray, np.ndarray]:
    """The prompt and output lengths of bench.py's workload."""
    prompts, params = upstream_workload()
    return np.array([len(p) for p in prompts]), np.array([p.max_tokens for p in params])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", type=float, default=4.3, help="TB/s (default: the H200's copy rate)")
    parser.add_argument("--tflops", type=float, default=790.0, help="TFLOP/s (default: the H200's bf16 GEMM)")
    args = parser.parse_args()
    prompt_lens, output_lens = workload_lengths()
    phases = floor_by_phase(prompt_lens, output_lens, args.bandwidth * 1e12, args.tflops * 1e12)
    tokens = output_lens.sum()
    print(f"floor of bench.py's workload ({tokens} tokens) at {args.bandwidth} TB/s and {args.tflops} TFLOP/s:")
    print(f"  {'phase':<24} {'steps':>5} {'bf16 cache':>12} {'fp8 cache':>12}")
    for phase, (steps, bf16, fp8) in phases.items():
        print(f"  {phase:<24} {steps or '':>5} {bf16:10.3f} s {fp8:10.3f} s")
    bf16, fp8 = (sum(entry[i] for entry in phases.values()) for i in (1, 2))
    print(f"  {'in all':<24} {'':5} {bf16:10.3f} s {fp8:10.3f} s")
    print(f"  {'tok/s at most':<24} {'':5} {tokens / bf16:12,.0f} {tokens / fp8:12,.0f}")


if __name__ == "__main__":
    main()
