"""Skinny GEMM for decode: y = x @ weight.T + bias for at most SKINNY_MAX_ROWS rows of x.

The weight is the dot's left operand (y.T = weight @ x.T), x's rows the MMA's narrow N side. K may
be split into float32 partials (SplitKSum). With PDL a program loads its first weight tile, then
waits for x. x may be a SplitSoftmax or SwiGLUSplitKSum, merged or activated as it loads."""

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.split_softmax import SplitSoftmax, load_merged_tile
from nanovllm.kernels.device import (
    HOPPER_SHARED_MEMORY,
    num_sms,
    pdl_enabled,
    prefetch_to_l2,
    shared_memory,
)
from nanovllm.kernels.gemm.split_k import SplitKSum, SwiGLUSplitKSum, reduce_splits, sum_splits

# Most rows of x the skinny GEMM takes; above, the tiled GEMM or cuBLAS (docs/kernels.md).
SKINNY_MAX_ROWS = 32
# 128-byte lines of each weight row a program prefetches into L2 before its wait (docs/kernels.md).
PREFETCH_MAX_LINES = 16
# With PDL, K width of a one-tile split, loaded whole before its wait (docs/kernels.md).
ONE_TILE_K = 256
# Most rows for which skinny_swiglu(defer=True) leaves SiLU to down_proj (docs/kernels.md).
DEFERRED_ACTIVATION_MAX_ROWS = 8
WIDE_TILE_MIN_ROWS = DEFERRED_ACTIVATION_MAX_ROWS + 1
# Most one-tile partials from WIDE_TILE_MIN_ROWS rows; more take 2x wide tiles (docs/kernels.md).
MAX_ONE_TILE_PARTIALS = 8


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@functools.cache
def launch_config(N: int, K: int, sms: int, pdl: bool = False, rows: int = 1) -> LaunchConfig:
    """Tiles for x [rows, K] @ weight [N, K].T: 64 x 128, K split until ~2 programs an SM; with PDL
    one stage fewer, or narrow splits made one ONE_TILE_K tile a program (docs/kernels.md)."""
    block_n, block_k = 64, min(128, max(16, triton.next_power_of_2(K)))
    tiles_n = triton.cdiv(N, block_n)
    split_k = 1
    while tiles_n * split_k < 2 * sms and split_k < 8 and K >= 4 * split_k * block_k:
        split_k *= 2
    if pdl and K % ONE_TILE_K == 0 and K <= 2 * ONE_TILE_K * split_k:
        splits = K // ONE_TILE_K
        if rows >= WIDE_TILE_MIN_ROWS and splits > MAX_ONE_TILE_PARTIALS and splits % 2 == 0:
            return LaunchConfig(block_n, 2 * ONE_TILE_K, splits // 2, num_warps=8, num_stages=1)
        return LaunchConfig(block_n, ONE_TILE_K, splits, num_warps=4, num_stages=1)
    return LaunchConfig(block_n, block_k, split_k, num_warps=4, num_stages=3 if pdl else 4)


@triton.jit
def silu_and_mul_as_torch(gate, up, dtype: tl.constexpr):
    """silu(gate) * up of float32 gate and up, rounded to dtype after each op as torch rounds."""
    g = gate.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (silu * up.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _load_tile(ptrs, k, row_mask, offs_k, K, EVEN_K: tl.constexpr):
    # EVEN_K: masked by rows only, so the loads stay vectorized along K.
    if EVEN_K:
        tile = tl.load(ptrs + k, mask=row_mask, other=0.0)
    else:
        tile = tl.load(ptrs + k, mask=row_mask & (k + offs_k < K)[None, :], other=0.0)
    return tile


@triton.jit
def _load_activated_tile(parts_ptr, M, k, K, stride_xm, split_stride, SPLITS: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """x[:ROWS, k:k + BLOCK_K] of a SwiGLUSplitKSum at parts_ptr (up K columns after gate)."""
    rows = tl.arange(0, ROWS)
    cols = k + tl.arange(0, BLOCK_K)
    offs = rows[:, None] * stride_xm + cols[None, :]
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    gate = sum_splits(parts_ptr, offs, mask, split_stride, SPLITS)
    up = sum_splits(parts_ptr + K, offs, mask, split_stride, SPLITS)
    return silu_and_mul_as_torch(gate, up, dtype)


@triton.jit
def _load_x(x_ptrs, k, m_mask, offs_k, K, EVEN_K: tl.constexpr, x_ptr, stride_xm, x_max_ptr,
            x_sum_ptr, M, x_heads, x_split_stride, X_SPLITS: tl.constexpr,
            X_HEAD_DIM: tl.constexpr, X_GATED: tl.constexpr, X_ROWS: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """x's tile [BLOCK_M, BLOCK_K] at k; computed from partials for X_ROWS rows, then broadcast."""
    if X_SPLITS == 0:
        x = _load_tile(x_ptrs, k, m_mask[:, None], offs_k, K, EVEN_K)
    else:
        if X_GATED:
            tile = _load_activated_tile(x_ptr, M, k, K, stride_xm, x_split_stride, X_SPLITS,
                                        X_ROWS, BLOCK_K, dtype)
        else:
            tile = load_merged_tile(x_ptr, x_max_ptr, x_sum_ptr, M, k, x_heads, X_HEAD_DIM,
                                    X_SPLITS, X_ROWS, BLOCK_K, dtype)
        tiled = tl.broadcast_to(tile[None, :, :], [BLOCK_M // X_ROWS, X_ROWS, BLOCK_K])
        x = tl.where(m_mask[:, None], tl.reshape(tiled, [BLOCK_M, BLOCK_K]), 0.0)
    return x


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_om, k_per_split,
                   x_max_ptr, x_sum_ptr, x_heads, x_split_stride, HAS_BIAS: tl.constexpr,
                   EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
                   PREFETCH_LINES: tl.constexpr, GATED: tl.constexpr = False,
                   X_SPLITS: tl.constexpr = 0, X_HEAD_DIM: tl.constexpr = 0,
                   X_GATED: tl.constexpr = False, X_ROWS: tl.constexpr = 0):
    """Grid (cdiv(N, BLOCK_N), SPLIT_K). out: y [M, N] (+ bias) if SPLIT_K == 1, else float32
    partials [SPLIT_K, M, N]. GATED: weight [2N, K] is [gate; up], out silu(gate) * up [M, N].
    X_SPLITS > 0: x from partials (_load_x; SplitSoftmax m and l at x_max_ptr, x_sum_ptr)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    k_start = pid_k * k_per_split  # a multiple of BLOCK_K: tiles never straddle splits
    k_end = tl.minimum(k_start + k_per_split, K)
    w_up_ptrs = w_ptr + (offs_n.to(tl.int64) + N)[:, None] * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    loop_start = k_start
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        line_k = tl.minimum(k_start + tl.arange(0, PREFETCH_LINES) * 64, k_end - 1)
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        prefetch_to_l2(w_ptr + rows[:, None] * K + line_k[None, :])
        if GATED:
            prefetch_to_l2(w_ptr + (rows + N)[:, None] * K + line_k[None, :])
        w = _load_tile(w_ptrs, k_start, n_mask[:, None], offs_k, K, EVEN_K)
        if GATED:
            w_up = _load_tile(w_up_ptrs, k_start, n_mask[:, None], offs_k, K, EVEN_K)
        tl.extra.cuda.gdc_wait()
        x = tl.trans(_load_x(x_ptrs, k_start, m_mask, offs_k, K, EVEN_K, x_ptr, stride_xm,
                             x_max_ptr, x_sum_ptr, M, x_heads, x_split_stride, X_SPLITS,
                             X_HEAD_DIM, X_GATED, X_ROWS, BLOCK_M, BLOCK_K,
                             w_ptr.dtype.element_ty))
        acc = tl.dot(w, x, acc)
        if GATED:
            acc_up = tl.dot(w_up, x, acc_up)
        loop_start += BLOCK_K
    for k in range(loop_start, k_end, BLOCK_K):
        x = tl.trans(_load_x(x_ptrs, k, m_mask, offs_k, K, EVEN_K, x_ptr, stride_xm, x_max_ptr,
                             x_sum_ptr, M, x_heads, x_split_stride, X_SPLITS, X_HEAD_DIM,
                             X_GATED, X_ROWS, BLOCK_M, BLOCK_K, w_ptr.dtype.element_ty))
        acc = tl.dot(_load_tile(w_ptrs, k, n_mask[:, None], offs_k, K, EVEN_K), x, acc)
        if GATED:
            w_up = _load_tile(w_up_ptrs, k, n_mask[:, None], offs_k, K, EVEN_K)
            acc_up = tl.dot(w_up, x, acc_up)

    out_mask = n_mask[:, None] & m_mask[None, :]
    if GATED:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            acc_up += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        y = silu_and_mul_as_torch(acc, acc_up, out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], y, mask=out_mask)
    elif SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None],
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = out_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(part, acc, mask=out_mask)


def skinny_linear(x: "torch.Tensor | SplitSoftmax | SwiGLUSplitKSum", weight: torch.Tensor,
                  bias: torch.Tensor | None = None, *, defer_sum: bool = False,
                  block_n: int | None = None, block_k: int | None = None,
                  split_k: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None) -> "torch.Tensor | SplitKSum":
    """F.linear(x [M, K], weight [N, K], bias [N] | None) -> y [M, N], or with defer_sum, no bias
    and K split, y's SplitKSum. Keywords override launch_config."""
    M, K = x.shape
    N = weight.shape[0]
    _check_operands(x, weight, bias, N)
    config = _overridden(launch_config(N, K, num_sms(x.device), pdl_enabled(x.device), M),
                         block_n=block_n, block_k=block_k, split_k=split_k,
                         num_warps=num_warps, num_stages=num_stages)
    if isinstance(x, SplitSoftmax) and config.block_k % x.acc.shape[-1]:
        x = x.merge().flatten(1, -1)  # tiles are not whole heads
    if M == 0:
        return torch.empty(M, N, dtype=x.dtype, device=x.device)
    k_per_split, splits = _k_splits(K, config)
    deferred = defer_sum and splits > 1 and bias is None
    y = None if deferred else torch.empty(M, N, dtype=x.dtype, device=x.device)
    out = y if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    _launch(x, weight, bias, out, N, config, k_per_split, splits, gated=False)
    if deferred:
        return SplitKSum(out, x.dtype)
    if splits > 1:
        reduce_splits(out, bias, y)
    return y


def gated_launch_config(N: int, K: int, sms: int, rows: int = 1,
                        smem: int = HOPPER_SHARED_MEMORY) -> LaunchConfig:
    """skinny_swiglu's tiles: K unsplit (the activation needs whole sums), 64 down to 16 weight rows
    a program until the programs cover the SMs, 256-wide K tiles, 2 warps, and 4 stages or fewer:
    Triton's pipeline holds stages - 1 of them in `smem` bytes (docs/kernels.md)."""
    block_n = 64
    while block_n > 16 and triton.cdiv(N, block_n) < sms:
        block_n //= 2
    block_k = min(256, max(16, triton.next_power_of_2(K)))
    stage = (2 * block_n + _block_m(rows)) * block_k * 2  # the gate, up and x tiles
    num_stages = 4
    while num_stages > 2 and (num_stages - 1) * stage > smem:
        num_stages -= 1
    return LaunchConfig(block_n, block_k, 1, num_warps=2, num_stages=num_stages)


def _block_m(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


def skinny_swiglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  defer: bool = False, block_n: int | None = None, block_k: int | None = None,
                  num_warps: int | None = None,
                  num_stages: int | None = None) -> "torch.Tensor | SwiGLUSplitKSum":
    """silu(gate) * up [M, N] of [gate | up] = F.linear(x, weight [2N, K], bias) in one kernel;
    with defer (few rows, no bias) a SwiGLUSplitKSum, activated as down_proj loads it."""
    M, K = x.shape
    if defer and bias is None and 0 < M <= DEFERRED_ACTIVATION_MAX_ROWS:
        config = launch_config(weight.shape[0], K, num_sms(x.device), pdl_enabled(x.device), M)
        if _k_splits(K, config)[1] > 1:
            return SwiGLUSplitKSum(skinny_linear(x, weight, defer_sum=True))
    N = weight.shape[0] // 2
    _check_operands(x, weight, bias, 2 * N)
    config = gated_launch_config(N, K, num_sms(x.device), M, shared_memory(x.device))
    config = _overridden(config, block_n=block_n, block_k=block_k, num_warps=num_warps,
                         num_stages=num_stages)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        k_per_split = triton.cdiv(K, config.block_k) * config.block_k
        _launch(x, weight, bias, y, N, config, k_per_split, 1, gated=True)
    return y


def _check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int):
    M, K = x.shape
    assert M <= SKINNY_MAX_ROWS and x.dtype in (torch.float16, torch.bfloat16)
    assert isinstance(x, (SplitSoftmax, SwiGLUSplitKSum)) or x.stride(1) == 1
    assert weight.shape == (rows, K) and weight.dtype == x.dtype and weight.is_contiguous()
    assert bias is None or (bias.shape == (rows,) and bias.is_contiguous())


def _k_splits(K: int, config: LaunchConfig) -> tuple[int, int]:
    """(K per split, splits): whole K tiles a split; splits left with no tile are dropped."""
    k_per_split = triton.cdiv(triton.cdiv(K, config.split_k), config.block_k) * config.block_k
    return k_per_split, triton.cdiv(K, k_per_split)


def _overridden(config: LaunchConfig, **overrides) -> LaunchConfig:
    return dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})


def _x_operand(x) -> tuple:
    if isinstance(x, SplitSoftmax):
        _, heads, splits, head_dim = x.acc.shape
        return x.acc, 0, x.m, x.l, splits, heads, 0, head_dim
    if isinstance(x, SwiGLUSplitKSum):
        parts = x.y.parts
        return parts, parts.stride(1), parts, parts, parts.shape[0], 0, parts.stride(0), 0
    return x, x.stride(0), x, x, 0, 0, 0, 0


def _launch(x, weight, bias, out, N: int, config: LaunchConfig, k_per_split: int, splits: int,
            gated: bool):
    M, K = x.shape
    pdl = pdl_enabled(x.device)
    x_data, stride_xm, x_max, x_sum, x_splits, heads, split_stride, head_dim = _x_operand(x)
    prefetch_lines = min(PREFETCH_MAX_LINES, triton.next_power_of_2(triton.cdiv(k_per_split, 64)))
    _skinny_kernel[(triton.cdiv(N, config.block_n), splits)](
        x_data, weight, bias if bias is not None else weight, out, M, N, K, stride_xm, N,
        k_per_split, x_max, x_sum, heads, split_stride, HAS_BIAS=bias is not None,
        EVEN_K=K % config.block_k == 0, BLOCK_M=_block_m(M),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=splits, PDL=pdl,
        PREFETCH_LINES=prefetch_lines, GATED=gated, num_warps=config.num_warps,
        num_stages=config.num_stages, launch_pdl=pdl, X_SPLITS=x_splits, X_HEAD_DIM=head_dim,
        X_GATED=isinstance(x, SwiGLUSplitKSum), X_ROWS=triton.next_power_of_2(M) if x_splits else 0,
    )
