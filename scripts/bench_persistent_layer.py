"""Measures whether a persistent kernel with grid barriers beats a chain of kernels at decode sizes (H200).

    python scripts/bench_persistent_layer.py

1. What a grid barrier costs inside one kernel, against what a kernel boundary costs in a CUDA graph (empty
   kernels, with and without programmatic dependent launch): µs each.
2. Qwen3-0.6B's decode work between two attentions (o_proj, add + RMSNorm, gate/up + SiLU, down, add + RMSNorm,
   qkv) for 28 layers: the engine's six kernels a layer against one persistent kernel a layer whose programs
   do each phase's tiles and meet at a grid barrier between phases (three a layer). Tiles and split-K counts
   are the engine's; each program computes the norms for itself (a 1,024-wide row is cheap to read from L2).
   µs a layer, and how far the results are from the engine's.

Written to $OUT/bench_persistent_layer.txt too. H200 (BENCHMARKS.md, twenty-first session): a kernel boundary
in a graph costs 0.81 µs with PDL, a grid barrier 1.12 µs (132 programs) to 1.94 (264), and the persistent layer
took 48-80 µs a layer against the engine kernels' 21.6-22.6 (bit-equal results): at decode sizes the kernels'
time is their own dependent memory latency, which one kernel with barriers does not remove.
"""

import itertools

import torch
import triton
import triton.language as tl
from gpu_timing import bench, emit, save_report  # scripts/gpu_timing.py

from nanovllm.kernels.device import num_sms, prefetch_to_l2
from nanovllm.kernels.gemm import skinny as sg
from nanovllm.kernels.gemm.skinny import silu_and_mul_as_torch
from nanovllm.kernels.gemm.split_k import load_split_sum
from nanovllm.layers.layernorm import rms_norm_triton, weighted_as_torch

DTYPE = torch.bfloat16
DEV = "cuda"
HIDDEN, Q_WIDTH, INTER, QKV = 1024, 2048, 3072, 4096
EPS = 1e-6
# (num_warps, num_stages of the loops over normed x, gate/up K tile): these spill nothing (sm_90, Triton 3.6)
KERNEL_CONFIGS = ((8, 1, 128), (4, 2, 128))


@triton.jit
def _load_acquire(ptr):
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def grid_barrier(sync_ptr, number):
    """Waits until every program of the grid has arrived at barrier `number` (1, 2, ...) of this launch. All
    programs must be resident at once. sync_ptr[0] counts arrivals; grid_exit resets it."""
    tl.debug_barrier()  # the program's threads have issued their stores; the release orders them before the add
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    target = number * tl.num_programs(0)
    arrived = _load_acquire(sync_ptr)
    while arrived < target:
        arrived = _load_acquire(sync_ptr)
    tl.debug_barrier()


@triton.jit
def grid_exit(sync_ptr):
    """The last program to leave resets the arrival count for the next launch (sync_ptr[1] counts leavers)."""
    left = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == tl.num_programs(0) - 1:
        tl.store(sync_ptr, 0)
        tl.store(sync_ptr + 1, 0)


@triton.jit
def _barriers_kernel(sync_ptr, ROUNDS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    for r in range(1, ROUNDS + 1):
        grid_barrier(sync_ptr, r)
    grid_exit(sync_ptr)


@triton.jit
def _empty_kernel(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _tile_product(x_ptr, stride_xm, w_ptr, K, n0, k_start, k_end, offs_m, m_mask,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_STAGES: tl.constexpr):
    """y.T [BLOCK_N, BLOCK_M] of x [M, K] @ w[n0:n0 + BLOCK_N, k_start:k_end].T, float32 (the skinny GEMM's loop)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=W_STAGES):
        x = tl.load(x_ptrs + k, mask=m_mask[:, None], other=0.0)
        acc = tl.dot(tl.load(w_ptrs + k), tl.trans(x), acc)
    return acc


@triton.jit
def _split_gemm_phase(x_ptr, stride_xm, w_ptr, part_ptr, M, N: tl.constexpr, K: tl.constexpr, offs_m, m_mask,
                      SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      W_STAGES: tl.constexpr):
    """This program's share of the (n tile, K split) items of x @ w.T, float32 partials [SPLITS, M, N]."""
    tiles: tl.constexpr = N // BLOCK_N
    k_per_split: tl.constexpr = K // SPLITS
    for item in range(tl.program_id(0), tiles * SPLITS, tl.num_programs(0)):
        n0 = (item % tiles) * BLOCK_N
        split = item // tiles
        acc = _tile_product(x_ptr, stride_xm, w_ptr, K, n0, split * k_per_split, (split + 1) * k_per_split,
                            offs_m, m_mask, BLOCK_M, BLOCK_N, BLOCK_K, W_STAGES)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        tl.store(part_ptr + (split * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None], acc,
                 mask=m_mask[None, :])


@triton.jit
def _prefetch_split_gemm(w_ptr, N: tl.constexpr, K: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Starts fetching into L2 the first 1 KiB of each weight row of this program's items of _split_gemm_phase."""
    tiles: tl.constexpr = N // BLOCK_N
    k_per_split: tl.constexpr = K // SPLITS
    for item in range(tl.program_id(0), tiles * SPLITS, tl.num_programs(0)):
        rows = (item % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = (item // tiles) * k_per_split + tl.minimum(tl.arange(0, 8) * 64, k_per_split - 1)
        prefetch_to_l2(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :])


@triton.jit
def _sum_parts(part_ptr, split_stride, res_ptr, offs, mask, SPLITS: tl.constexpr, dtype: tl.constexpr):
    """float32 residual + the partials' sum rounded to dtype: the rms_norm kernel's h."""
    y = load_split_sum(part_ptr, offs, mask, split_stride, SPLITS, dtype)
    return y.to(tl.float32) + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _inv_rms(part_ptr, split_stride, res_ptr, res_out_ptr, offs_m, m_mask, eps, N: tl.constexpr,
             SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, dtype: tl.constexpr):
    """1 / rms of each row of h = residual + sum of partials [SPLITS, M, N]; program 0 stores h (the new
    residual) to res_out_ptr."""
    squares = tl.zeros([BLOCK_M], tl.float32)
    for c in tl.static_range(0, N, CHUNK):
        offs = offs_m[:, None] * N + c + tl.arange(0, CHUNK)[None, :]
        h = _sum_parts(part_ptr, split_stride, res_ptr, offs, m_mask[:, None], SPLITS, dtype)
        if tl.program_id(0) == 0:
            tl.store(res_out_ptr + offs, h.to(dtype), mask=m_mask[:, None])
        squares += tl.sum(h * h, 1)
    return tl.math.rsqrt(squares / N + eps)


@triton.jit
def _normed_x(part_ptr, split_stride, res_ptr, norm_w_ptr, inv_rms, offs_m, m_mask, k, N: tl.constexpr,
              SPLITS: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """Columns k:k + BLOCK_K of the RMSNorm output (rounded as the rms_norm kernel rounds it)."""
    cols = k + tl.arange(0, BLOCK_K)
    h = _sum_parts(part_ptr, split_stride, res_ptr, offs_m[:, None] * N + cols[None, :], m_mask[:, None],
                   SPLITS, dtype)
    return weighted_as_torch(h, inv_rms[:, None], tl.load(norm_w_ptr + cols)[None, :], dtype).to(dtype)


@triton.jit
def _normed_gemm_phase(part_ptr, res_ptr, norm_w_ptr, inv_rms, w_ptr, out_ptr, M, N: tl.constexpr,
                       K: tl.constexpr, offs_m, m_mask, IN_SPLITS: tl.constexpr, OUT_SPLITS: tl.constexpr,
                       GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       dtype: tl.constexpr, X_STAGES: tl.constexpr):
    """This program's items of RMSNorm(residual + partials) @ w.T: GATED, silu(gate) * up [M, N] (w holds
    2N rows, K whole); else float32 partials [OUT_SPLITS, M, N]."""
    tiles: tl.constexpr = N // BLOCK_N
    k_per_split: tl.constexpr = K // OUT_SPLITS
    offs_k = tl.arange(0, BLOCK_K)
    for item in range(tl.program_id(0), tiles * OUT_SPLITS, tl.num_programs(0)):
        offs_n = (item % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = item // tiles
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k in tl.range(split * k_per_split, (split + 1) * k_per_split, BLOCK_K, num_stages=X_STAGES):
            x = _normed_x(part_ptr, M * K, res_ptr, norm_w_ptr, inv_rms, offs_m, m_mask, k, K, IN_SPLITS,
                          BLOCK_K, dtype)
            acc = tl.dot(tl.load(w_ptrs + k), tl.trans(x), acc)
            if GATED:
                acc_up = tl.dot(tl.load(w_ptrs + N * K + k), tl.trans(x), acc_up)
        if GATED:
            tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], silu_and_mul_as_torch(acc, acc_up, dtype),
                     mask=m_mask[None, :])
        else:
            tl.store(out_ptr + (split * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None], acc,
                     mask=m_mask[None, :])


@triton.jit
def _layer_tail_kernel(attn_ptr, res_ptr, wo_ptr, wgu_ptr, wd_ptr, wqkv_ptr, norm_post_ptr, norm_in_ptr,
                       o_part_ptr, res_mid_ptr, act_ptr, d_part_ptr, res_out_ptr, qkv_part_ptr, sync_ptr, M, eps,
                       H: tl.constexpr, Q_WIDTH: tl.constexpr, INTER: tl.constexpr, QKV: tl.constexpr,
                       O_SPLITS: tl.constexpr, D_SPLITS: tl.constexpr, QKV_SPLITS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GU_BLOCK_N: tl.constexpr, GU_BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
                       W_STAGES: tl.constexpr, X_STAGES: tl.constexpr, NORM_CHUNK: tl.constexpr,
                       PDL: tl.constexpr):
    """o_proj; add + RMSNorm, gate/up + SiLU; down; add + RMSNorm, qkv (split-K partials): one launch, three
    grid barriers."""
    dtype = res_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if PREFETCH:
            _prefetch_split_gemm(wo_ptr, H, Q_WIDTH, O_SPLITS, BLOCK_N)
        tl.extra.cuda.gdc_wait()
    _split_gemm_phase(attn_ptr, Q_WIDTH, wo_ptr, o_part_ptr, M, H, Q_WIDTH, offs_m, m_mask, O_SPLITS,
                      BLOCK_M, BLOCK_N, BLOCK_K, W_STAGES)
    if PREFETCH:
        _prefetch_split_gemm(wgu_ptr, INTER, H, 1, GU_BLOCK_N)
    grid_barrier(sync_ptr, 1)
    inv_rms = _inv_rms(o_part_ptr, M * H, res_ptr, res_mid_ptr, offs_m, m_mask, eps, H, O_SPLITS, BLOCK_M,
                       NORM_CHUNK, dtype)
    _normed_gemm_phase(o_part_ptr, res_ptr, norm_post_ptr, inv_rms, wgu_ptr, act_ptr, M, INTER, H, offs_m, m_mask,
                       O_SPLITS, 1, True, BLOCK_M, GU_BLOCK_N, GU_BLOCK_K, dtype, X_STAGES)
    if PREFETCH:
        _prefetch_split_gemm(wd_ptr, H, INTER, D_SPLITS, BLOCK_N)
    grid_barrier(sync_ptr, 2)
    _split_gemm_phase(act_ptr, INTER, wd_ptr, d_part_ptr, M, H, INTER, offs_m, m_mask, D_SPLITS,
                      BLOCK_M, BLOCK_N, BLOCK_K, W_STAGES)
    if PREFETCH:
        _prefetch_split_gemm(wqkv_ptr, QKV, H, QKV_SPLITS, BLOCK_N)
    grid_barrier(sync_ptr, 3)
    inv_rms = _inv_rms(d_part_ptr, M * H, res_mid_ptr, res_out_ptr, offs_m, m_mask, eps, H, D_SPLITS, BLOCK_M,
                       NORM_CHUNK, dtype)
    _normed_gemm_phase(d_part_ptr, res_mid_ptr, norm_in_ptr, inv_rms, wqkv_ptr, qkv_part_ptr, M, QKV, H, offs_m,
                       m_mask, D_SPLITS, QKV_SPLITS, False, BLOCK_M, BLOCK_N, BLOCK_K, dtype, X_STAGES)
    grid_exit(sync_ptr)


def splits(N, K):
    return sg.launch_config(N, K, num_sms(torch.device(DEV))).split_k


def layer_weights(layers):
    torch.manual_seed(0)
    return [dict(qkv=torch.randn(QKV, HIDDEN, dtype=DTYPE, device=DEV) / 32,
                 o=torch.randn(HIDDEN, Q_WIDTH, dtype=DTYPE, device=DEV) / 45,
                 gate_up=torch.randn(2 * INTER, HIDDEN, dtype=DTYPE, device=DEV) / 32,
                 down=torch.randn(HIDDEN, INTER, dtype=DTYPE, device=DEV) / 55,
                 norm_post=1 + torch.randn(HIDDEN, dtype=DTYPE, device=DEV) / 10,
                 norm_in=1 + torch.randn(HIDDEN, dtype=DTYPE, device=DEV) / 10) for _ in range(layers)]


def engine_chain(M, weights, attn, res0):
    """The engine's kernels: o (partials), add + RMSNorm, skinny_swiglu, down (partials), add + RMSNorm, qkv."""
    def run():
        res = res0
        for w in weights:
            o = sg.skinny_linear(attn, w["o"], defer_sum=True)
            h, res = rms_norm_triton(o, res, w["norm_post"], EPS)
            d = sg.skinny_linear(sg.skinny_swiglu(h, w["gate_up"]), w["down"], defer_sum=True)
            h, res = rms_norm_triton(d, res, w["norm_in"], EPS)
            qkv = sg.skinny_linear(h, w["qkv"], defer_sum=True)
        return qkv.sum(), res
    return run


def programs_per_sm(kernel, num_warps):
    """How many programs of a compiled kernel an SM holds at once (registers, shared memory, warps)."""
    props = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
    regs_per_warp = triton.cdiv(kernel.n_regs * 32, 256) * 256
    by_regs = props["max_num_regs"] // (regs_per_warp * num_warps)
    by_smem = props["max_shared_mem"] // max(1, kernel.metadata.shared + 1024)  # + 1 KiB the system reserves
    return min(by_regs, by_smem, 64 // num_warps)


def persistent_chain(M, weights, attn, res0, per_sm, prefetch, num_warps, x_stages, gu_block_k):
    """The persistent kernel a layer with per_sm programs an SM, or None where an SM cannot hold them all."""
    so, sd, sq = splits(HIDDEN, Q_WIDTH), splits(HIDDEN, INTER), splits(QKV, HIDDEN)
    f32 = dict(dtype=torch.float32, device=DEV)
    o_part, d_part, qkv_part = torch.empty(so, M, HIDDEN, **f32), torch.empty(sd, M, HIDDEN, **f32), \
        torch.empty(sq, M, QKV, **f32)
    act = torch.empty(M, INTER, dtype=DTYPE, device=DEV)
    residuals = [torch.empty(M, HIDDEN, dtype=DTYPE, device=DEV) for _ in range(3)]
    sync = torch.zeros(2, dtype=torch.int32, device=DEV)
    sms = num_sms(torch.device(DEV))

    def launch(programs, w, res, res_mid, res_out):
        return _layer_tail_kernel[(programs,)](
            attn, res, w["o"], w["gate_up"], w["down"], w["qkv"], w["norm_post"], w["norm_in"], o_part,
            res_mid, act, d_part, res_out, qkv_part, sync, M, EPS, H=HIDDEN, Q_WIDTH=Q_WIDTH, INTER=INTER,
            QKV=QKV, O_SPLITS=so, D_SPLITS=sd, QKV_SPLITS=sq, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
            GU_BLOCK_N=16, GU_BLOCK_K=gu_block_k, PREFETCH=prefetch, W_STAGES=4, X_STAGES=x_stages, NORM_CHUNK=64,
            PDL=True, num_warps=num_warps, num_stages=4, launch_pdl=True)

    kernel = launch(sms, weights[0], res0, residuals[0], residuals[1])  # one program an SM always fits
    if programs_per_sm(kernel, num_warps) < per_sm:
        return None

    def run():
        res = res0
        for w in weights:
            res_out = residuals[1] if res is not residuals[1] else residuals[2]
            launch(per_sm * sms, w, res, residuals[0], res_out)
            res = res_out
        return sg.SplitKSum(qkv_part, DTYPE).sum(), res.clone()
    return run


def barrier_costs(rounds=200):
    emit(f"== what a grid barrier costs against a kernel boundary ({rounds} in one CUDA graph); µs each")
    sync = torch.zeros(2, dtype=torch.int32, device=DEV)
    sms = num_sms(torch.device(DEV))
    for pdl in (False, True):
        t = bench(lambda pdl=pdl: [_empty_kernel[(sms,)](PDL=pdl, launch_pdl=pdl) for _ in range(rounds)])
        emit(f"empty kernels, {sms} programs, PDL {pdl}: {t * 1e3 / rounds:.2f}")
    for programs in (sms, 2 * sms):
        t = bench(lambda programs=programs: _barriers_kernel[(programs,)](sync, ROUNDS=rounds, PDL=True,
                                                                          launch_pdl=True))
        emit(f"grid barriers, {programs} programs: {t * 1e3 / rounds:.2f} (count reset after: {not sync.any().item()})")


def layer_costs(rows, layers=28):
    emit(f"== {layers} layers of o, add + RMSNorm, gate/up + SiLU, down, add + RMSNorm, qkv; µs a layer")
    weights = layer_weights(layers)
    for M in rows:
        torch.manual_seed(1)
        attn = torch.randn(M, Q_WIDTH, dtype=DTYPE, device=DEV)
        res0 = torch.randn(M, HIDDEN, dtype=DTYPE, device=DEV)
        engine = engine_chain(M, weights, attn, res0)
        qkv_ref, res_ref = engine()
        line = f"M={M:>2}: engine kernels {bench(engine) * 1e3 / layers:6.2f}"
        for (num_warps, x_stages, gu_block_k), per_sm, prefetch in itertools.product(
                KERNEL_CONFIGS, (1, 2), (False, True)):
            chain = persistent_chain(M, weights, attn, res0, per_sm, prefetch, num_warps, x_stages, gu_block_k)
            name = f"{num_warps}w/{x_stages}/{gu_block_k}, {per_sm}/SM{', prefetch' if prefetch else ''}"
            if chain is None:
                line += f" | {name}: does not fit"
                continue
            qkv, res = chain()
            err = max((qkv.float() - qkv_ref.float()).abs().max().item(),
                      (res.float() - res_ref.float()).abs().max().item())
            t = bench(chain) * 1e3 / layers
            equal = torch.equal(qkv, qkv_ref) and torch.equal(res, res_ref)
            line += f" | {name}: {t:6.2f} (max diff {err:.3g}, equal {equal})"
        emit(line)


def main():
    emit(torch.cuda.get_device_name())
    barrier_costs()
    layer_costs((1, 8, 16))
    save_report("bench_persistent_layer.txt")


if __name__ == "__main__":
    main()
