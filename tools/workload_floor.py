"""The least time bench.py's workload can take, by the phases of `bench.py --breakdown` (no GPU).

    python -m tools.workload_floor [--bandwidth TB/s] [--tflops TFLOP/s]"""

import argparse

import numpy as np
import torch

from bench import decode_phase, upstream_workload
from nanovllm.kernels.attention.kv_cache import bytes_per_token
from nanovllm.testing.tiny_model import QWEN3_0_6B as ARCH

LAYERS, HIDDEN, INTER = ARCH["num_hidden_layers"], ARCH["hidden_size"], ARCH["intermediate_size"]
HEAD_DIM, HEADS = ARCH["head_dim"], ARCH["num_attention_heads"]
KV_HEADS = ARCH["num_key_value_heads"]
LAYER_PARAMS = (HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN
                + 3 * HIDDEN * INTER)
LM_HEAD_PARAMS = ARCH["vocab_size"] * HIDDEN
DECODE_PARAMS = LAYERS * LAYER_PARAMS + LM_HEAD_PARAMS
WEIGHT_BYTES = torch.bfloat16.itemsize * DECODE_PARAMS
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def kv_bytes_per_key(cache_dtype: str) -> int:
    """What attention reads of one cached token: its K and V heads in every layer (and scales)."""
    return bytes_per_token(LAYERS, KV_HEADS, HEAD_DIM, CACHE_DTYPES[cache_dtype])


def floor_by_phase(prompt_lens: np.ndarray, output_lens: np.ndarray, bandwidth: float,
                   flop_rate: float) -> dict[str, list[float]]:
    """phase -> [steps, bf16-cache seconds, fp8-cache seconds] of requests admitted at once: a
    decode step costs its K/V bytes plus the larger of its weights' bytes and FLOPs."""
    phases: dict[str, list[float]] = {}
    prefill_flops = 2 * LAYERS * LAYER_PARAMS * prompt_lens.sum()
    prefill_flops += 2 * LM_HEAD_PARAMS * len(prompt_lens)
    prefill_flops += LAYERS * 4 * HEADS * HEAD_DIM * (prompt_lens * (prompt_lens + 1) // 2).sum()
    phases["prefill"] = [0, prefill_flops / flop_rate, prefill_flops / flop_rate]
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
    prompts, params = upstream_workload()
    return np.array([len(p) for p in prompts]), np.array([p.max_tokens for p in params])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", type=float, default=4.3,
                        help="TB/s (default: a measured device-to-device copy)")
    parser.add_argument("--tflops", type=float, default=790.0,
                        help="TFLOP/s (default: a measured bf16 8192-cube GEMM)")
    args = parser.parse_args()
    prompt_lens, output_lens = workload_lengths()
    phases = floor_by_phase(prompt_lens, output_lens, args.bandwidth * 1e12, args.tflops * 1e12)
    tokens = output_lens.sum()
    print(f"floor of bench.py's workload ({tokens} tokens) at {args.bandwidth} TB/s and "
          f"{args.tflops} TFLOP/s:")
    print(f"  {'phase':<24} {'steps':>5} {'bf16 cache':>12} {'fp8 cache':>12}")
    for phase, (steps, bf16, fp8) in phases.items():
        print(f"  {phase:<24} {steps or '':>5} {bf16:10.3f} s {fp8:10.3f} s")
    bf16, fp8 = (sum(entry[i] for entry in phases.values()) for i in (1, 2))
    print(f"  {'in all':<24} {'':5} {bf16:10.3f} s {fp8:10.3f} s")
    print(f"  {'tok/s at most':<24} {'':5} {tokens / bf16:12,.0f} {tokens / fp8:12,.0f}")


if __name__ == "__main__":
    main()
