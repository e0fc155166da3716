"""Facts about the device that kernel launch heuristics need, and the kernels' shared workspace."""

import functools

import torch


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; elsewhere (Triton's interpreter) an H200's 132."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


_counters: dict[tuple[str, torch.device], torch.Tensor] = {}


def zeroed_counters(owner: str, device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 counters on `device`, all zero, kept for `owner` (one kernel family).

    For kernels whose programs count arrivals with atomics so that the last one to finish does a
    final step (e.g. sums split-K partials): that program resets its counter to zero, so the buffer
    is zero again whenever no such kernel runs and is allocated once, not per launch. A buffer that
    must grow is reallocated, which CUDA-graph capture cannot do; the capture's warm-up run (same
    shapes, outside the capture) grows it first."""
    key = (owner, torch.device(device))
    buffer = _counters.get(key)
    if buffer is None or buffer.numel() < n:
        if key[1].type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{owner} needs {n} counters while a CUDA graph is captured; "
                               "run the same shapes once before capturing")
        buffer = _counters[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buffer
