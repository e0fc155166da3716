"""Qwen3-MoE (Qwen3-30B-A3B class): Qwen3's attention; the feed-forward of each layer is a sparse
mixture of experts (router softmax, top-k, optional renormalization) unless the layer is listed in
`mlp_only_layers` or falls between every `decoder_sparse_step`-th layer, which keep a dense MLP."""

import re

import torch
from torch import nn

from nanovllm.kernels.gemm.split_k import SplitKSum
from nanovllm.layers.fused_moe import FusedMoE, select_experts
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions

# mlp.experts.{e}.{gate,up,down}_proj.weight, as save_pretrained and the hub's files store them
EXPERT_TENSOR = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, hf_config, expert_parallel: bool):
        super().__init__()
        self.top_k = hf_config.num_experts_per_tok
        self.norm_topk_prob = bool(hf_config.norm_topk_prob)
        self.gate = ReplicatedLinear(hf_config.hidden_size, hf_config.num_experts)  # the router
        self.experts = FusedMoE(hf_config.num_experts, hf_config.hidden_size,
                                hf_config.moe_intermediate_size, expert_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitKSum:
        """x [T, hidden] -> [T, hidden] (maybe as partials that the next norm sums)."""
        weights, ids = select_experts(self.gate(x), self.top_k, self.norm_topk_prob)
        return self.experts(x, weights, ids)


def is_sparse_layer(hf_config, layer: int) -> bool:
    """transformers' rule for which layers hold experts."""
    return (layer not in (hf_config.mlp_only_layers or []) and hf_config.num_experts > 0
            and (layer + 1) % hf_config.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config) -> DecoderOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)

    def make_mlp(self, hf_config, options: DecoderOptions, layer: int) -> nn.Module:
        if is_sparse_layer(hf_config, layer):
            return Qwen3MoeSparseMoeBlock(hf_config, self.expert_parallel)
        return super().make_mlp(hf_config, options, layer)

    @staticmethod
    def route_weight(ckpt_name: str) -> tuple[str, tuple[int, str]] | None:
        """A per-expert checkpoint tensor -> (our stacked parameter, (expert, shard)); else None."""
        match = EXPERT_TENSOR.match(ckpt_name)
        if match is None:
            return None
        prefix, expert, kind = match.groups()
        param = "down_proj" if kind == "down" else "gate_up_proj"
        return f"{prefix}.{param}", (int(expert), kind)
