"""The top-k / top-p threshold search by search and by pass, on bf16 and float32 logits.

    python -m benchmarks.sampling_filters [--rows 256]
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from nanovllm.sampling import filters as sampling_filters


def thresholds(logits, temperatures, top_k, top_p):
    """The filters as the sampler calls them: top-k among the 50 largest, top-p alone by search."""
    return sampling_filters.filter_thresholds(logits, temperatures, top_k, top_p, None, 50,
                                              top_k is None and top_p is not None)


def time_case(logits, temperatures, k, p, steps) -> tuple[float, list[str]]:
    """Microseconds a call, and each search pass's microseconds."""
    for _ in range(3):
        thresholds(logits, temperatures, k, p)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        thresholds(logits, temperatures, k, p)
    end.record()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        thresholds(logits, temperatures, k, p)
        torch.cuda.synchronize()
    passes = [f"{e.device_time:.0f}" for e in prof.events() if e.name == "_search_pass_kernel"]
    return start.elapsed_time(end) / steps * 1e3, passes


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    rows, device = args.rows, torch.device("cuda")
    temperatures = torch.full((rows,), 0.8, device=device)
    top_k = torch.full((rows,), 50, device=device)
    top_p = torch.full((rows,), 0.9, device=device)
    cases = {"top-k 50": (top_k, None), "top-p 0.9": (None, top_p),
             "top-k 50 + top-p 0.9": (top_k, top_p)}
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randn(rows, args.vocab, device=device).to(dtype)
        for name, (k, p) in cases.items():
            us, passes = time_case(logits, temperatures, k, p, args.steps)
            print(f"{str(dtype)[6:]:>8} {name:>22}: {us:7.0f} us per call; "
                  f"passes (us): {' '.join(passes)}")


if __name__ == "__main__":
    main()
