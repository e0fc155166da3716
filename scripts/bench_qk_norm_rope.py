"""Time the fused q/k norm + RoPE (+ KV store) kernel of a decode step on a CUDA GPU (written for an H200).

    python scripts/bench_qk_norm_rope.py

Qwen3-0.6B heads (16 q, 8 kv, head_dim 128), bf16, 256-token pages. Each token goes to its own random
block, as a decode step's tokens do (one per sequence). Three stores: none, into a bf16 cache, into an
fp8 cache (whose V is laid out tokens-contiguous, so a token's V head lands in 128 bytes 256 apart).
Then prefill steps, whose tokens fill consecutive slots: the fp8 V stored by each token's program, or by
tiles of V_STORE_TILE tokens (the engine's prefill path), against the bf16 store.
Last, a decode step's fp8 store after a gather has read the sectors it writes into L2: what the store's
one-byte writes cost in DRAM reads (BENCHMARKS.md, twentieth session).
Times are medians over CUDA-graph replays (scripts/gpu_timing.py); the table is printed and, if $OUT is
set, written to $OUT/bench_qk_norm_rope.txt.
"""

import functools

import torch
from gpu_timing import bench, emit, save_report  # scripts/gpu_timing.py

from nanovllm.kernels.qk_norm_rope import MANY_TOKENS, V_STORE_TILE, qk_norm_rope
from nanovllm.layers.rotary_embedding import RotaryEmbedding, default_inv_freq

H, KVH, D, PAGE, BLOCKS = 16, 8, 128, 256, 4096  # 16,384 tokens from block 7 fit
DEV, DTYPE = "cuda", torch.bfloat16


def caches(fp8: bool) -> dict:
    """A layer's cache as Attention.kv_cache_views gives it."""
    dtype = torch.float8_e4m3fn if fp8 else DTYPE
    k = torch.zeros(BLOCKS, PAGE, KVH, D, dtype=dtype, device=DEV)
    if not fp8:
        return dict(k_cache=k, v_cache=torch.zeros_like(k))
    scale = torch.ones(BLOCKS, KVH, PAGE, device=DEV)
    return dict(k_cache=k, v_cache=torch.zeros(BLOCKS, KVH, D, PAGE, dtype=dtype, device=DEV), k_scale=scale,
                v_scale=scale.clone())


def main():
    rope = RotaryEmbedding(default_inv_freq(D, 1e6), 4096).to(DEV)
    weights = [torch.randn(D, dtype=DTYPE, device=DEV) for _ in range(2)]
    emit(f"{torch.cuda.get_device_name()}: qk_norm_rope, H={H} KVH={KVH} D={D}, us per call; h1 / h8: one / "
         f"eight heads per program (default: h1 below {MANY_TOKENS} tokens)")
    emit(f"{'tokens':>6} " + " ".join(f"{cache + ' ' + h:>11}" for cache in ("no store", "bf16", "fp8")
                                      for h in ("h1", "h8")))
    for tokens in (1, 8, 16, 32, 64, 128, 256, 1024):
        qkv = torch.randn(tokens, (H + 2 * KVH) * D, dtype=DTYPE, device=DEV)
        positions = torch.randint(0, 4096, (tokens,), device=DEV)
        slots = torch.randperm(BLOCKS, device=DEV)[:tokens] * PAGE + torch.randint(0, PAGE, (tokens,), device=DEV)
        row = [f"{tokens:>6}"]
        for store in (None, False, True):
            kv = {} if store is None else dict(slot_mapping=slots, **caches(store))
            for heads in (1, 8):
                call = functools.partial(qk_norm_rope, qkv, positions, rope.cos_sin_cache, H, KVH, D, *weights,
                                         heads_per_program=heads, **kv)
                row.append(f"{bench(call) * 1e3:11.2f}")
        emit(" ".join(row))
    emit(f"prefill (consecutive slots), us per call, default heads per program: bf16 store; fp8 store with V "
         f"by each token's program / by tiles of {V_STORE_TILE} tokens")
    for tokens in (1024, 4096, 16384):
        qkv = torch.randn(tokens, (H + 2 * KVH) * D, dtype=DTYPE, device=DEV)
        positions = torch.arange(tokens, device=DEV) % 4096
        slots = torch.arange(tokens, device=DEV) + 7 * PAGE
        times = []
        for fp8, tile in ((False, 0), (True, 0), (True, V_STORE_TILE)):
            call = functools.partial(qk_norm_rope, qkv, positions, rope.cos_sin_cache, H, KVH, D, *weights,
                                     slot_mapping=slots, v_store_tile=tile, **caches(fp8))
            times.append(bench(call) * 1e3)
        emit(f"{tokens:>6} " + " ".join(f"{t:11.2f}" for t in times))
    decode_store_in_l2(rope, weights)
    save_report("bench_qk_norm_rope.txt")


def decode_store_in_l2(rope, weights):
    """Whether a decode step's fp8 V store is slow because its one-byte writes land in sectors L2 must first
    read from DRAM: the kernel timed after a gather has read those sectors (and the scales') into L2, minus
    the gather alone, against the kernel alone (L2 flushed before each replay) and the bf16 store."""
    emit("decode fp8 store, us per call: kernel alone / after a gather of its V and scale sectors (minus the "
         "gather) / the gather / bf16 store")
    for tokens in (64, 256, 1024):
        emit(f"{tokens:>6} " + " ".join(f"{t:11.2f}" for t in _store_in_l2_times(rope, weights, tokens)))


def _store_in_l2_times(rope, weights, tokens):
    qkv = torch.randn(tokens, (H + 2 * KVH) * D, dtype=DTYPE, device=DEV)
    positions = torch.randint(0, 4096, (tokens,), device=DEV)
    blocks, offsets = torch.randperm(BLOCKS, device=DEV)[:tokens], torch.randint(0, PAGE, (tokens,), device=DEV)
    fp8 = caches(True)
    call, bf16 = (functools.partial(qk_norm_rope, qkv, positions, rope.cos_sin_cache, H, KVH, D, *weights,
                                    slot_mapping=blocks * PAGE + offsets, **cache) for cache in (fp8, caches(False)))

    def gather():
        fp8["v_cache"].view(torch.uint8)[blocks, :, :, offsets].sum()
        fp8["v_scale"][blocks, :, offsets].sum()
        fp8["k_scale"][blocks, :, offsets].sum()

    def gather_then_call():
        gather()
        call()

    t_call, t_gather, t_both, t_bf16 = (bench(f) * 1e3 for f in (call, gather, gather_then_call, bf16))
    return t_call, t_both - t_gather, t_gather, t_bf16


if __name__ == "__main__":
    main()
