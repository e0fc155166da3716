"""Skinny GEMM: y = x @ weight.T + bias for a few rows of x (decode), in Triton.

With at most SKINNY_MAX_ROWS rows the product is bound by reading the weight once, so the kernel is laid out
for weight bandwidth: each program streams a [BLOCK_N, K] slice of the weight in [BLOCK_N, BLOCK_K] tiles
and multiplies each tile with all rows of x (padded to 16, the smallest tl.dot width, or to 32). The weight
is the dot's left operand (y.T = weight @ x.T): its BLOCK_N rows fill the MMA's M side (64 per Hopper
wgmma) and the padded rows of x the narrow N side, instead of 48 of 64 MMA rows being padding.
When N / BLOCK_N gives too few programs to keep every SM streaming, K is split across SPLIT_K
programs too; they write float32 partials that a second small kernel sums (deterministic, unlike
atomics). Nothing depends on tensor values, so the launch is CUDA-graph safe.

A kernel that reads y anyway (RMSNorm, the q/k norm + RoPE) can sum the partials itself as
it loads y (`defer_sum=True` gives it a `SplitKSum`; it loads with `load_split_sum`), which takes the
summing kernel out of the decode chain (four a layer: −0.05 ms a token of single-stream decode on the
H200, BENCHMARKS.md).

The other way round, x may be decode attention's partials over split contexts, not yet merged (a SplitSoftmax):
the kernel merges each tile of them as it loads it, which takes the merge kernel out of a batch-1 decode step
(o_proj; single stream +2% on the H200, BENCHMARKS.md, twenty-sixth session).

SwiGLU's gate/up projection goes further (skinny_swiglu): a program multiplies a gate tile and the
matching up tile, K unsplit, and writes silu(gate) * up, so the activation needs no kernel of its own. For a
few rows the activation moves instead into down_proj's loads of x: gate/up is then an ordinary split-K GEMM of
one tile a program (SwiGLUSplitKSum), which with PDL loads its whole weight slice before its wait, where the
gated kernel's programs loop over K (H200 single stream +9%, 4 streams +6.5%: BENCHMARKS.md, twenty-sixth
session).

At decode sizes a kernel's launch and its first weight reads take as long as the rest of it. With
programmatic dependent launch (utils.device.pdl_enabled) the kernel starts while the one before it
(norm, activation, attention) still runs: each program asks L2 for the start of its weight slice,
which no earlier kernel writes, loads its first weight tile into registers, and only then waits for
that kernel's output, x (the load into registers: single stream +6% on the H200, BENCHMARKS.md).
Where the splits are narrow, K is split further until each program's slice is one tile of
ONE_TILE_K: the whole slice then loads before the wait, and after it the program makes one round
trip (x), not one a tile.
"""

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.split_softmax import SplitSoftmax, load_merged_tile
from nanovllm.kernels.device import num_sms, pdl_enabled, prefetch_to_l2
from nanovllm.kernels.gemm.split_k import SplitKSum, SwiGLUSplitKSum, reduce_splits, sum_splits

# Up to this many rows the decode linears are skinny GEMMs (and attention.decodes_from_qkv), above it cuBLAS's.
# H200, 32 streams of fp8 decode: 678-679 tok/s per stream at 32, 541-542 at 16 (BENCHMARKS.md, thirty-third
# session); at 64 rows the skinny GEMM, then tiled over M, was slower than cuBLAS (seventeenth), and the whole skinny
# path at 64 rows matched it (64 streams 409 against 406; 32-wide weight tiles above 16 rows lost 7% at 32 rows and
# 4% at 64: thirty-fourth).
SKINNY_MAX_ROWS = 32
# With PDL, lines of 64 16-bit weights (128 bytes) each weight row of a program prefetches into L2 before
# waiting for the kernel before: 16 lines of 64 rows are 128 KiB per program, 8 prefetches per thread.
PREFETCH_MAX_LINES = 16
# With PDL, a split of K at most twice this wide becomes splits of exactly this width (a [64, 256] weight tile,
# 32 KiB in 16 bits: 16 loads a thread at 4 warps), each program's whole slice loaded before its wait.
ONE_TILE_K = 256
# skinny_swiglu(defer=True) leaves the activation to down_proj's loads of x up to this many rows (the decode graphs
# of batches 1 to 8). H200: single stream 1,517-1,540 against 1,397-1,398 tok/s, 4 streams 1,231 against 1,156
# (twenty-sixth session); 8 streams 1,075-1,076 against 1,019-1,021, down_proj's tiles at 8 rows then 256 wide
# (twenty-seventh; 1,028-1,034 with the 512-wide ones: launch_config says why).
DEFERRED_ACTIVATION_MAX_ROWS = 8
# ... and from more rows than that, where the fused gate/up + SiLU kernel runs before down_proj, one-tile splits that
# would leave more partials than MAX_ONE_TILE_PARTIALS take tiles twice as wide (launch_config).
WIDE_TILE_MIN_ROWS = DEFERRED_ACTIVATION_MAX_ROWS + 1
MAX_ONE_TILE_PARTIALS = 8


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@functools.cache  # a pure function of its arguments, asked for at every eager call (twice by skinny_swiglu's defer)
def launch_config(N: int, K: int, sms: int, pdl: bool = False, rows: int = 1) -> LaunchConfig:
    """Default tiles for x [M, K] @ weight [N, K].T: 64 x 128 weight tiles (16 KiB in 16 bits), and
    K split (by powers of two, at most 8, each split keeping >= 2 K tiles) until there are about
    two programs per SM. The H200 sweep (scripts/bench_gemm.py --sweep, BENCHMARKS.md) found the best
    configs within ~10% of these and no dependence on the number of rows. With PDL (`pdl`) the kernel
    loads its first tile before its pipelined loop, which then does better with 3 stages than with 4
    (H200: single stream +2%, BENCHMARKS.md); and where that leaves each split at most 2 * ONE_TILE_K of
    K (K a multiple of ONE_TILE_K), K is split into ONE_TILE_K-wide tiles, one a program, loaded whole
    before the wait (no pipelined loop runs: one stage). At Qwen3-0.6B's shapes: qkv 4 splits, o 8, down
    12 instead of 8 splits of 384 (so down's sums, in another order, differ in their last bits with and
    without PDL); H200 single stream +6%, 8 streams +5% (BENCHMARKS.md, twenty-fifth session). From
    WIDE_TILE_MIN_ROWS `rows` of x, where that would leave more than MAX_ONE_TILE_PARTIALS partials for the
    kernel that sums them, the tiles are 2 * ONE_TILE_K wide at 8 warps instead (down_proj: 6 splits of 512):
    H200, 8 streams +2.3% after the fused SwiGLU kernel, while at batch 1 they were 4.6% slower (twenty-fifth and
    twenty-sixth sessions). After the one-tile gate/up GEMM (up to DEFERRED_ACTIVATION_MAX_ROWS rows) they were 4%
    slower at 8 streams (twenty-seventh): a 512-wide program activating 8 rows (216 registers a thread at 8 warps, 80
    KiB of shared memory) fits on no SM beside gate/up's programs (128 registers at 4 warps, about three an SM), so
    it starts, and loads its weights, only after they end; the 256-wide one (220 at 4 warps) fits beside two."""
    block_n, block_k = 64, min(128, max(16, triton.next_power_of_2(K)))
    tiles_n = triton.cdiv(N, block_n)
    split_k = 1
    while tiles_n * split_k < 2 * sms and split_k < 8 and K >= 4 * split_k * block_k:
        split_k *= 2
    if pdl and K % ONE_TILE_K == 0 and K <= 2 * ONE_TILE_K * split_k:
        one_tile_splits = K // ONE_TILE_K
        if rows >= WIDE_TILE_MIN_ROWS and one_tile_splits > MAX_ONE_TILE_PARTIALS and one_tile_splits % 2 == 0:
            return LaunchConfig(block_n, 2 * ONE_TILE_K, one_tile_splits // 2, num_warps=8, num_stages=1)
        return LaunchConfig(block_n, ONE_TILE_K, one_tile_splits, num_warps=4, num_stages=1)
    return LaunchConfig(block_n, block_k, split_k, num_warps=4, num_stages=3 if pdl else 4)


@triton.jit
def silu_and_mul_as_torch(gate, up, dtype: tl.constexpr):
    """silu(gate) * up of float32 gate and up, rounded to dtype as torch rounds each op's result: gate and up
    first, silu(gate), then the product."""
    g = gate.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (silu * up.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _load_tile(ptrs, k, row_mask, offs_k, K, EVEN_K: tl.constexpr):
    """The tile at ptrs + k, masked by row_mask [rows, 1] and, unless EVEN_K, by k + offs_k < K (zeros past K:
    the last tile is ragged). With EVEN_K the mask is the rows' only, so the loads stay vectorized along K."""
    if EVEN_K:
        tile = tl.load(ptrs + k, mask=row_mask, other=0.0)
    else:
        tile = tl.load(ptrs + k, mask=row_mask & (k + offs_k < K)[None, :], other=0.0)
    return tile


@triton.jit
def _load_activated_tile(parts_ptr, M, k, K, stride_xm, split_stride, SPLITS: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """x[:ROWS, k:k + BLOCK_K] of a SwiGLUSplitKSum's x = silu(gate) * up [M, K], from the partials at parts_ptr
    (row stride stride_xm, split stride split_stride; the up half K columns after the gate), rounded as
    silu_and_mul of their SplitKSum rounds it; 0 in rows >= M and past K."""
    rows = tl.arange(0, ROWS)
    cols = k + tl.arange(0, BLOCK_K)
    offs = rows[:, None] * stride_xm + cols[None, :]
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    gate = sum_splits(parts_ptr, offs, mask, split_stride, SPLITS)
    up = sum_splits(parts_ptr + K, offs, mask, split_stride, SPLITS)
    return silu_and_mul_as_torch(gate, up, dtype)


@triton.jit
def _load_x(x_ptrs, k, m_mask, offs_k, K, EVEN_K: tl.constexpr, x_ptr, stride_xm, x_max_ptr, x_sum_ptr, M, x_heads,
            x_split_stride, X_SPLITS: tl.constexpr, X_HEAD_DIM: tl.constexpr, X_GATED: tl.constexpr,
            X_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """x's tile [BLOCK_M, BLOCK_K] at k (_skinny_kernel): loaded (X_SPLITS 0), or computed in dtype from partials:
    activated from a SwiGLUSplitKSum's (X_GATED), else merged from a SplitSoftmax's. Only X_ROWS rows are computed,
    then broadcast to the MMA's BLOCK_M: computing its padding rows too took 16x the instructions of one row at
    M = 1 (o_proj's merge: 5,000 a thread and a spill, in sm_90 SASS)."""
    if X_SPLITS == 0:
        x = _load_tile(x_ptrs, k, m_mask[:, None], offs_k, K, EVEN_K)
    else:
        if X_GATED:
            tile = _load_activated_tile(x_ptr, M, k, K, stride_xm, x_split_stride, X_SPLITS, X_ROWS, BLOCK_K, dtype)
        else:
            tile = load_merged_tile(x_ptr, x_max_ptr, x_sum_ptr, M, k, x_heads, X_HEAD_DIM, X_SPLITS, X_ROWS,
                                    BLOCK_K, dtype)
        # Rows X_ROWS.. repeat the first X_ROWS (a broadcast), and rows >= M are zeroed.
        tiled = tl.broadcast_to(tile[None, :, :], [BLOCK_M // X_ROWS, X_ROWS, BLOCK_K])
        x = tl.where(m_mask[:, None], tl.reshape(tiled, [BLOCK_M, BLOCK_K]), 0.0)
    return x


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_om, k_per_split, x_max_ptr, x_sum_ptr,
                   x_heads, x_split_stride, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, GATED: tl.constexpr = False,
                   X_SPLITS: tl.constexpr = 0, X_HEAD_DIM: tl.constexpr = 0, X_GATED: tl.constexpr = False,
                   X_ROWS: tl.constexpr = 0):
    """Grid (cdiv(N, BLOCK_N), SPLIT_K): output features n of all rows, over one split of K.

    X_SPLITS > 0: x is computed from X_SPLITS partials as its tiles load, X_ROWS rows of them (M <= X_ROWS). X_GATED:
    a SwiGLUSplitKSum, its partials [X_SPLITS, M, 2K] at x_ptr (row stride stride_xm, split stride x_split_stride).
    Else a SplitSoftmax of x_heads heads of X_HEAD_DIM, its acc at x_ptr, m and l at x_max_ptr and x_sum_ptr
    (BLOCK_K a multiple of X_HEAD_DIM).

    SPLIT_K == 1: out is y [M, N] (stride_om), bias added. Else out is float32 partials
    [SPLIT_K, M, N], contiguous, reduced by _split_k_reduce_kernel.
    GATED (SPLIT_K 1): the weight [2N, K] holds the gate rows, then the up rows (bias [2N] likewise); a
    program takes both halves' rows n, and out is silu(gate) * up [M, N], rounded as SiLU-and-mul does."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    k_start = pid_k * k_per_split  # k_per_split is a multiple of BLOCK_K: tiles never straddle splits
    k_end = tl.minimum(k_start + k_per_split, K)
    # GATED: rows n of the up half. Built either way (Triton's loop wants them in scope); unused, compiled away.
    w_up_ptrs = w_ptr + (offs_n.to(tl.int64) + N)[:, None] * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    loop_start = k_start
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        # No earlier kernel writes the weight: fetch the start of this program's slice (up to PREFETCH_LINES
        # lines of each row) into L2, and load its first tile (every split has one), while the kernel before
        # finishes; then wait for x.
        line_k = tl.minimum(k_start + tl.arange(0, PREFETCH_LINES) * 64, k_end - 1)
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        prefetch_to_l2(w_ptr + rows[:, None] * K + line_k[None, :])
        if GATED:
            prefetch_to_l2(w_ptr + (rows + N)[:, None] * K + line_k[None, :])
        w = _load_tile(w_ptrs, k_start, n_mask[:, None], offs_k, K, EVEN_K)
        if GATED:
            w_up = _load_tile(w_up_ptrs, k_start, n_mask[:, None], offs_k, K, EVEN_K)
        tl.extra.cuda.gdc_wait()
        x = tl.trans(_load_x(x_ptrs, k_start, m_mask, offs_k, K, EVEN_K, x_ptr, stride_xm, x_max_ptr, x_sum_ptr, M,
                             x_heads, x_split_stride, X_SPLITS, X_HEAD_DIM, X_GATED, X_ROWS, BLOCK_M, BLOCK_K,
                             w_ptr.dtype.element_ty))
        acc = tl.dot(w, x, acc)  # [BLOCK_N, BLOCK_M] = y.T tile
        if GATED:
            acc_up = tl.dot(w_up, x, acc_up)
        loop_start += BLOCK_K
    for k in range(loop_start, k_end, BLOCK_K):
        x = tl.trans(_load_x(x_ptrs, k, m_mask, offs_k, K, EVEN_K, x_ptr, stride_xm, x_max_ptr, x_sum_ptr, M,
                             x_heads, x_split_stride, X_SPLITS, X_HEAD_DIM, X_GATED, X_ROWS, BLOCK_M, BLOCK_K,
                             w_ptr.dtype.element_ty))
        acc = tl.dot(_load_tile(w_ptrs, k, n_mask[:, None], offs_k, K, EVEN_K), x, acc)
        if GATED:
            acc_up = tl.dot(_load_tile(w_up_ptrs, k, n_mask[:, None], offs_k, K, EVEN_K), x, acc_up)

    out_mask = n_mask[:, None] & m_mask[None, :]
    if GATED:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            acc_up += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], silu_and_mul_as_torch(acc, acc_up, dtype),
                 mask=out_mask)
    elif SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=out_mask)
    else:
        part = out_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(part, acc, mask=out_mask)


def skinny_linear(x: "torch.Tensor | SplitSoftmax | SwiGLUSplitKSum", weight: torch.Tensor,
                  bias: torch.Tensor | None = None, *,
                  defer_sum: bool = False, block_n: int | None = None, block_k: int | None = None,
                  split_k: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None) -> "torch.Tensor | SplitKSum":
    """F.linear(x, weight, bias) for x [M <= SKINNY_MAX_ROWS, K] with float32 accumulation.

    x: 16-bit, last dim contiguous (rows may be strided); or decode attention's SplitSoftmax, merged as its tiles
    load (where they are whole heads; else first); or a SwiGLUSplitKSum, summed and activated as its tiles load.
    weight [N, K] contiguous, x's dtype; bias: [N] or None.
    Returns y [M, N] in x.dtype; with defer_sum, no bias and K split, y's SplitKSum instead. Keyword arguments
    override launch_config.
    """
    M, K = x.shape
    N = weight.shape[0]
    _check_operands(x, weight, bias, N)
    config = _overridden(launch_config(N, K, num_sms(x.device), pdl_enabled(x.device), M), block_n=block_n,
                         block_k=block_k, split_k=split_k, num_warps=num_warps, num_stages=num_stages)
    if isinstance(x, SplitSoftmax) and config.block_k % x.acc.shape[-1]:
        x = x.merge().flatten(1, -1)
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


def gated_launch_config(N: int, K: int, sms: int) -> LaunchConfig:
    """skinny_swiglu's tiles for N output features: K is not split (the activation needs whole sums), so the
    weight rows per program (each half's) go from 64 down to 16 until the programs cover the SMs, and K
    tiles are 256 wide, two warps a program. H200, Qwen3-0.6B's MLP (scripts/bench_gemm.py --swiglu): 16/256
    with 2 warps 12.4 us a layer at M = 1 against 12.8 for gate_up + SiLU-and-mul; 16/128 with 4 warps 20.5."""
    block_n = 64
    while block_n > 16 and triton.cdiv(N, block_n) < sms:
        block_n //= 2
    return LaunchConfig(block_n, min(256, max(16, triton.next_power_of_2(K))), 1, num_warps=2, num_stages=4)


def skinny_swiglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  defer: bool = False, block_n: int | None = None, block_k: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None) -> "torch.Tensor | SwiGLUSplitKSum":
    """SwiGLU's projection and activation in one kernel: silu(gate) * up [M, N] of y = F.linear(x, weight,
    bias), whose first N features are the gate and the last N the up projection (weight [2N, K], bias [2N]
    or None), each value rounded as silu_and_mul(y) rounds it. x as for skinny_linear. It replaces the gate/up
    GEMM, whose split-K partials the SiLU-and-mul kernel summed, and that kernel: one kernel fewer a layer in
    decode.

    defer, no bias and at most DEFERRED_ACTIVATION_MAX_ROWS rows: the projection's split-K partials instead (a
    SwiGLUSplitKSum, by skinny_linear's launch configuration, one tile a program with PDL), which the skinny GEMM
    that reads them (down_proj) sums and activates as it loads them."""
    M, K = x.shape
    if defer and bias is None and 0 < M <= DEFERRED_ACTIVATION_MAX_ROWS:
        config = launch_config(weight.shape[0], K, num_sms(x.device), pdl_enabled(x.device), M)
        if _k_splits(K, config)[1] > 1:
            return SwiGLUSplitKSum(skinny_linear(x, weight, defer_sum=True))
    N = weight.shape[0] // 2
    _check_operands(x, weight, bias, 2 * N)
    config = _overridden(gated_launch_config(N, K, num_sms(x.device)), block_n=block_n, block_k=block_k,
                         num_warps=num_warps, num_stages=num_stages)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        _launch(x, weight, bias, y, N, config, triton.cdiv(K, config.block_k) * config.block_k, 1, gated=True)
    return y


def _check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int):
    """x [M <= SKINNY_MAX_ROWS, K] 16-bit, last dim contiguous (or a SplitSoftmax); weight [rows, K] contiguous in
    x's dtype; bias [rows] or None."""
    M, K = x.shape
    assert M <= SKINNY_MAX_ROWS and x.dtype in (torch.float16, torch.bfloat16)
    assert isinstance(x, (SplitSoftmax, SwiGLUSplitKSum)) or x.stride(1) == 1
    assert weight.shape == (rows, K) and weight.dtype == x.dtype and weight.is_contiguous()
    assert bias is None or (bias.shape == (rows,) and bias.is_contiguous())


def _k_splits(K: int, config: LaunchConfig) -> tuple[int, int]:
    """(K per split, splits) of config: whole K tiles per split; splits left with no tile are dropped."""
    k_per_split = triton.cdiv(triton.cdiv(K, config.split_k), config.block_k) * config.block_k
    return k_per_split, triton.cdiv(K, k_per_split)


def _overridden(config: LaunchConfig, **overrides) -> LaunchConfig:
    """config with the overrides that are not None."""
    return dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})


def _launch(x, weight, bias, out, N: int, config: LaunchConfig, k_per_split: int, splits: int, gated: bool):
    """_skinny_kernel over N output features (gated: of each half of the weight) into out."""
    M, K = x.shape
    pdl = pdl_enabled(x.device)
    heads, split_stride, head_dim = 0, 0, 0  # unused unless x is a SplitSoftmax or SwiGLUSplitKSum
    if isinstance(x, SplitSoftmax):
        _, heads, x_splits, head_dim = x.acc.shape
        x_data, stride_xm, x_max, x_sum = x.acc, 0, x.m, x.l
    elif isinstance(x, SwiGLUSplitKSum):
        x_data, x_splits = x.y.parts, x.y.parts.shape[0]
        stride_xm, split_stride, x_max, x_sum = x_data.stride(1), x_data.stride(0), x_data, x_data
    else:
        x_data, stride_xm, x_max, x_sum, x_splits = x, x.stride(0), x, x, 0
    _skinny_kernel[(triton.cdiv(N, config.block_n), splits)](
        x_data, weight, bias if bias is not None else weight, out, M, N, K, stride_xm, N, k_per_split, x_max, x_sum,
        heads, split_stride, HAS_BIAS=bias is not None, EVEN_K=K % config.block_k == 0,
        BLOCK_M=max(16, triton.next_power_of_2(M)),  # x's rows, padded to an MMA's N side
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=splits,
        PDL=pdl, PREFETCH_LINES=min(PREFETCH_MAX_LINES, triton.next_power_of_2(triton.cdiv(k_per_split, 64))),
        GATED=gated, num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
        X_SPLITS=x_splits, X_HEAD_DIM=head_dim, X_GATED=isinstance(x, SwiGLUSplitKSum),
        X_ROWS=triton.next_power_of_2(M) if x_splits else 0,
    )
