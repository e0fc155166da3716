"""Fused mixture-of-experts: the (token, expert) assignments grouped by expert, then two grouped
GEMMs over the groups. Everything stays on the device in buffers sized from T alone, so the decode
graphs capture it: no host sync, no data-dependent shape.

  align       assignment i = t * top_k + j (token t's j-th expert) sorted by expert into
              sorted_ids [max_padded]; each expert's run padded to a multiple of BLOCK_M with the
              sentinel T * top_k; expert_ids [max_padded / BLOCK_M] names each row block's expert
              (-1 past the used blocks); num_padded [1] is the used length
  gate/up     act[i] = silu(x[t] @ gate[e].T) * (x[t] @ up[e].T)                 [T * top_k, I]
  down        y[j, t] = weight[i] * (act[i] @ down[e].T)                         [top_k, T, H]
  sum         out[t] = sum_j y[j, t]                                               [T, H]

The sum is a second pass, not atomics; decode hands y on as split-K partials (SplitKSum) to
the next RMSNorm. Tiles and their reasons: docs/kernels.md."""

import dataclasses

import torch
import triton
import triton.language as tl

from nanovllm.kernels.gemm.skinny import silu_and_mul_as_torch
from nanovllm.kernels.gemm.split_k import SplitKSum

ALIGN_CHUNK = 1024
DEFER_MAX_ASSIGNMENTS = 4096  # float32 partials of at most this many rows go to the next kernel
DECODE_ROWS_PER_EXPERT = 4  # mean assignments per expert up to which the decode tiles apply
MID_ROWS_PER_EXPERT = 32  # ... the mid tiles apply


@dataclasses.dataclass(frozen=True, slots=True)
class MoeTiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


DECODE_TILES = MoeTiles(16, 64, 128, group_m=1, num_warps=4, num_stages=3)
MID_TILES = MoeTiles(32, 64, 128, group_m=4, num_warps=4, num_stages=3)
PREFILL_TILES = MoeTiles(64, 128, 64, group_m=8, num_warps=8, num_stages=3)


def moe_tiles(num_assignments: int, num_experts: int) -> MoeTiles:
    """Tiles by the mean rows an expert gets: 16-row blocks while few, 32 while some, else 64."""
    if num_assignments <= DECODE_ROWS_PER_EXPERT * num_experts:
        return DECODE_TILES
    if num_assignments <= MID_ROWS_PER_EXPERT * num_experts:
        return MID_TILES
    return PREFILL_TILES


def max_padded_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """An upper bound of the aligned length: each expert that has rows pads fewer than block_m."""
    padded = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    return triton.cdiv(padded, block_m) * block_m


@triton.jit(do_not_specialize=["num_assignments", "expert_offset", "max_padded"])
def _align_kernel(topk_ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, cursor_ptr,
                  num_assignments, num_experts, expert_offset, max_padded,
                  BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr,
                  SCATTER: tl.constexpr):
    """One program: count assignments per local expert, lay out the padded runs, expert_ids and
    the sentinel, each run's start in cursor; SCATTER (<= CHUNK assignments): the scatter too."""
    bins = tl.arange(0, BINS)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for start in range(0, num_assignments, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        valid = offs < num_assignments
        local = tl.load(topk_ids_ptr + offs, mask=valid, other=0).to(tl.int32) - expert_offset
        mine = valid & (local >= 0) & (local < num_experts)
        counts += tl.histogram(tl.where(mine, local, 0), BINS, mask=mine)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    tl.store(cursor_ptr + bins, ends - padded, mask=bins < num_experts)
    for start in range(0, max_padded // BLOCK_M, CHUNK // BLOCK_M):
        blocks = start + tl.arange(0, CHUNK // BLOCK_M)
        first_row = blocks * BLOCK_M
        # A block's expert: the number of runs that end at or before its first row.
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        expert = tl.where(first_row < total, expert, -1)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks < max_padded // BLOCK_M)
    for start in range(0, max_padded, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + offs, tl.full([CHUNK], 0, tl.int32) + num_assignments,
                 mask=offs < max_padded)
    if SCATTER:
        tl.debug_barrier()  # the cursor and sentinel stores land before the scatter's
        _scatter_chunk(topk_ids_ptr, sorted_ids_ptr, cursor_ptr, tl.arange(0, CHUNK),
                       num_assignments, num_experts, expert_offset)


@triton.jit
def _scatter_chunk(topk_ids_ptr, sorted_ids_ptr, cursor_ptr, offs, num_assignments, num_experts,
                   expert_offset):
    """Each local assignment of offs takes the next row of its run."""
    valid = offs < num_assignments
    local = tl.load(topk_ids_ptr + offs, mask=valid, other=0).to(tl.int32) - expert_offset
    mine = valid & (local >= 0) & (local < num_experts)
    row = tl.atomic_add(cursor_ptr + local, 1, mask=mine)
    tl.store(sorted_ids_ptr + row, offs, mask=mine)


@triton.jit(do_not_specialize=["num_assignments", "expert_offset"])
def _scatter_kernel(topk_ids_ptr, sorted_ids_ptr, cursor_ptr, num_assignments, num_experts,
                    expert_offset, CHUNK: tl.constexpr):
    """Grid (cdiv(num_assignments, CHUNK),): the scatter of more than CHUNK assignments."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    _scatter_chunk(topk_ids_ptr, sorted_ids_ptr, cursor_ptr, offs, num_assignments, num_experts,
                   expert_offset)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              expert_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] (global ids; local experts are [expert_offset, + num_experts)) ->
    (sorted_ids [max_padded] int32, expert_ids [max_padded / block_m] int32, num_padded [1])."""
    ids = topk_ids.reshape(-1)
    n = ids.numel()
    max_padded = max_padded_rows(n, num_experts, block_m)
    device = ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    bins = triton.next_power_of_2(num_experts)
    one_chunk = n <= ALIGN_CHUNK
    _align_kernel[(1,)](ids, sorted_ids, expert_ids, num_padded, cursor, n, num_experts,
                        expert_offset, max_padded, BLOCK_M=block_m, BINS=bins, CHUNK=ALIGN_CHUNK,
                        SCATTER=one_chunk, num_warps=4)
    if not one_chunk:
        _scatter_kernel[(triton.cdiv(n, ALIGN_CHUNK),)](ids, sorted_ids, cursor, n, num_experts,
                                                       expert_offset, CHUNK=ALIGN_CHUNK,
                                                       num_warps=4)
    return sorted_ids, expert_ids, num_padded


@triton.jit
def _load_k_tile(ptrs, k, mask, offs_k, K, K_AXIS: tl.constexpr, EVEN_K: tl.constexpr):
    """The tile at K offset k; EVEN_K: masked along the other axis only (vectorized loads)."""
    if EVEN_K:
        full_mask = mask
    elif K_AXIS == 1:
        full_mask = mask & (offs_k < K - k)[None, :]
    else:
        full_mask = mask & (offs_k < K - k)[:, None]
    return tl.load(ptrs + k, mask=full_mask, other=0.0)


@triton.jit(do_not_specialize=["num_assignments", "num_tokens"])
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                         weights_ptr, num_assignments, num_tokens, N, K, stride_am, stride_we,
                         stride_wn, stride_om, TOP_K: tl.constexpr, GATED: tl.constexpr,
                         EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Grid (max_padded / BLOCK_M * cdiv(N, BLOCK_N),). Row block b of expert e = expert_ids[b];
    for each assignment i = t * TOP_K + j in it:
      GATED (gate/up): out[i, :N] = silu(x[t] @ w[e, :N].T) * (x[t] @ w[e, N:].T)
      else (down):     out[j * num_tokens + t, :N] = weights[i] * (a[i] @ w[e].T), slot-major."""
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(N, BLOCK_N)
    blocks_m = tl.num_programs(0) // blocks_n
    # Grouped order: GROUP_M row blocks walk the columns together, sharing weight tiles in L2.
    group = pid // (GROUP_M * blocks_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * blocks_n)) % group_size
    pid_n = (pid % (GROUP_M * blocks_n)) // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = ids < num_assignments
    a_rows = (ids // TOP_K if GATED else ids).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = _load_k_tile(a_ptrs, k, row_mask[:, None], offs_k, K, 1, EVEN_K)
        acc = tl.dot(a, _load_k_tile(w_ptrs, k, n_mask[None, :], offs_k, K, 0, EVEN_K), acc)
        if GATED:
            up = _load_k_tile(w_ptrs + N * stride_wn, k, n_mask[None, :], offs_k, K, 0, EVEN_K)
            acc_up = tl.dot(a, up, acc_up)
    if GATED:
        out = silu_and_mul_as_torch(acc, acc_up, out_ptr.dtype.element_ty)
        out_rows = ids.to(tl.int64)
    else:
        weight = tl.load(weights_ptr + ids, mask=row_mask, other=0.0).to(tl.float32)
        # The expert's output rounded to the activations' dtype first, as torch rounds it.
        out = (acc.to(a_ptr.dtype.element_ty).to(tl.float32) * weight[:, None])
        out = out.to(out_ptr.dtype.element_ty)
        out_rows = (ids % TOP_K).to(tl.int64) * num_tokens + ids // TOP_K
    out_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out, mask=row_mask[:, None] & n_mask[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, align: tuple, T: int,
                  top_k: int, weights: torch.Tensor, gated: bool, tiles: MoeTiles):
    sorted_ids, expert_ids, num_padded = align
    N, K = out.shape[1], w.shape[2]
    grid = (expert_ids.numel() * triton.cdiv(N, tiles.block_n),)
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_ids, expert_ids, num_padded, weights, T * top_k, T, N, K, a.stride(0),
        w.stride(0), w.stride(1), out.stride(0), TOP_K=top_k, GATED=gated,
        EVEN_K=K % tiles.block_k == 0, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_offset: int = 0, all_local: bool = True,
              tiles: MoeTiles | None = None, defer_sum: bool = False) -> torch.Tensor | SplitKSum:
    """x [T, H], w13 [E, 2I, H] (gate; up), w2 [E, H, I], topk_weights / topk_ids [T, k] ->
    [T, H]. The experts held are [expert_offset, + E); with all_local False (expert parallel)
    others' assignments add nothing. Contiguous x and weights. With defer_sum, up to
    DEFER_MAX_ASSIGNMENTS: the k float32 partials as a SplitKSum, summed by the next kernel."""
    assert x.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous()
    T, H = x.shape
    top_k = topk_ids.shape[1]
    E, inter = w13.shape[0], w2.shape[2]
    n = T * top_k
    tiles = tiles or moe_tiles(n, E)
    align = moe_align(topk_ids, E, tiles.block_m, expert_offset)
    weights = topk_weights.reshape(-1).contiguous()
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, act, align, T, top_k, weights, gated=True, tiles=tiles)
    defer = defer_sum and n <= DEFER_MAX_ASSIGNMENTS
    y = (torch.empty if all_local else torch.zeros)(
        top_k, T, H, dtype=torch.float32 if defer else x.dtype, device=x.device)
    _grouped_gemm(act, w2, y.view(n, H), align, T, top_k, weights, gated=False, tiles=tiles)
    if defer:
        return SplitKSum(y, x.dtype)
    return y[0] if top_k == 1 else y.sum(dim=0)
