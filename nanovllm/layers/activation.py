import torch
import torch.nn.functional as F

from nanovllm.utils.compile import compiled_on_cuda


@compiled_on_cuda
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] (gate, up) -> [..., d] silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
