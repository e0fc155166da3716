"""Tiled GEMM for decode batches of SKINNY_MAX_ROWS to TILED_MAX_ROWS rows: y = x @ weight.T + bias.

Hopper and PDL only: operands go through TMA descriptors; a program loads its first weight tile,
then waits for x. Tiles from tile_config; with defer_sum K may be split (a SplitKSum)."""

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
# Shared memory for the pipeline stages; the layout conversions need some of the rest.
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
    """8 warps for 128 x 128 tiles, else 4; 2 to 4 stages, as many as STAGES_SMEM_BYTES holds."""
    stages = max(2, min(4, STAGES_SMEM_BYTES // ((block_m + block_n) * block_k * 2)))
    warps = 8 if block_m == block_n == 128 else 4
    return TileConfig(block_m, block_n, block_k, split_k, num_warps=warps, num_stages=stages)


@functools.cache
def tile_config(M: int, N: int, K: int, sms: int, splittable: bool) -> TileConfig:
    """Tiles for x [M, K] @ weight [N, K].T: 64 x 64 x 128, widened to 128 columns, then 128 rows,
    while programs outnumber SMs; K split (splittable) while they fit (docs/kernels.md)."""
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
    """Whether the tiled GEMM takes x [M, K] @ weight [N, K].T; TMA needs 16-byte aligned rows."""
    return (x.is_cuda and x.dim() == 2 and SKINNY_MAX_ROWS < x.shape[0] <= TILED_MAX_ROWS
            and x.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.is_contiguous() and x.shape[1] % 64 == 0
            and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and pdl_enabled(x.device) and _is_hopper(x.device))


@functools.cache
def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


# M unspecialized (TMA masks rows past it), so any M reuses the decode graphs' compilations.
@triton.jit(do_not_specialize=["M"])
def _tiled_kernel(x_desc, w_desc, w_ptr, b_ptr, out_desc, M, N, K, k_per_split,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
                  PREFETCH_LINES: tl.constexpr):
    """Grid (tiles_m * tiles_n, SPLIT_K), a weight tile's row tiles consecutive (L2 reuse). out: y
    [M, N] (+ bias) if SPLIT_K == 1, else float32 partials [SPLIT_K, M, N]."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % tiles_m, pid // tiles_m
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    k_start = tl.program_id(1) * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    loop_start = k_start
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if pid_m == 0:
            k_last = k_start + k_per_split - 1
            line_k = tl.minimum(k_start + tl.arange(0, PREFETCH_LINES) * 64, k_last)
            rows = tl.minimum(off_n + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
            prefetch_to_l2(w_ptr + rows[:, None] * K + line_k[None, :])
        w = w_desc.load([off_n, k_start])
        tl.extra.cuda.gdc_wait()
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
                 defer_sum: bool = False,
                 config: TileConfig | None = None) -> torch.Tensor | SplitKSum:
    """F.linear(x [M, K], weight [N, K], bias [N] | None) -> y [M, N], or with defer_sum and no
    bias maybe y's SplitKSum. config overrides tile_config; its splits hold whole K tiles."""
    M, K = x.shape
    N = weight.shape[0]
    if config is None:
        config = tile_config(M, N, K, num_sms(x.device), splittable=defer_sum and bias is None)
    k_per_split = K // config.split_k
    if K % (config.block_k * config.split_k) or (config.split_k > 1 and bias is not None):
        raise ValueError(f"{config} does not split K={K} into whole {config.block_k}-wide tiles"
                         " without a bias")
    if config.split_k == 1:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(config.split_k, M, N, dtype=torch.float32, device=x.device)
    if M:
        _launch(x, weight, bias, out, config, k_per_split)
    return out if config.split_k == 1 else SplitKSum(out, x.dtype)


def _launch(x, weight, bias, out, config: TileConfig, k_per_split: int):
    M, K = x.shape
    N = weight.shape[0]
    pdl = pdl_enabled(x.device)
    block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
    out_block = [block_m, block_n] if config.split_k == 1 else [1, block_m, block_n]
    _tiled_kernel[(triton.cdiv(M, block_m) * triton.cdiv(N, block_n), config.split_k)](
        TensorDescriptor.from_tensor(x, [block_m, block_k]),
        TensorDescriptor.from_tensor(weight, [block_n, block_k]), weight,
        bias if bias is not None else weight, TensorDescriptor.from_tensor(out, out_block),
        M, N, K, k_per_split, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=config.split_k, PDL=pdl,
        PREFETCH_LINES=triton.next_power_of_2(triton.cdiv(k_per_split, 64)),
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl)
