"""Skinny GEMM: y = x @ weight.T + bias for a few rows of x (decode), in Triton.

With at most 16 rows the product is bound by reading the weight once, so the kernel is laid out for
weight bandwidth: each program streams a [BLOCK_N, K] slice of the weight in [BLOCK_N, BLOCK_K] tiles
and multiplies each tile with all rows of x (padded to 16, the smallest tl.dot width). The weight is
the dot's left operand (y.T = weight @ x.T): its BLOCK_N rows fill the MMA's M side (64 per Hopper
wgmma) and the 16 padded rows of x the narrow N side, instead of 48 of 64 MMA rows being padding.

When N / BLOCK_N gives too few programs to keep every SM streaming, K is split across SPLIT_K
programs too. They write float32 partials and count their arrival with an atomic; the last program of
a column tile sums the partials in split order (deterministic, unlike atomically added outputs), so no
second kernel is launched. At batch 1 kernels are so short that a launch is a large share of each.

For the same reason the small ops before a projection run in its prologue, on the x tiles as they are
loaded (x is a few rows: recomputing them in every program is free): the residual add + RMSNorm
before qkv_proj and gate_up_proj (skinny_add_rms_norm_linear), SiLU-and-mul before down_proj
(skinny_silu_and_mul_linear). Nothing depends on tensor values, so launches are CUDA-graph safe.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from nanovllm.utils.device import num_sms, zeroed_counters

SKINNY_MAX_ROWS = 16


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def launch_config(N: int, K: int, sms: int) -> LaunchConfig:
    """Default tiles for x [M, K] @ weight [N, K].T: 64 x 128 weight tiles (16 KiB in 16 bits), and
    K split (by powers of two, at most 8, each split keeping >= 2 K tiles) until there are about
    two programs per SM. The H200 sweep (scripts/bench_gemm.py --sweep, BENCHMARKS.md) found the best
    configs within ~10% of these and no dependence on the number of rows."""
    block_n, block_k = 64, min(128, max(16, triton.next_power_of_2(K)))
    tiles_n = triton.cdiv(N, block_n)
    split_k = 1
    while tiles_n * split_k < 2 * sms and split_k < 8 and K >= 4 * split_k * block_k:
        split_k *= 2
    return LaunchConfig(block_n, block_k, split_k, num_warps=4, num_stages=4)


# What the kernel does to x's tiles before multiplying them (constexprs: kernels may read no other globals).
PLAIN, ADD_RMS_NORM, SILU_AND_MUL = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _inverse_rms(x_ptr, res_ptr, offs_m, m_mask, K, stride_xm, eps, HAS_RESIDUAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms of each row of x (+ residual) [BLOCK_M], in float32 over all K columns."""
    sum_sq = tl.zeros([BLOCK_M], tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        mask = m_mask[:, None] & (cols < K)[None, :]
        h = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h += tl.load(res_ptr + offs_m[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sum_sq += tl.sum(h * h, 1)
    return tl.math.rsqrt(sum_sq / K + eps)


@triton.jit
def _x_tile(x_ptr, res_ptr, norm_ptr, res_out_ptr, offs_m, cols, mask, K, stride_xm, inv_rms, write_residual,
            PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] tile of the GEMM's left operand at columns `cols`, in x's dtype, rounded
    where the separate torch ops round (layernorm.add_rms_norm, activation.silu_and_mul run eagerly):
    PLAIN: x itself. ADD_RMS_NORM: h = x + residual (written to res_out by the programs with
    write_residual), then norm_weight * (h / rms). SILU_AND_MUL: x rows are [gate | up], 2K wide:
    silu(gate) * up."""
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    if PROLOGUE == ADD_RMS_NORM:
        h = x.to(tl.float32)
        if HAS_RESIDUAL:
            res_offs = offs_m[:, None] * K + cols[None, :]
            h += tl.load(res_ptr + res_offs, mask=mask, other=0.0).to(tl.float32)
            if write_residual:
                tl.store(res_out_ptr + res_offs, h.to(x.dtype), mask=mask)
        weight = tl.load(norm_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        x = (weight[None, :] * (h * inv_rms[:, None]).to(x.dtype).to(tl.float32)).to(x.dtype)
    elif PROLOGUE == SILU_AND_MUL:
        gate = x.to(tl.float32)
        up = tl.load(x_ptr + offs_m[:, None] * stride_xm + K + cols[None, :], mask=mask, other=0.0)
        x = ((gate / (1.0 + tl.exp(-gate))).to(x.dtype).to(tl.float32) * up.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _write_y(acc, b_ptr, y_ptr, offs_m, offs_n, n_mask, mask, stride_ym, HAS_BIAS: tl.constexpr):
    """y.T tile acc [BLOCK_N, BLOCK_M] float32 (+ bias) -> y [M, N] in y's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _skinny_kernel(x_ptr, res_ptr, norm_ptr, res_out_ptr, w_ptr, b_ptr, y_ptr, part_ptr, counter_ptr,
                   M, N, K, stride_xm, stride_ym, k_per_split, eps,
                   PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                   EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), SPLIT_K): output features n of all rows, over one split of K.

    SPLIT_K > 1: each program writes its float32 partial [M, BLOCK_N] to part [SPLIT_K, M, N] and counts
    itself in counter[pid_n]; the last of the tile's SPLIT_K programs to arrive sums the partials in
    split order (deterministic, whichever program is last), writes y and resets the counter to 0."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    k_start = pid_k * k_per_split  # k_per_split is a multiple of BLOCK_K: tiles never straddle splits
    k_end = tl.minimum(k_start + k_per_split, K)
    if PROLOGUE == ADD_RMS_NORM:
        inv_rms = _inverse_rms(x_ptr, res_ptr, offs_m, m_mask, K, stride_xm, eps, HAS_RESIDUAL, BLOCK_M, BLOCK_K)
    else:
        inv_rms = tl.zeros([BLOCK_M], tl.float32)  # unused
    write_residual = pid_n == 0  # one column tile's programs write the new residual, each its K split

    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        cols = k + offs_k
        if EVEN_K:  # row masks only: the loads stay vectorized along K
            w = tl.load(w_ptrs + k, mask=n_mask[:, None], other=0.0)
            x_mask = m_mask[:, None]
        else:  # the last tile is ragged: zeros past K in both operands
            w = tl.load(w_ptrs + k, mask=n_mask[:, None] & (cols < K)[None, :], other=0.0)
            x_mask = m_mask[:, None] & (cols < K)[None, :]
        x = _x_tile(x_ptr, res_ptr, norm_ptr, res_out_ptr, offs_m, cols, x_mask, K, stride_xm, inv_rms,
                    write_residual, PROLOGUE, HAS_RESIDUAL)
        acc = tl.dot(w, tl.trans(x), acc)  # [BLOCK_N, BLOCK_M] = y.T tile

    out_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1:
        _write_y(acc, b_ptr, y_ptr, offs_m, offs_n, n_mask, out_mask, stride_ym, HAS_BIAS)
    else:
        part_offs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]  # [BLOCK_N, BLOCK_M] in one split
        tl.store(part_ptr + pid_k * M * N + part_offs, acc, mask=out_mask)
        # Every thread's partial is stored before the arrival is counted; the counter's acq_rel atomic
        # (GPU scope) publishes them to, and makes the other splits' visible for, the last program.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in tl.static_range(SPLIT_K):  # .cg: read L2, not a possibly stale L1 line
                total += tl.load(part_ptr + s * M * N + part_offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            _write_y(total, b_ptr, y_ptr, offs_m, offs_n, n_mask, out_mask, stride_ym, HAS_BIAS)
            tl.store(counter_ptr + pid_n, 0)


def _launch(x, weight, bias, prologue, k, residual=None, norm_weight=None, eps=0.0, residual_out=None,
            **overrides) -> torch.Tensor:
    """y [M, N] = prologue(x) @ weight.T + bias, K = k columns of the prologue's output."""
    M, N = x.shape[0], weight.shape[0]
    assert M <= SKINNY_MAX_ROWS and x.dtype in (torch.float16, torch.bfloat16) and x.stride(1) == 1
    assert weight.shape == (N, k) and weight.dtype == x.dtype and weight.is_contiguous()
    assert bias is None or (bias.shape == (N,) and bias.is_contiguous())
    config = dataclasses.replace(launch_config(N, k, num_sms(x.device)),
                                 **{name: v for name, v in overrides.items() if v is not None})
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    # Whole K tiles per split; splits left with no tile are dropped.
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    splits = triton.cdiv(k, k_per_split)
    tiles_n = triton.cdiv(N, config.block_n)
    if splits > 1:
        partials = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
        counters = zeroed_counters("skinny_gemm", x.device, tiles_n)
    else:
        partials = counters = y  # unused
    unused = weight
    _skinny_kernel[(tiles_n, splits)](
        x, unused if residual is None else residual, unused if norm_weight is None else norm_weight,
        unused if residual_out is None else residual_out, weight, unused if bias is None else bias, y, partials,
        counters, M, N, k, x.stride(0), y.stride(0), k_per_split, eps,
        PROLOGUE=prologue.value, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        EVEN_K=k % config.block_k == 0, BLOCK_M=SKINNY_MAX_ROWS, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, SPLIT_K=splits, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M <= SKINNY_MAX_ROWS, K] with float32 accumulation.

    x: 16-bit, last dim contiguous (rows may be strided); weight [N, K] contiguous, x's dtype;
    bias: [N] or None. Returns y [M, N] in x.dtype. Keyword arguments override launch_config.
    """
    return _launch(x, weight, bias, PLAIN, x.shape[1], block_n=block_n, block_k=block_k, split_k=split_k,
                   num_warps=num_warps, num_stages=num_stages)


def skinny_add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                               weight: torch.Tensor, bias: torch.Tensor | None = None,
                               **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(RMSNorm(x + residual), weight, bias), x + residual): layernorm.add_rms_norm (rms_norm
    without a residual) and the projection after it in one kernel. x, residual [M, K] (residual and
    norm_weight contiguous, x's dtype). Returns y [M, N] and the new residual (x itself without one)."""
    assert norm_weight.shape == (x.shape[1],) and norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
    if residual is None:
        return _launch(x, weight, bias, ADD_RMS_NORM, x.shape[1], norm_weight=norm_weight, eps=eps, **overrides), x
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
    residual_out = torch.empty_like(residual)
    y = _launch(x, weight, bias, ADD_RMS_NORM, x.shape[1], residual=residual, norm_weight=norm_weight, eps=eps,
                residual_out=residual_out, **overrides)
    return y, residual_out


def skinny_silu_and_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                               **overrides) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight, bias) for gate_up [M, 2K] = [gate | up] (activation.silu_and_mul
    and the down projection after it) in one kernel."""
    assert gate_up.shape[1] % 2 == 0
    return _launch(gate_up, weight, bias, SILU_AND_MUL, gate_up.shape[1] // 2, **overrides)
