"""What a decode step's fp8 V store costs by layout and access pattern, alone (written for an H200).

    python scripts/bench_v_store.py             # 64, 128 and 256 tokens (~10 s)

A decode step writes one token's V head of each sequence: 8 kv heads x 128 dims of fp8. The engine's fp8 V cache
is [blocks, kv_heads, head_dim, block_size] (a token's elements block_size apart), so the store is 128 one-byte
writes to 128 sectors per head; at batch 256 it made the q/k norm + RoPE kernel ~10 us a layer slower than with
a bf16 cache (BENCHMARKS.md, eighteenth and thirtieth sessions). Variants, each a Triton kernel writing the tokens'
V (bf16 in, fp8 out, a fixed scale) to random distinct blocks of a pool larger than L2:

  bytes/8h/1w   one-byte writes, a one-warp program per token and 8 heads (the engine's q/k norm kernel from 64 tokens)
  bytes/1h/1w   one-byte writes, a one-warp program per token and head
  bytes/8h/4w   one-byte writes, a four-warp program per token and 8 heads
  rmw32/1h      each head's 128 sectors read whole, the token's byte replaced, written whole (32-byte writes)
  panel16/1h    a [blocks, kv_heads, head_dim / 16, block_size, 16] layout: a head is 8 writes of 16 bytes
  tokens/1h     a token-major layout, [blocks, block_size, kv_heads, head_dim]: a head is 128 contiguous bytes
  runsR/8h      [blocks, kv_heads, block_size / R, head_dim, R] (runs of R = 8, 16, 32, 64 tokens contiguous:
                128 x R / 32 sectors a head, R >= 32: 128), a one-warp program per token and 8 heads
  prefetch/8h   no store: the lines bytes/8h writes, prefetched into L2 (prefetch.global.L2)
  pf+bytes/8h   prefetch/8h, then bytes/8h: what the store costs once its lines are in L2 (minus prefetch/8h)

Times are medians of CUDA-graph replays with L2 flushed (scripts/gpu_timing.py), so every sector starts in DRAM.

H200, thirtieth session, 256 tokens: bytes/8h/1w 24.2 us, rmw32 20.5, pf+bytes 24.0 (prefetch alone 13.2), runs16
6.9, panel16 and tokens 6.1-6.6; thirty-first: runs8 6.3, runs16 6.8, runs32 8.4, runs64 12.8, bytes 23.9. Above a
~6 us floor the cost follows the lines a head's write touches, not whether they are written whole or already in L2.
(In the engine, runs of 16 made the decode kernel 1.2-1.5x slower, and runs of 32 4-5% slower at batch 256, which
ate the store's saving; the prefetch, before the q/k norm kernel's PDL wait, made that kernel slower: BENCHMARKS.md.)
"""

import torch
import triton
import triton.language as tl
from gpu_timing import bench, emit, save_report  # scripts/gpu_timing.py

from nanovllm.kernels.device import prefetch_to_l2

KVH, D, PAGE = 8, 128, 256
POOL_BLOCKS = 4096  # 4,096 blocks x 8 heads x 128 x 256 bytes = 1 GiB per cache


@triton.jit
def _store_kernel(v_ptr, slot_ptr, cache_ptr, HEADS: tl.constexpr, D: tl.constexpr, KVH: tl.constexpr,
                  PAGE: tl.constexpr, LAYOUT: tl.constexpr, RUN: tl.constexpr):
    """LAYOUT 0: bytes (dim-major); 1: rmw32 (dim-major, whole sectors); 2: panel16; 3: token-major; 4: runs of RUN
    tokens; 5: no store, bytes' lines prefetched into L2."""
    token = tl.program_id(0)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
    d = tl.arange(0, D)[None, :]  # [1, D]
    slot = tl.load(slot_ptr + token)
    block, offset = slot // PAGE, slot % PAGE
    v = (tl.load(v_ptr + (token * KVH + heads) * D + d).to(tl.float32) / 0.01).to(tl.float8e4nv)  # a fixed scale
    if LAYOUT == 0:
        tl.store(cache_ptr + ((block * KVH + heads) * D + d) * PAGE + offset, v)
    elif LAYOUT == 1:  # [HEADS * D, 32]: the sector of each dim holding the token, rewritten whole
        rows = tl.reshape((block * KVH + heads) * D + d, (HEADS * D, 1)) * PAGE + (offset // 32) * 32
        lane = tl.arange(0, 32)[None, :]
        old = tl.load(cache_ptr + rows + lane)
        new = tl.reshape(v, (HEADS * D, 1))
        tl.store(cache_ptr + rows + lane, tl.where(lane == offset % 32, new, old))
    elif LAYOUT == 2:
        tl.store(cache_ptr + (((block * KVH + heads) * (D // 16) + d // 16) * PAGE + offset) * 16 + d % 16, v)
    elif LAYOUT == 3:
        tl.store(cache_ptr + ((block * PAGE + offset) * KVH + heads) * D + d, v)
    elif LAYOUT == 4:
        tl.store(cache_ptr + (((block * KVH + heads) * (PAGE // RUN) + offset // RUN) * D + d) * RUN + offset % RUN, v)
    else:
        prefetch_to_l2(cache_ptr + ((block * KVH + heads) * D + d) * PAGE + offset)


VARIANTS = {  # name: (heads a program, warps, the layouts of the kernels launched one after another, RUN)
    "bytes/8h/1w": (8, 1, (0,), 0), "bytes/1h/1w": (1, 1, (0,), 0), "bytes/8h/4w": (8, 4, (0,), 0),
    "rmw32/1h": (1, 1, (1,), 0), "panel16/1h": (1, 1, (2,), 0), "tokens/1h": (1, 1, (3,), 0),
    "runs8/8h": (8, 1, (4,), 8), "runs16/8h": (8, 1, (4,), 16), "runs32/8h": (8, 1, (4,), 32),
    "runs64/8h": (8, 1, (4,), 64), "prefetch/8h": (8, 1, (5,), 0), "pf+bytes/8h": (8, 1, (5, 0), 0),
}


def main():
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    emit(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    torch.manual_seed(0)
    cache = torch.zeros(POOL_BLOCKS * KVH * D * PAGE, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    emit(f"== one decode step's fp8 V store ({KVH} kv heads x {D}), us, L2 flushed; token rows at random blocks")
    emit(f"{'tokens':>6} " + " ".join(f"{name:>12}" for name in VARIANTS))
    for tokens in (64, 128, 256):
        blocks = torch.randperm(POOL_BLOCKS, device="cuda")[:tokens]
        slots = blocks * PAGE + torch.randint(0, PAGE, (tokens,), device="cuda")
        v = torch.randn(tokens, KVH, D, dtype=torch.bfloat16, device="cuda")
        times = []
        for heads, warps, layouts, run in VARIANTS.values():
            def store(heads=heads, warps=warps, layouts=layouts, run=run, tokens=tokens, v=v, slots=slots):
                for layout in layouts:
                    _store_kernel[(tokens, KVH // heads)](v, slots, cache, HEADS=heads, D=D, KVH=KVH, PAGE=PAGE,
                                                          LAYOUT=layout, RUN=run, num_warps=warps)
            times.append(bench(store) * 1e3)
        emit(f"{tokens:>6} " + " ".join(f"{t:12.2f}" for t in times))
    save_report("bench_v_store.txt")


if __name__ == "__main__":
    main()
