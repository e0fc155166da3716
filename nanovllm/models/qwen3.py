"""Qwen3 (dense): GQA attention with q/k RMSNorm and RoPE, SwiGLU MLP, tensor-parallel layers."""

import torch
from torch import nn

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention, AttentionMetadata
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding


def rope_theta(hf_config) -> float:
    """The RoPE base, from `rope_parameters` (transformers >= 5) or the older top-level `rope_theta`."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


class Qwen3Attention(nn.Module):
    def __init__(self, hf_config, attention_backend: str):
        super().__init__()
        tp_size = torch.distributed.get_world_size()
        hidden = hf_config.hidden_size
        self.head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
        self.num_heads = hf_config.num_attention_heads // tp_size
        self.num_kv_heads = hf_config.num_key_value_heads // tp_size
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, hf_config.num_attention_heads,
                                          hf_config.num_key_value_heads, bias=getattr(hf_config, "attention_bias", False))
        self.o_proj = RowParallelLinear(hf_config.num_attention_heads * self.head_dim, hidden, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, hf_config.max_position_embeddings, rope_theta(hf_config))
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads,
                              attention_backend)
        self.q_norm = RMSNorm(self.head_dim, eps=hf_config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=hf_config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden_states).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))  # [num_tokens, num_heads, head_dim]
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.flatten(1, -1))


class Qwen3MLP(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=False)
        self.down_proj = RowParallelLinear(inter, hidden, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, hf_config, attention_backend: str):
        super().__init__()
        self.self_attn = Qwen3Attention(hf_config, attention_backend)
        self.mlp = Qwen3MLP(hf_config)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual, meta: AttentionMetadata):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, meta)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3Model(nn.Module):
    def __init__(self, hf_config, attention_backend: str):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen3DecoderLayer(hf_config, attention_backend) for _ in range(hf_config.num_hidden_layers)])
        self.norm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, meta)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name -> (our parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, hf_config, attention_backend: str):
        super().__init__()
        self.model = Qwen3Model(hf_config, attention_backend)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)
