"""Fused per-head q/k RMSNorm (Qwen3's q_norm, k_norm) and neox-style RoPE in one Triton kernel.

It replaces `rms_norm` on q and k followed by `apply_rope` on CUDA, where those are several small
kernels per layer. The op order is the torch code's, so results match it to the last bit but for the
sum of squares, whose reduction order differs (see tests/test_qk_norm_rope.py for the bounds).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, stride_qkv, positions_ptr, cos_sin_ptr, stride_cs, q_ptr, k_ptr,
                         q_weight_ptr, k_weight_ptr, eps,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, D: tl.constexpr,
                         HAS_NORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # below NUM_HEADS a q head, then the k heads
    half = tl.arange(0, D // 2)
    # The k heads follow the q heads in a qkv row, so `head` indexes both.
    src = qkv_ptr + token * stride_qkv + head * D + half
    x1 = tl.load(src)
    x2 = tl.load(src + D // 2)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    is_q = head < NUM_HEADS
    if HAS_NORM:
        # rms_norm: x * rsqrt(mean(x^2) + eps) in float32, rounded to dtype, then weight * x in dtype
        # (the float32 product of two 16-bit values is exact, so one rounding gives torch's result).
        mean_sq = tl.sum(x1 * x1 + x2 * x2, axis=0) / D
        inv_rms = tl.math.rsqrt(mean_sq + eps)
        if is_q:
            w_ptr = q_weight_ptr
        else:
            w_ptr = k_weight_ptr
        w1 = tl.load(w_ptr + half).to(tl.float32)
        w2 = tl.load(w_ptr + D // 2 + half).to(tl.float32)
        x1 = (w1 * (x1 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # apply_rope: cos_sin_cache row = [cos | sin], each D // 2 float32
    cs = cos_sin_ptr + tl.load(positions_ptr + token) * stride_cs + half
    cos = tl.load(cs)
    sin = tl.load(cs + D // 2)
    y1 = (x1 * cos - x2 * sin).to(dtype)
    y2 = (x2 * cos + x1 * sin).to(dtype)
    if is_q:
        dst = q_ptr + (token * NUM_HEADS + head) * D + half
    else:
        dst = k_ptr + (token * NUM_KV_HEADS + head - NUM_HEADS) * D + half
    tl.store(dst, y1)
    tl.store(dst + D // 2, y2)


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, q_weight: torch.Tensor | None = None,
                 k_weight: torch.Tensor | None = None, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim], new contiguous tensors, from the qkv
    projection's output [T, (num_heads + 2 * num_kv_heads) * head_dim]: each head RMS-normed with
    q_weight / k_weight (when given; None for RoPE only), then rotated by RoPE at `positions` [T].

    One program per (token, q or k head) reads its head once (and the token's cos/sin row) and writes the
    result; no host sync, so it is CUDA-graph capturable.
    """
    num_tokens = qkv.shape[0]
    assert head_dim & (head_dim - 1) == 0, f"head_dim={head_dim} is not a power of two"
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert cos_sin_cache.shape[1] == head_dim and cos_sin_cache.stride(1) == 1
    assert cos_sin_cache.dtype == torch.float32 and positions.shape == (num_tokens,)
    has_norm = q_weight is not None
    assert has_norm == (k_weight is not None)
    if has_norm:
        assert q_weight.dtype == k_weight.dtype == qkv.dtype, "the kernel rounds weight * x to qkv's dtype"
        assert q_weight.is_contiguous() and k_weight.is_contiguous()
    q = qkv.new_empty(num_tokens, num_heads, head_dim)
    k = qkv.new_empty(num_tokens, num_kv_heads, head_dim)
    _qk_norm_rope_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, qkv.stride(0), positions, cos_sin_cache, cos_sin_cache.stride(0), q, k, q_weight, k_weight, eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, D=head_dim, HAS_NORM=has_norm,
        # One warp per head (32 or 64 elements a half): the sum of squares needs no cross-warp step.
        num_warps=1,
        # No FMA contraction: x1 * cos - x2 * sin rounds each product as torch does.
        enable_fp_fusion=False)
    return q, k
