"""The dense decoder of the supported families: GQA attention with RoPE, SwiGLU MLP, pre-norm
residual blocks, tensor-parallel layers. A family (qwen3.py, qwen2.py, llama.py) subclasses
`DecoderForCausalLM` and states its `DecoderOptions`; parameter names follow the checkpoints'."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.checkpoint.hf_config import head_dim
from nanovllm.kernels.gemm.skinny import skinny_swiglu
from nanovllm.kernels.gemm.split_k import SplitKSum
from nanovllm.kernels.qk_norm_rope import V_STORE_TILE, NormRopeInputs, qk_norm_rope
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention, AttentionMetadata
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    skinny_applies,
)
from nanovllm.layers.rotary_embedding import RotaryEmbedding, get_rope


@dataclass(frozen=True, slots=True)
class DecoderOptions:
    """Where the families differ."""

    qkv_bias: bool = False  # bias on q/k/v_proj (Qwen2)
    o_bias: bool = False  # bias on o_proj
    mlp_bias: bool = False  # bias on gate/up/down_proj
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)


class DecoderAttention(nn.Module):
    def __init__(self, hf_config, options: DecoderOptions, attention_backend: str,
                 rotary_emb: RotaryEmbedding):
        super().__init__()
        tp_size = torch.distributed.get_world_size()
        hidden = hf_config.hidden_size
        self.head_dim = head_dim(hf_config)
        self.num_heads = hf_config.num_attention_heads // tp_size
        self.num_kv_heads = hf_config.num_key_value_heads // tp_size
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, hf_config.num_attention_heads,
                                          hf_config.num_key_value_heads, bias=options.qkv_bias)
        self.o_proj = RowParallelLinear(hf_config.num_attention_heads * self.head_dim, hidden,
                                        bias=options.o_bias)
        self.rotary_emb = rotary_emb  # one table for every layer
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5,
                              self.num_kv_heads, attention_backend)
        self.qk_norm = options.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=hf_config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor | SplitKSum:
        fused = hidden_states.is_cuda
        qkv = self.qkv_proj(hidden_states, defer_sum=fused)  # fused: the next kernel sums it
        if fused and self.attn.decodes_from_qkv(qkv, meta):
            inputs = self.norm_rope_inputs(positions, qkv, meta.slot_mapping)
            out = self.attn.decode_from_qkv(inputs, meta)
        else:
            q, k, v = self.norm_rope(positions, qkv, fused, meta.slot_mapping, meta.is_prefill)
            out = self.attn(q, k, v, meta, kv_stored=fused).flatten(1, -1)
        return self.o_proj(out, defer_sum=True)  # summed by the post-attention norm

    def norm_rope_inputs(self, positions: torch.Tensor, qkv: torch.Tensor | SplitKSum,
                         slot_mapping: torch.Tensor) -> NormRopeInputs:
        return NormRopeInputs(qkv, positions, self.rotary_emb.cos_sin_cache, slot_mapping,
                              self.num_heads, **self.qk_norm_weights())

    def qk_norm_weights(self) -> dict:
        if not self.qk_norm:
            return {}
        return dict(q_weight=self.q_norm.weight, k_weight=self.k_norm.weight, eps=self.q_norm.eps)

    def norm_rope(self, positions: torch.Tensor, qkv: torch.Tensor | SplitKSum, fused: bool,
                  slot_mapping: torch.Tensor | None = None,
                  prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, num_heads, head_dim], k, v [T, num_kv_heads, head_dim]: q and k normed (qk_norm)
        and rotated. `fused`: the Triton kernel, which with slot_mapping also stores k and v into
        the cache; else the torch ops (the exact reference), storing nothing."""
        if fused:
            store = {}
            if slot_mapping is not None:
                store = dict(slot_mapping=slot_mapping, v_store_tile=V_STORE_TILE if prefill else 0,
                             **self.attn.kv_cache_views())
            return qk_norm_rope(qkv, positions, self.rotary_emb.cos_sin_cache, self.num_heads,
                                self.num_kv_heads, self.head_dim, **self.qk_norm_weights(), **store)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return *self.rotary_emb(positions, q, k), v.view(-1, self.num_kv_heads, self.head_dim)


class DecoderMLP(nn.Module):
    def __init__(self, hf_config, options: DecoderOptions):
        super().__init__()
        hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter],
                                                       bias=options.mlp_bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=options.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitKSum:
        # down_proj's split-K partials are summed by the norm that reads them next.
        if skinny_applies(x):  # one kernel projects and activates
            act = skinny_swiglu(x, self.gate_up_proj.weight, self.gate_up_proj.bias, defer=True)
        else:
            act = self.act_fn(self.gate_up_proj(x))
        return self.down_proj(act, defer_sum=True)


class DecoderLayer(nn.Module):
    def __init__(self, hf_config, options: DecoderOptions, attention_backend: str, mlp: nn.Module,
                 rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = DecoderAttention(hf_config, options, attention_backend, rotary_emb)
        self.mlp = mlp
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


class DecoderModel(nn.Module):
    def __init__(self, hf_config, options: DecoderOptions, attention_backend: str,
                 make_mlp: Callable[[int], nn.Module]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        # The cos/sin table [max_position, head_dim] float32 is the same for every layer: one copy.
        rotary_emb = get_rope(head_dim(hf_config), hf_config)
        self.layers = nn.ModuleList(
            [DecoderLayer(hf_config, options, attention_backend, make_mlp(i), rotary_emb)
             for i in range(hf_config.num_hidden_layers)])
        self.norm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, meta)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    """A causal LM over `DecoderModel`; subclasses say how their config maps to `DecoderOptions`."""

    # checkpoint name -> (our parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def decoder_options(cls, hf_config) -> DecoderOptions:
        raise NotImplementedError

    def make_mlp(self, hf_config, options: DecoderOptions, layer: int) -> nn.Module:
        """The feed-forward block of layer `layer` (a mixture of experts overrides this)."""
        return DecoderMLP(hf_config, options)

    def __init__(self, hf_config, attention_backend: str, expert_parallel: bool = False):
        super().__init__()
        self.expert_parallel = expert_parallel  # whole experts per rank (MoE families only)
        options = self.decoder_options(hf_config)
        self.model = DecoderModel(hf_config, options, attention_backend,
                                  lambda layer: self.make_mlp(hf_config, options, layer))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)
