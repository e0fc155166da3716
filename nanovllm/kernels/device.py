"""Device facts that kernel launches need, and the PTX helpers the kernels share."""

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRETER_SMS = 132
HOPPER_SHARED_MEMORY = 232448


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def shared_memory(device: torch.device) -> int:
    if device.type != "cuda":
        return HOPPER_SHARED_MEMORY
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels use programmatic dependent launch (Hopper+; NANOVLLM_PDL=0 turns it off)."""
    return (device.type == "cuda" and os.environ.get("NANOVLLM_PDL", "1") != "0"
            and _pdl_capable(device))


_ARRIVAL_COUNTS: dict[tuple[str, torch.device], list[torch.Tensor]] = {}


def arrival_counts(purpose: str, n: int, device: torch.device) -> torch.Tensor:
    """n+ zeroed int32 counts, left zeroed by each launch; old buffers stay alive for graphs."""
    buffers = _ARRIVAL_COUNTS.setdefault((purpose, device), [])
    if not buffers or buffers[-1].numel() < n:
        buffers.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
    return buffers[-1]


@triton.jit
def prefetch_to_l2(ptrs):
    """Start fetching the 128-byte lines holding ptrs into L2 (no register is written)."""
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                              [ptrs], dtype=tl.int32, is_pure=False, pack=1)
