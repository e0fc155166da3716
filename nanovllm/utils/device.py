"""Facts about the device that kernel launch heuristics need."""

import functools

import torch


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; elsewhere (Triton's interpreter) an H200's 132."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count
