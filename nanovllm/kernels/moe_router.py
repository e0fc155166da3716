"""The MoE router's softmax + top-k (+ renormalization) in one kernel, where torch takes five
(softmax, topk, sum, divide, cast): a decode step runs it once per sparse layer."""

import torch
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 16


@triton.jit(do_not_specialize=["T"])
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, T, E, stride_t, TOP_K: tl.constexpr,
                         K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, E_PAD: tl.constexpr,
                         BLOCK_T: tl.constexpr):
    """Grid (cdiv(T, BLOCK_T),): per row, softmax over E logits in float32, the TOP_K largest
    (ties: the lower id), divided by their sum if RENORMALIZE, written in weights' dtype."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    row_mask = rows < T
    mask = row_mask[:, None] & (cols < E)[None, :]
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :], mask=mask,
                other=-float("inf")).to(tl.float32)
    x = tl.where(row_mask[:, None], x, 0.0)  # rows past T: finite, never stored
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    p = tl.where((cols < E)[None, :], p, -1.0)  # padding columns are never picked
    slots = tl.arange(0, K_PAD)
    top = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    top_ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        best_id = tl.argmax(p, axis=1, tie_break_left=True)
        top = tl.where(slots[None, :] == j, best[:, None], top)
        top_ids = tl.where(slots[None, :] == j, best_id[:, None], top_ids)
        p = tl.where(cols[None, :] == best_id[:, None], -2.0, p)
    if RENORMALIZE:
        top = top / tl.sum(top, axis=1)[:, None]
    out = rows[:, None] * TOP_K + slots[None, :]
    out_mask = row_mask[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, top.to(weights_ptr.dtype.element_ty), mask=out_mask)
    tl.store(ids_ptr + out, top_ids, mask=out_mask)


def topk_softmax(router_logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] in the logits' dtype, expert ids [T, top_k]
    int32): layers.fused_moe.select_experts in one kernel."""
    T, E = router_logits.shape
    weights = torch.empty(T, top_k, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=router_logits.device)
    if T:
        grid = (triton.cdiv(T, ROWS_PER_PROGRAM),)
        _topk_softmax_kernel[grid](router_logits, weights, ids, T, E, router_logits.stride(0),
                                   TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
                                   RENORMALIZE=renormalize, E_PAD=triton.next_power_of_2(E),
                                   BLOCK_T=ROWS_PER_PROGRAM, num_warps=4)
    return weights, ids
