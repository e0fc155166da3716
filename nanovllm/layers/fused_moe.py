"""Mixture-of-experts layers: the router's top-k and the stacked SwiGLU experts (fused Triton GEMMs
on CUDA, a loop over experts elsewhere). TP slices every expert, EP holds whole experts; either way
one all-reduce sums the ranks' partial outputs (docs/architecture.md)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.gemm.split_k import SplitKSum
from nanovllm.kernels.moe import fused_moe
from nanovllm.kernels.moe_router import topk_softmax
from nanovllm.layers.linear import tp_rank_and_size

SHARDS = ("gate", "up", "down")  # gate_proj and up_proj -> gate_up_proj, down_proj -> down_proj


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k], expert ids [T, top_k]): float32 softmax, top_k,
    renormalized if `renormalize` (one Triton kernel on CUDA)."""
    if router_logits.is_cuda and router_logits.stride(1) == 1:
        return topk_softmax(router_logits, top_k, renormalize)
    return select_experts_torch(router_logits, top_k, renormalize)


def select_experts_torch(router_logits: torch.Tensor, top_k: int,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts by torch ops (transformers' Qwen3MoeTopKRouter): the reference."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_offset: int = 0) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate; up), w2 [E, H, I], topk_* [T, k] -> [T, H], by a loop over
    the experts held, [expert_offset, expert_offset + E): the CPU path and the reference."""
    out = torch.zeros_like(x)
    local_ids = topk_ids - expert_offset
    for expert in range(w13.shape[0]):
        tokens, slots = torch.where(local_ids == expert)
        if tokens.numel() == 0:
            continue
        gate, up = F.linear(x.index_select(0, tokens), w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * topk_weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


class FusedMoE(nn.Module):
    """Stacked SwiGLU experts: gate_up_proj [E_local, 2 * I_local, hidden], down_proj [E_local,
    hidden, I_local], loaded per checkpoint tensor (shard id (expert, "gate"|"up"|"down"))."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 expert_parallel: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.expert_parallel = expert_parallel
        if expert_parallel:
            self.num_local_experts = num_experts // self.tp_size
            self.intermediate = intermediate_size
        else:
            self.num_local_experts = num_experts
            self.intermediate = intermediate_size // self.tp_size
        self.full_intermediate = intermediate_size
        self.expert_offset = self.tp_rank * self.num_local_experts if expert_parallel else 0
        local, inter = self.num_local_experts, self.intermediate
        self.gate_up_proj = self._parameter((local, 2 * inter, hidden_size), SHARDS[:2])
        self.down_proj = self._parameter((local, hidden_size, inter), SHARDS[2:])

    def _parameter(self, shape: tuple[int, ...], kinds: tuple[str, ...]) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape), requires_grad=False)
        param.weight_loader = self.weight_loader
        # Every expert's tensors must be in the checkpoint, whichever rank holds them.
        param.shard_ids = [(e, kind) for e in range(self.num_experts) for kind in kinds]
        return param

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int, str] | None = None):
        if shard_id is None:  # a tensor named like the stacked parameter itself
            raise ValueError("stacked expert tensors are not supported: the checkpoint must hold "
                             "one tensor per expert (mlp.experts.{e}.gate_proj.weight, ...)")
        expert, kind = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range: the model has {self.num_experts}")
        full = ((self.hidden_size, self.full_intermediate) if kind == "down"
                else (self.full_intermediate, self.hidden_size))
        if tuple(loaded.shape) != full:
            raise ValueError(f"shape mismatch for expert {expert}'s {kind}_proj: expected {full}, "
                             f"checkpoint has {tuple(loaded.shape)}")
        local = expert - self.expert_offset
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        inter = self.intermediate
        if not self.expert_parallel:  # this rank's slice of the intermediate dim
            loaded = loaded.narrow(1 if kind == "down" else 0, self.tp_rank * inter, inter)
        offset = inter if kind == "up" else 0
        target = param.data[local] if kind == "down" else param.data[local].narrow(0, offset, inter)
        target.copy_(loaded)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor | SplitKSum:
        """x [T, hidden], topk_* [T, k] (global expert ids) -> [T, hidden], summed over ranks;
        on one GPU maybe unsummed over the k experts (a SplitKSum for the next norm)."""
        if x.is_cuda:
            out = fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                            expert_offset=self.expert_offset,
                            all_local=self.num_local_experts == self.num_experts,
                            defer_sum=self.tp_size == 1)
        else:
            out = moe_reference(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                                self.expert_offset)
        if self.tp_size > 1:
            dist.all_reduce(out)
        return out
