"""Facts about the device that kernel launches need, and the PTX helpers the kernels share."""

import functools
import os

import torch
import triton
import triton.language as tl


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


# Per (purpose, device), zeroed int32 counts for kernels whose last program to arrive finishes the work (an
# atomic count per group of programs, which that program sets back to 0): the newest buffer serves every launch,
# which the device's stream runs one after another. A launch needing more counts than it holds gets a new buffer;
# the old ones stay alive for the CUDA graphs captured with them.
_ARRIVAL_COUNTS: dict[tuple[str, torch.device], list[torch.Tensor]] = {}


def arrival_counts(purpose: str, n: int, device: torch.device) -> torch.Tensor:
    """At least n zeroed int32 counts on `device` for the kernels of `purpose`, each of whose launches leaves
    them zeroed."""
    buffers = _ARRIVAL_COUNTS.setdefault((purpose, device), [])
    if not buffers or buffers[-1].numel() < n:
        buffers.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
    return buffers[-1]


@triton.jit
def prefetch_to_l2(ptrs):
    """Start fetching the 128-byte lines holding ptrs into L2 (no register is written). With PDL a kernel
    prefetches, before its gdc_wait, what no kernel of the step writes (weights, earlier tokens' K/V)."""
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)
