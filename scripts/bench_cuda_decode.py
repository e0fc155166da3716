"""Probe: the hand-written CUDA fp8 decode kernel (nanovllm/layers/cuda_decode.py) against the Triton one
(triton_decode.paged_decode_attention) on the same fp8 cache, at the engine's split counts.

    python scripts/bench_cuda_decode.py     # ~1 min on an H200; report in $OUT/bench_cuda_decode.txt

Shapes are bench_attention.py's (Qwen3-0.6B heads, 256-token pages, random blocks); each row checks both
kernels against the float32 reference and each other, then times them (medians of CUDA-graph replays, L2
flushed), the CUDA kernel at 4 and at 3 blocks an SM (128 and up to 170 registers a thread). Last, a batch
whose cache bytes past each context are fp8 NaNs must give the Triton kernel's output, finite.
"""

import torch
from bench_attention import PAGE, SCALE, Cache, decode_bytes, decode_inputs, reference
from gpu_timing import bench, copy_bandwidth, emit, save_report

from nanovllm.layers import cuda_decode, triton_decode

# (batch, shortest context, longest or None, rows taken up longest first)
SHAPES = ((1, 1500, None, False), (8, 1500, None, False), (8, 1000, 2024, True), (32, 1500, None, False),
          (64, 1255, None, False), (128, 100, 2148, True), (256, 1024, None, False), (256, 100, 1124, True),
          (256, 4096, None, False))
MIN_BLOCKS = (4, 3)


def ordered_inputs(cache, batch, ctx, longest, by_order):
    q, tables, lens = decode_inputs(cache, batch, ctx, longest)
    order = lens.sort(descending=True, stable=True).indices.to(torch.int32) if by_order else None
    return q, tables, lens, order


def row(cache, batch, ctx, longest, by_order, copy_bw):
    q, tables, lens, order = ordered_inputs(cache, batch, ctx, longest, by_order)
    args = (q, *cache.kv, tables, lens, SCALE)
    triton_fn = lambda: triton_decode.paged_decode_attention(*args, **cache.scales, order=order)
    cuda_fns = [lambda mb=mb: cuda_decode.paged_decode_attention(*args, **cache.scales, order=order, min_blocks=mb)
                for mb in MIN_BLOCKS]
    ref_rows = sorted({0, batch // 2, batch - 1})
    refs = {b: reference(q[b:b + 1], cache, tables[b], int(lens[b]))[0] for b in ref_rows}
    err = lambda out: max((out[b].float() - refs[b]).abs().max().item() for b in ref_rows)
    t_out = triton_fn()
    outs = [fn() for fn in cuda_fns]
    errs = " ".join(f"{err(o):7.1e}" for o in [t_out, *outs])
    vs_triton = max((o.float() - t_out.float()).abs().max().item() for o in outs)
    times = [bench(fn) * 1e3 for fn in [triton_fn, *cuda_fns]]
    gb = decode_bytes(lens, cache.token_bytes)
    splits = triton_decode._decode_num_splits(batch, 8, tables.shape[1] * PAGE, q.device)
    shown = ctx if longest is None else f"{'>o' if by_order else '~'}{lens.float().mean().item():.0f}"
    bws = " ".join(f"{100 * gb / (t * 1e-6) / copy_bw:5.1f}" for t in times)
    emit(f"{batch:>4} {shown:>6} {splits:>3} " + " ".join(f"{t:8.1f}" for t in times)
         + f" {times[0] / min(times[1:]):6.3f}  {bws}  {errs} {vs_triton:8.1e}")


def nan_past_context(cache):
    """Fill the cache bytes past each context (in its last block) with fp8 NaNs; both kernels must ignore them."""
    q, tables, lens, order = ordered_inputs(cache, 16, 100, 1500, True)
    lens[-1] = 0  # a padding row: zeros out
    k8, v8 = (x.view(torch.uint8) for x in cache.kv)
    for b in range(16):
        n = int(lens[b])
        block, offset = int(tables[b, max(n - 1, 0) // PAGE]), n % PAGE
        if offset:
            k8[block, offset:] = 0x7F
            v8[block, :, :, offset:] = 0x7F
    args = (q, *cache.kv, tables, lens, SCALE)
    t_out = triton_decode.paged_decode_attention(*args, **cache.scales, order=order)
    for mb in MIN_BLOCKS:
        for splits in (1, 4, 16):
            out = cuda_decode.paged_decode_attention(*args, **cache.scales, order=order, min_blocks=mb,
                                                     num_splits=splits)
            diff = (out.float() - t_out.float()).abs().max().item()
            emit(f"NaN past context, min_blocks {mb}, {splits:>2} splits: finite {bool(out.isfinite().all())}, "
                 f"padding row zero {bool((out[-1] == 0).all())}, max |cuda - triton| {diff:.1e}")


def main():
    torch.manual_seed(0)
    cache = Cache(256 * 4096 + 16 * PAGE, fp8=True)
    copy_bw = copy_bandwidth()
    emit(f"== fp8 decode, Triton vs CUDA (min_blocks {MIN_BLOCKS}), {torch.cuda.get_device_name()}, "
         f"copy {copy_bw / 1e12:.2f} TB/s")
    emit(f"{'B':>4} {'ctx':>6} {'spl':>3} {'triton':>8} " + " ".join(f"{'cuda' + str(m):>8}" for m in MIN_BLOCKS)
         + f" {'tri/cu':>6}  %copy (tri, cuda...)  err_ref (tri, cuda...)  |cu-tri|")
    for shape in SHAPES:
        row(cache, *shape, copy_bw)
    nan_past_context(cache)
    save_report("bench_cuda_decode.txt")


if __name__ == "__main__":
    main()
