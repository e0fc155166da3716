"""Rotary position embedding: inverse frequencies (plain or Llama-3-scaled) and the rotation."""

import math

import torch
from torch import nn

from nanovllm.checkpoint.hf_config import SUPPORTED_ROPE_TYPES, rope_parameters


def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin_cache: torch.Tensor):
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """[head_dim // 2] float32: base ** (-2i / head_dim)."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position: int) -> torch.Tensor:
    """Llama 3.1's scaling, op for op as transformers: wavelengths below original / high_freq_factor
    keep their frequency, above original / low_freq_factor divide it by `factor`, between blend."""
    low_freq_wavelen = original_max_position / low_freq_factor
    high_freq_wavelen = original_max_position / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    band = high_freq_factor - low_freq_factor
    smooth = (original_max_position / wavelen - low_freq_factor) / band
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, hf_config) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies for the checkpoint's RoPE type."""
    params = rope_parameters(hf_config)
    inv_freq = default_inv_freq(head_dim, float(params["rope_theta"]))
    if params["rope_type"] == "default":
        return inv_freq
    if params["rope_type"] == "llama3":
        original = params.get("original_max_position_embeddings", hf_config.max_position_embeddings)
        return llama3_inv_freq(inv_freq, params["factor"], params["low_freq_factor"],
                               params["high_freq_factor"], original)
    raise ValueError(f"rope_type={params['rope_type']!r} is not supported; "
                     f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves) from a precomputed cos/sin table [max_position, head_dim]."""

    def __init__(self, inv_freq: torch.Tensor, max_position: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
        return apply_rope(positions, q, k, self.cos_sin_cache)


def get_rope(head_dim: int, hf_config) -> RotaryEmbedding:
    return RotaryEmbedding(rope_inv_freq(head_dim, hf_config), hf_config.max_position_embeddings)
