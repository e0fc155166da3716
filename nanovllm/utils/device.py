"""Facts about the device that kernel launches need."""

import functools
import os

import torch


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; elsewhere (Triton's interpreter) an H200's 132."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` use programmatic dependent launch (Hopper and later): a kernel may
    start while the one before it finishes, its programs waiting (gdc_wait) before they read that
    kernel's outputs; each kernel lets the next one launch as soon as it starts
    (gdc_launch_dependents). Each decode kernel's launch latency, and the skinny GEMM's first weight
    reads, then overlap the kernel before. NANOVLLM_PDL=0 in the environment turns it off."""
    return device.type == "cuda" and os.environ.get("NANOVLLM_PDL", "1") != "0" and _pdl_capable(device)
