"""Triton paged-attention kernels (decode, prefill, fp8 dequantization) against flash-attn.

    python -m benchmarks.attention                     # decode grid + prefill shapes
    python -m benchmarks.attention --sweep [decode|prefill|dequant]   # also launch configs
    python -m benchmarks.attention --only decode --sweep decode --tiles 32/1/2,64/4/2
    ... --sweep decode --decode-shapes 8:1000-2024,1:4096 [--longest-first]
    python -m benchmarks.attention --kv-cache-dtype fp8 [--sweep dequant]
"""

import argparse
import functools
import time

import torch
import triton

from benchmarks.gpu_timing import bench, copy_bandwidth, emit, save_report
from nanovllm.kernels.attention import decode as triton_decode
from nanovllm.kernels.attention import kv_cache
from nanovllm.kernels.attention import prefill as triton_prefill
from nanovllm.layers.attention import workspace_groups

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:
    flash_attn_varlen_func = flash_attn_with_kvcache = None

H, KVH, D, PAGE = 16, 8, 128, 256  # Qwen3-0.6B's heads
DTYPE = torch.bfloat16
SCALE = D ** -0.5
DEV = "cuda"
BATCHES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (128, 512, 1024, 2048, 4096)
# (batch, shortest, longest context, row order): contexts uniform in [shortest, longest]; the ctx
# column shows their mean after "~" (random order), ">" (sorted longest first) or ">o" (random, with
# the kernel's order argument taking them longest first, as the engine does).
RAGGED_DECODE = ((256, 100, 1124, "random"), (256, 100, 1124, "sorted"),
                 (256, 100, 1124, "by order"), (128, 100, 2148, "random"),
                 (32, 100, 4096, "random"))
ROWS_SHOWN = {"random": "~", "sorted": ">", "by order": ">o"}
# (name, sequences, cached prefix tokens, new query tokens a sequence)
PREFILL_SHAPES = (("8x1024", 8, 0, 1024), ("1x4096", 1, 0, 4096), ("4x512+1536", 4, 1536, 512),
                  ("16x128+896", 16, 896, 128), ("32x64+960", 32, 960, 64),
                  ("64x16+1008", 64, 1008, 16))


class Cache:
    """A paged K/V cache for the biggest shape; each shape takes random blocks of it. k, v: the bf16
    cache (flash-attn's); kv, scales: what the Triton kernels read (with fp8, its quantization)."""

    def __init__(self, max_tokens, fp8=False):
        self.num_blocks = triton.cdiv(max_tokens, PAGE) + 16
        shape = (self.num_blocks, PAGE, KVH, D)
        self.k = torch.randn(shape, dtype=DTYPE, device=DEV)
        self.v = torch.randn(shape, dtype=DTYPE, device=DEV)
        self.kv, self.scales = (self.k, self.v), {}
        if fp8:
            k8, k_scale, v8, v_scale = kv_cache.quantize_cache_fp8(self.k, self.v)
            self.kv, self.scales = (k8, v8), dict(k_scale=k_scale, v_scale=v_scale)
        self.fp8, self.kind = fp8, "fp8" if fp8 else "bf16"
        self.token_bytes = 2 * KVH * (D * self.kv[0].element_size() + 4 * fp8)  # K, V, scales

    def tokens(self, table, ctx):
        """K, V [ctx, KVH, D] float32 of a sequence's first ctx tokens, as the kernels see them."""
        tok = torch.arange(ctx, device=DEV)
        blocks, offsets = table[tok // PAGE].long(), tok % PAGE
        v_cache = kv_cache.v_token_major(self.kv[1])
        k, v = (x[blocks, offsets].float() for x in (self.kv[0], v_cache))
        if self.scales:  # scales [num_blocks, KVH, PAGE]
            k *= self.scales["k_scale"][blocks, :, offsets][..., None]
            v *= self.scales["v_scale"][blocks, :, offsets][..., None]
        return k, v

    def tables(self, batch, max_ctx):
        pages = triton.cdiv(max_ctx, PAGE)
        perm = torch.randperm(self.num_blocks, device=DEV)[: batch * pages]
        return perm.view(batch, pages).to(torch.int32)


def reference(q, cache, table, ctx):
    """float32 attention of q [n_q, H, D] at the last n_q of ctx positions of one sequence."""
    n_q = q.shape[0]
    tok = torch.arange(ctx, device=DEV)
    k, v = (x.repeat_interleave(H // KVH, 1) for x in cache.tokens(table, ctx))
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * SCALE
    pos = ctx - n_q + torch.arange(n_q, device=DEV)
    s.masked_fill_(tok[None, None, :] > pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def decode_inputs(cache, batch, ctx, longest=None, longest_first=False):
    """q, block tables and context lengths: all ctx, or uniform in [ctx, longest] (sorted descending
    if longest_first)."""
    q = torch.randn(batch, H, D, dtype=DTYPE, device=DEV)
    if longest is None:
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    else:
        lens = torch.randint(ctx, longest + 1, (batch,), dtype=torch.int32, device=DEV)
        if longest_first:
            lens = lens.sort(descending=True).values
    return q, cache.tables(batch, longest or ctx), lens


def decode_bytes(lens, token_bytes=2 * KVH * D * DTYPE.itemsize):
    """K/V of all context tokens (bf16 by default) plus q and out."""
    return int(lens.sum()) * token_bytes + 2 * lens.numel() * H * D * DTYPE.itemsize


def decode_row(cache, batch, ctx, copy_bw, longest=None, rows="random"):
    q, tables, lens = decode_inputs(cache, batch, ctx, longest, rows == "sorted")
    order = None
    if rows == "by order":
        order = lens.sort(descending=True, stable=True).indices.to(torch.int32)
    fn = lambda: triton_decode.paged_decode_attention(q, *cache.kv, tables, lens, SCALE,
                                                      **cache.scales, order=order)
    out = fn()
    err_ref = max((out[b].float() - reference(q[b:b + 1], cache, tables[b], int(lens[b]))[0])
                  .abs().max().item() for b in sorted({0, batch // 2, batch - 1}))
    t = bench(fn)
    bw = decode_bytes(lens, cache.token_bytes) / (t * 1e-3)
    splits = triton_decode._decode_num_splits(batch, KVH, tables.shape[1] * PAGE, q.device)
    fa_cols, err_fa = f"{'-':>8} {'-':>7} {'-':>6}", "-"
    if flash_attn_with_kvcache is not None:
        fa = lambda: flash_attn_with_kvcache(q.unsqueeze(1), cache.k, cache.v, cache_seqlens=lens,
                                             block_table=tables, softmax_scale=SCALE, causal=True)
        err_fa = f"{(out - fa().squeeze(1)).abs().max().item():8.1e}"
        t_fa = bench(fa)
        fa_bw = decode_bytes(lens) / (t_fa * 1e-3)
        fa_cols = f"{t_fa * 1e3:8.1f} {fa_bw / 1e12:7.2f} {t / t_fa:6.2f}"
    shown = ctx if longest is None else f"{ROWS_SHOWN[rows]}{lens.float().mean().item():.0f}"
    emit(f"{batch:>4} {shown:>5} {splits:>6} {t * 1e3:9.1f} {bw / 1e12:5.2f} "
         f"{100 * bw / copy_bw:5.1f} {fa_cols} {err_ref:8.1e} {err_fa:>8}")


def run_decode(cache, copy_bw):
    emit(f"== decode: H={H} KVH={KVH} D={D} {cache.kind} page={PAGE}; "
         f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    emit(f"{'B':>4} {'ctx':>5} {'splits':>6} {'triton_us':>9} {'TB/s':>5} {'%copy':>5} "
         f"{'fa_us':>8} {'fa_TB/s':>7} {'tri/fa':>6} {'err_ref':>8} {'err_fa':>8}")
    for batch in BATCHES:
        for ctx in CONTEXTS:
            decode_row(cache, batch, ctx, copy_bw)
    for batch, shortest, longest, rows in RAGGED_DECODE:
        decode_row(cache, batch, shortest, copy_bw, longest, rows)


def prefill_inputs(cache, n_seq, prefix, n_q):
    ctx = prefix + n_q
    q = torch.randn(n_seq * n_q, H, D, dtype=DTYPE, device=DEV)
    cu_q = torch.arange(0, n_seq + 1, dtype=torch.int32, device=DEV) * n_q
    cu_k = torch.arange(0, n_seq + 1, dtype=torch.int32, device=DEV) * ctx
    lens = torch.full((n_seq,), ctx, dtype=torch.int32, device=DEV)
    return q, cache.tables(n_seq, ctx), cu_q, cu_k, lens


def prefill_flops(n_seq, prefix, n_q):
    pairs = n_q * prefix + n_q * (n_q + 1) // 2  # visible (query, key) pairs a sequence
    return 4 * n_seq * H * D * pairs


def engine_path_ms(cache, q, tables, cu_q, cu_k, n_seq, prefix, n_q, out, config):
    """The engine's 16-bit path where it has one: varlen attention over new bf16 K/V without a
    prefix; over an fp8 prefix, dequantization into a workspace first. (total ms, dequant ms)."""
    if prefix == 0:
        k, v = (torch.randn(n_seq * n_q, KVH, D, dtype=DTYPE, device=DEV) for _ in range(2))
        return bench(lambda: triton_prefill.varlen_prefill_attention(
            q, k, v, cu_q, n_q, SCALE, **config)), None
    if not cache.fp8:
        return None, None
    workspace, groups = dequant_workspace(cu_q, cu_k)
    dequantized = lambda: triton_prefill.dequantized_prefill_attention(
        q, *cache.kv, cache.scales["k_scale"], cache.scales["v_scale"], tables, cu_q, cu_k, groups,
        SCALE, workspace, **config)
    err_dq = (dequantized() - out).abs().max().item()
    assert err_dq < 5e-2, f"dequantized path differs from the fp8 kernel by {err_dq}"
    return bench(dequantized), bench(lambda: dequantize_all(cache, tables, cu_k, groups, workspace))


def prefill_row(cache, name, n_seq, prefix, n_q, config):
    q, tables, cu_q, cu_k, lens = prefill_inputs(cache, n_seq, prefix, n_q)
    fn = lambda: triton_prefill.paged_prefill_attention(q, *cache.kv, tables, cu_q, lens, n_q,
                                                        SCALE, **cache.scales, **config)
    out = fn()
    err_ref = max((out[b * n_q:(b + 1) * n_q].float() - reference(
        q[b * n_q:(b + 1) * n_q], cache, tables[b], prefix + n_q)).abs().max().item()
        for b in sorted({0, n_seq - 1}))
    t = bench(fn)
    flops = prefill_flops(n_seq, prefix, n_q)
    fa_cols, err_fa = f"{'-':>8} {'-':>10} {'-':>6}", "-"
    if flash_attn_varlen_func is not None:
        fa = lambda: flash_attn_varlen_func(q, cache.k, cache.v, cu_q, cu_k, n_q, prefix + n_q,
                                            softmax_scale=SCALE, causal=True, block_table=tables)
        err_fa = f"{(out - fa()).abs().max().item():8.1e}"
        t_fa = bench(fa)
        fa_cols = f"{t_fa * 1e3:8.1f} {flops / t_fa * 1e-9:10.1f} {t / t_fa:6.2f}"
    t_var, t_dq = engine_path_ms(cache, q, tables, cu_q, cu_k, n_seq, prefix, n_q, out, config)
    varlen_cols = f"{'-':>9} {'-':>6}"
    if t_var is not None:
        ratio = f"{t_var / t_fa:6.2f}" if flash_attn_varlen_func else f"{'-':>6}"
        varlen_cols = f"{t_var * 1e3:9.1f} {ratio}"
    dq_col = f"{t_dq * 1e3:10.1f}" if t_dq is not None else f"{'-':>10}"
    emit(f"{name:>12} {t * 1e3:9.1f} {flops / t * 1e-9:7.1f} {fa_cols} {varlen_cols} {dq_col} "
         f"{err_ref:8.1e} {err_fa:>8}")


def dequant_workspace(cu_q, cu_k):
    """The engine's workspace at bench.py's config, and the groups of sequences it takes."""
    workspace = torch.empty(2, 16384, KVH, D, dtype=DTYPE, device=DEV)
    return workspace, workspace_groups(cu_q.tolist(), cu_k.tolist(), workspace.shape[1])


def dequantize_all(cache, tables, cu_k, groups, workspace, **config):
    """The dequantization kernels of dequantized_prefill_attention alone."""
    for first, end, _, max_seqlen_k in groups:
        triton_prefill.dequantize_paged_kv(*cache.kv, cache.scales["k_scale"],
                                           cache.scales["v_scale"], tables, cu_k, (first, end),
                                           max_seqlen_k, workspace, **config)


def run_prefill(cache, **config):
    emit(f"== prefill: H={H} KVH={KVH} D={D} {cache.kind} page={PAGE} {config or ''}")
    emit(f"{'shape':>12} {'triton_us':>9} {'TFLOP/s':>7} {'fa_us':>8} {'fa_TFLOP/s':>10} "
         f"{'tri/fa':>6} {'varlen_us':>9} {'var/fa':>6} {'dequant_us':>10} {'err_ref':>8} "
         f"{'err_fa':>8}")
    for shape in PREFILL_SHAPES:
        prefill_row(cache, *shape, config)


def decode_tiles(fp8, tiles=None):
    """(block_n, num_warps, num_stages) to sweep: `tiles` ("bn/w/s,...") or a default grid."""
    if tiles:
        return [tuple(int(x) for x in tile.split("/")) for tile in tiles.split(",")]
    block_ns = (32, 64, 128) + ((256,) if fp8 else ())
    return [(bn, w, s) for bn in block_ns for w in (4, 8) for s in (2, 3, 4)]


# (block_m, block_n, num_warps, num_stages)
PREFILL_CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 2), (128, 64, 4, 3),
                   (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 3),
                   (64, 128, 4, 2), (64, 128, 4, 4), (64, 128, 8, 3), (64, 64, 8, 3),
                   (64, 64, 8, 4), (64, 32, 4, 4), (32, 64, 4, 3), (32, 32, 4, 4)]
SPLIT_COUNTS = (1, 2, 4, 8, 16, 32, 64)


def decode_sweep_results(cache, batch, ctx, longest, tiles, longest_first):
    """TB/s (or the error's name) by (block_n, num_warps, num_stages, splits): every tile at the
    default split count, then every split count with the best tile. Also (default splits, tile)."""
    q, tables, lens = decode_inputs(cache, batch, ctx, longest, longest_first)
    default = triton_decode._decode_num_splits(batch, KVH, tables.shape[1] * PAGE, q.device)

    def tbps(bn, w, s, splits):
        fn = lambda: triton_decode.paged_decode_attention(
            q, *cache.kv, tables, lens, SCALE, **cache.scales, num_splits=splits, block_n=bn,
            num_warps=w, num_stages=s)
        try:
            fn()
            return decode_bytes(lens, cache.token_bytes) / (bench(fn, quick=True) * 1e-3) / 1e12
        except Exception as e:  # e.g. out of shared memory
            return type(e).__name__

    tile = triton_decode._decode_tile(D, cache.fp8)  # the kernel's default, always swept
    swept = dict.fromkeys([tile, *decode_tiles(cache.fp8, tiles)])
    results = {(bn, w, s, default): tbps(bn, w, s, default) for bn, w, s in swept}
    best = max((k for k, v in results.items() if isinstance(v, float)), key=results.get)[:3]
    for splits in SPLIT_COUNTS:
        if (*best, splits) not in results:
            results[(*best, splits)] = tbps(*best, splits)
    return results, default, tile, best


def sweep_decode_shape(cache, batch, ctx, copy_bw, longest=None, tiles=None, longest_first=False):
    results, default, tile, best = decode_sweep_results(cache, batch, ctx, longest, tiles,
                                                        longest_first)
    ranked = sorted(((v, k) for k, v in results.items() if isinstance(v, float)), reverse=True)
    base = results[(*tile, default)]
    if isinstance(base, float):
        base = f"{base:.2f} TB/s = {100 * base * 1e12 / copy_bw:.0f}% of copy"
    contexts = ctx if longest is None else f"{ctx}-{longest}"
    contexts = f"{contexts} longest first" if longest_first and longest else contexts
    emit(f"B={batch} ctx={contexts}: default splits {default}, "
         f"default tile {'/'.join(map(str, tile))}: {base}")
    emit("   top: " + "  ".join(f"{bn}/{w}/{s},{sp}:{v:.2f}" for v, (bn, w, s, sp) in ranked[:8]))
    emit(f"   splits with tile {'/'.join(map(str, best))}: " + "  ".join(
        f"{sp}:{results[(*best, sp)]:.2f}" for sp in SPLIT_COUNTS
        if isinstance(results[(*best, sp)], float)))
    failed = [k for k, v in results.items() if not isinstance(v, float)]
    if failed:
        emit(f"   failed: {failed}")


def varlen_over_workspace(q, cu_q, cu_k, groups, workspace, **config):
    """The 16-bit prefill kernels of dequantized_prefill_attention alone."""
    for first, end, max_seqlen_q, _ in groups:
        triton_prefill.varlen_prefill_attention(q, workspace[0], workspace[1], cu_q, max_seqlen_q,
                                                SCALE, cu_seqlens_k=cu_k, seqs=(first, end),
                                                **config)


def sweep_dequant(cache):
    """The fp8-prefix path's two kernels apart, by prefix shape: dequantization in GB/s (fp8 and
    scales read, bf16 written), and the 16-bit prefill over the workspace."""
    emit("== dequantized-prefix sweep: dequantize GB/s per block_n/num_warps; varlen us per "
         "block_m/block_n/num_warps/num_stages")
    for name, n_seq, prefix, n_q in PREFILL_SHAPES:
        if not prefix:
            continue
        q, tables, cu_q, cu_k, _ = prefill_inputs(cache, n_seq, prefix, n_q)
        workspace, groups = dequant_workspace(cu_q, cu_k)
        moved = n_seq * (prefix + n_q) * (cache.token_bytes + 2 * KVH * D * DTYPE.itemsize)
        dequantize = functools.partial(dequantize_all, cache, tables, cu_k, groups, workspace)
        rates = {f"{bn}/{w}": moved / (bench(functools.partial(dequantize, block_n=bn, num_warps=w),
                                             quick=True) * 1e-3) / 1e9
                 for bn in (32, 64, 128, 256) for w in (2, 4, 8)}
        emit(f"{name:>12} dequantize: " + "  ".join(f"{k}:{v:.0f}" for k, v in rates.items()))
        attend = functools.partial(varlen_over_workspace, q, cu_q, cu_k, groups, workspace)
        times = {"/".join(map(str, (bm, bn, w, s))): bench(functools.partial(
            attend, block_m=bm, block_n=bn, num_warps=w, num_stages=s), quick=True) * 1e3
            for bm, bn, w, s in PREFILL_CONFIGS}
        ranked = sorted(times.items(), key=lambda x: x[1])
        emit(f"{name:>12} varlen: " + "  ".join(f"{k}:{v:.1f}" for k, v in ranked))


# (batch, context, longest context or None) of the decode sweep; --decode-shapes replaces them.
DECODE_SWEEP_SHAPES = ((256, 100, 1124), (256, 1024, None), (64, 500, 1524), (32, 2048, None),
                       (8, 1000, 2024), (8, 4096, None), (1, 4096, None))


def parse_decode_shapes(text: str) -> list[tuple[int, int, int | None]]:
    """"B:ctx" or "B:ctx-longest", comma-separated, as DECODE_SWEEP_SHAPES."""
    shapes = []
    for shape in text.split(","):
        batch, contexts = shape.split(":")
        ctx, _, longest = contexts.partition("-")
        shapes.append((int(batch), int(ctx), int(longest) if longest else None))
    return shapes


def sweep(cache, copy_bw, kernels: str, tiles=None, decode_shapes=DECODE_SWEEP_SHAPES,
          longest_first=False):
    """Launch configs of kernels "decode", "prefill", "dequant" (the fp8-prefix path) or "all"."""
    if kernels == "dequant":
        return sweep_dequant(cache)
    if kernels != "prefill":
        emit("== decode sweep: TB/s (median); config = block_n/num_warps/num_stages,num_splits")
        for batch, ctx, longest in decode_shapes:
            sweep_decode_shape(cache, batch, ctx, copy_bw, longest, tiles, longest_first)
    if kernels == "decode":
        return
    for bm, bn, warps, stages in PREFILL_CONFIGS:
        try:
            run_prefill(cache, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        except Exception as e:
            emit(f"prefill {bm}/{bn}/{warps}/{stages} failed: {type(e).__name__}: {e}"[:200])


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", nargs="?", const="all",
                        choices=["all", "decode", "prefill", "dequant"],
                        help="also sweep launch configs (dequant: the fp8-prefix path)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="the cache the Triton kernels read: bf16 (auto) or fp8 + scales")
    parser.add_argument("--only", choices=["decode", "prefill"], help="one kernel's table only")
    parser.add_argument("--tiles", help="decode tiles to sweep, block_n/num_warps/num_stages,...")
    parser.add_argument("--decode-shapes", type=parse_decode_shapes, default=DECODE_SWEEP_SHAPES,
                        help="shapes of the decode sweep, batch:context[-longest],...")
    parser.add_argument("--longest-first", action="store_true",
                        help="the decode sweep's ragged rows sorted longest first")
    return parser.parse_args()


def main():
    args = parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    start = time.time()
    torch.manual_seed(0)
    fa = "yes" if flash_attn_with_kvcache else "not importable: Triton alone"
    emit(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  "
         f"triton {triton.__version__}  flash_attn: {fa}")
    copy_bw = copy_bandwidth()
    cache = Cache(max(BATCHES) * max(CONTEXTS), fp8=args.kv_cache_dtype == "fp8")
    if args.only != "prefill":
        run_decode(cache, copy_bw)
    if args.only != "decode":
        run_prefill(cache)
    if args.sweep:
        sweep(cache, copy_bw, args.sweep, args.tiles, args.decode_shapes, args.longest_first)
    emit(f"total {time.time() - start:.0f} s")
    save_report("bench_attention.txt")


if __name__ == "__main__":
    main()
