"""Tiled GEMM launched with programmatic dependent launch: y = x @ weight.T + bias for SKINNY_MAX_ROWS to
TILED_MAX_ROWS rows of x (decode batches of 33 to 256 sequences), in Triton.

At these sizes cuBLAS takes ~7 us a projection where its FLOPs need ~3 (BENCHMARKS.md, thirty-fourth to thirty-
seventh sessions), and it is not launched with PDL: it starts only once the norm before it has ended, and the
kernel after it only once it has. This kernel is: each program lets the next kernel launch at once, the first
row tile's program of each weight tile prefetches the weight slice into L2 (no kernel of the step writes it),
every program loads its first weight tile, and only then waits for x. Tiles are BLOCK_M x BLOCK_N of y, float32
accumulation, loaded and stored by TMA (tensor descriptors: no address arithmetic or masks in the loop; rows and
columns past the ends read zeros and are not written). K may be split into float32 partials that the next kernel
sums as it loads them (a SplitKSum, for a caller passing defer_sum: the q/k norm + RoPE after qkv_proj, the
norms after o_proj and down_proj).

H200, Qwen3-0.6B's four projections in a chain of the engine's kernels (28 layers of input norm -> qkv -> q/k norm
+ RoPE -> o -> post-attention norm -> gate_up -> SiLU -> down, attention left out; scripts/bench_tiled_gemm.py,
BENCHMARKS.md, thirty-eighth session): 26.3 us a layer against cuBLAS's 34.9 at 64 rows, 30.0 against 36.6 at
128, 39.4 against 40.9 at 256; without PDL the same tiles were 33.2, 36.2 and 44.4. So it runs only with PDL,
and only on Hopper (sm_90), where tile_config's tiles were measured. TMA loads instead of pointer loads (same
tiles, fortieth session): 26.25 against 27.53 us a layer at 64 rows, 28.59 against 30.97 at 128, 36.29 against
40.53 at 256.
"""

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.device import num_sms, pdl_enabled, prefetch_to_l2
from nanovllm.kernels.gemm.skinny import SKINNY_MAX_ROWS
from nanovllm.kernels.gemm.split_k import SplitKSum

TILED_MAX_ROWS = 256
MAX_SPLIT_K = 4
# Shared memory the pipelined x and weight tiles may take (the layout conversions need some of the rest).
STAGES_SMEM_BYTES = 160 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def config_for_tiles(block_m: int, block_n: int, block_k: int, split_k: int = 1) -> TileConfig:
    """The TileConfig of those tiles: 8 warps for 128 x 128 tiles, else 4; up to 4 pipeline stages, as many as
    STAGES_SMEM_BYTES holds (at least 2)."""
    stages = max(2, min(4, STAGES_SMEM_BYTES // ((block_m + block_n) * block_k * 2)))
    return TileConfig(block_m, block_n, block_k, split_k, num_warps=8 if block_m == block_n == 128 else 4,
                      num_stages=stages)


@functools.cache  # a pure function of its arguments, asked for at every eager call
def tile_config(M: int, N: int, K: int, sms: int, splittable: bool) -> TileConfig:
    """Tiles for x [M, K] @ weight [N, K].T, K a multiple of 64: 64 x 64 tiles of y, 128 wide along K; while there
    are more programs than SMs, 128 columns a tile, then 128 rows (then 64 along K: 128 x 128 x 128 tiles were
    18.6 us against 15.1 for gate_up at 256 rows). With `splittable`, K is split in two, then four, while the
    programs still fit on the SMs and each split keeps two K tiles. At Qwen3-0.6B's shapes on an H200 this
    gives the tiles the chain search of scripts/bench_tiled_gemm.py picked at 64 and 128 rows, and at 256 the
    same number of programs (its picks there, 128 x 64 for qkv and 64 x 128 x 128 split in four for down,
    were within its noise of these)."""
    block_m, block_n = 64, 64

    def programs(split_k=1):
        return triton.cdiv(M, block_m) * triton.cdiv(N, block_n) * split_k

    while programs() > sms and block_m < 128:
        if block_n < 128:
            block_n = 128
        else:
            block_m = 128
    block_k = 64 if block_m == block_n == 128 or K % 128 else 128
    split_k = 1
    while (splittable and split_k < MAX_SPLIT_K and programs(2 * split_k) <= sms
           and K % (block_k * 2 * split_k) == 0 and K // (2 * split_k) >= 2 * block_k):
        split_k *= 2
    return config_for_tiles(block_m, block_n, block_k, split_k)


def tiled_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the tiled GEMM takes x @ weight.T: x [SKINNY_MAX_ROWS < M <= TILED_MAX_ROWS, K] 16-bit rows on a
    Hopper GPU with PDL on, last dim contiguous, rows 16-byte aligned (TMA); weight [N, K] contiguous in x's dtype,
    K a multiple of 64."""
    return (x.is_cuda and x.dim() == 2 and SKINNY_MAX_ROWS < x.shape[0] <= TILED_MAX_ROWS and x.stride(1) == 1
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and weight.is_contiguous()
            and x.shape[1] % 64 == 0 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and pdl_enabled(x.device) and _is_hopper(x.device))


@functools.cache
def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


# M unspecialized (TMA masks the rows past it): an eager prefill of any size reuses the decode graphs' compilations,
# where an M not a multiple of 16 would compile each tile configuration again on first use.
@triton.jit(do_not_specialize=["M"])
def _tiled_kernel(x_desc, w_desc, w_ptr, b_ptr, out_desc, M, N, K, k_per_split, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                  PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), SPLIT_K). x [M, K] and weight [N, K] (w_ptr its data, for the
    prefetch) are read, and out written, through tensor descriptors of BLOCK_M x BLOCK_K, BLOCK_N x BLOCK_K and
    BLOCK_M x BLOCK_N blocks. The programs of one weight tile are consecutive, so its other row tiles read it from
    L2. SPLIT_K 1: out is y [M, N] in x's dtype (+ bias); else float32 partials [SPLIT_K, M, N] (blocks
    1 x BLOCK_M x BLOCK_N, no bias). k_per_split is a multiple of BLOCK_K of at least one tile."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % tiles_m, pid // tiles_m
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    k_start = tl.program_id(1) * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    loop_start = k_start
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if pid_m == 0:  # PREFETCH_LINES lines of 64 16-bit weights a row, clamped to the split
            line_k = tl.minimum(k_start + tl.arange(0, PREFETCH_LINES) * 64, k_start + k_per_split - 1)
            rows = tl.minimum(off_n + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
            prefetch_to_l2(w_ptr + rows[:, None] * K + line_k[None, :])
        w = w_desc.load([off_n, k_start])
        tl.extra.cuda.gdc_wait()  # x is the kernel before's output
        acc = tl.dot(x_desc.load([off_m, k_start]), tl.trans(w), acc)
        loop_start += BLOCK_K
    for k in range(loop_start, k_start + k_per_split, BLOCK_K):
        acc = tl.dot(x_desc.load([off_m, k]), tl.trans(w_desc.load([off_n, k])), acc)
    if SPLIT_K == 1:
        if HAS_BIAS:
            offs_n = off_n + tl.arange(0, BLOCK_N)
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))
    else:
        out_desc.store([tl.program_id(1), off_m, off_n], acc.reshape([1, BLOCK_M, BLOCK_N]))


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 defer_sum: bool = False, config: TileConfig | None = None) -> torch.Tensor | SplitKSum:
    """F.linear(x, weight, bias) for x [M, K] 16-bit (last dim contiguous), weight [N, K] contiguous in x's dtype,
    K a multiple of 64, bias [N] or None, with float32 accumulation: y [M, N] in x's dtype; with defer_sum and no
    bias, K may be split and y's SplitKSum returned instead. config (tile_config's by default) may override the
    tiles; its K splits must each hold a whole number of BLOCK_K tiles."""
    M, K = x.shape
    N = weight.shape[0]
    if config is None:
        config = tile_config(M, N, K, num_sms(x.device), splittable=defer_sum and bias is None)
    k_per_split = K // config.split_k
    if K % (config.block_k * config.split_k) or (config.split_k > 1 and bias is not None):
        raise ValueError(f"{config} does not split K={K} into whole {config.block_k}-wide tiles without a bias")
    if config.split_k == 1:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(config.split_k, M, N, dtype=torch.float32, device=x.device)
    if M:
        pdl = pdl_enabled(x.device)
        block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
        out_block = [block_m, block_n] if config.split_k == 1 else [1, block_m, block_n]
        _tiled_kernel[(triton.cdiv(M, block_m) * triton.cdiv(N, block_n), config.split_k)](
            TensorDescriptor.from_tensor(x, [block_m, block_k]),
            TensorDescriptor.from_tensor(weight, [block_n, block_k]), weight, bias if bias is not None else weight,
            TensorDescriptor.from_tensor(out, out_block), M, N, K, k_per_split, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=config.split_k, PDL=pdl,
            PREFETCH_LINES=triton.next_power_of_2(triton.cdiv(k_per_split, 64)), num_warps=config.num_warps,
            num_stages=config.num_stages, launch_pdl=pdl)
    return out if config.split_k == 1 else SplitKSum(out, x.dtype)
