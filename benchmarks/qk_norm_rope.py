"""The fused q/k norm + RoPE kernel with its KV store (none, bf16, fp8), decode and prefill shapes.

    python -m benchmarks.qk_norm_rope
"""

import functools

import torch

from benchmarks.gpu_timing import bench, emit, save_report
from nanovllm.kernels.qk_norm_rope import MANY_TOKENS, V_STORE_TILE, qk_norm_rope
from nanovllm.layers.rotary_embedding import RotaryEmbedding, default_inv_freq

H, KVH, D, PAGE = 16, 8, 128, 256  # Qwen3-0.6B's heads
BLOCKS = 4096  # 16,384 prefill tokens from block 7 fit
DEV, DTYPE = "cuda", torch.bfloat16


def caches(fp8: bool) -> dict:
    """A layer's cache as Attention.kv_cache_views gives it."""
    dtype = torch.float8_e4m3fn if fp8 else DTYPE
    k = torch.zeros(BLOCKS, PAGE, KVH, D, dtype=dtype, device=DEV)
    if not fp8:
        return dict(k_cache=k, v_cache=torch.zeros_like(k))
    scale = torch.ones(BLOCKS, KVH, PAGE, device=DEV)
    v = torch.zeros(BLOCKS, KVH, D, PAGE, dtype=dtype, device=DEV)
    return dict(k_cache=k, v_cache=v, k_scale=scale, v_scale=scale.clone())


def random_slots(tokens):
    """Each token in its own random block, as a decode step's tokens are."""
    blocks = torch.randperm(BLOCKS, device=DEV)[:tokens]
    return blocks, torch.randint(0, PAGE, (tokens,), device=DEV)


def decode_table(rope, weights):
    emit(f"{torch.cuda.get_device_name()}: qk_norm_rope, H={H} KVH={KVH} D={D}, us per call; "
         f"h1 / h8: one / eight heads per program (default: h1 below {MANY_TOKENS} tokens)")
    columns = [f"{cache} {h}" for cache in ("no store", "bf16", "fp8") for h in ("h1", "h8")]
    emit(f"{'tokens':>6} " + " ".join(f"{column:>11}" for column in columns))
    for tokens in (1, 8, 16, 32, 64, 128, 256, 1024):
        qkv = torch.randn(tokens, (H + 2 * KVH) * D, dtype=DTYPE, device=DEV)
        positions = torch.randint(0, 4096, (tokens,), device=DEV)
        blocks, offsets = random_slots(tokens)
        slots = blocks * PAGE + offsets
        row = [f"{tokens:>6}"]
        for store in (None, False, True):
            kv = {} if store is None else dict(slot_mapping=slots, **caches(store))
            for heads in (1, 8):
                call = functools.partial(qk_norm_rope, qkv, positions, rope.cos_sin_cache, H, KVH,
                                         D, *weights, heads_per_program=heads, **kv)
                row.append(f"{bench(call) * 1e3:11.2f}")
        emit(" ".join(row))


def prefill_table(rope, weights):
    emit(f"prefill (consecutive slots), us per call, default heads per program: bf16 store; fp8 "
         f"store with V by each token's program / by tiles of {V_STORE_TILE} tokens")
    for tokens in (1024, 4096, 16384):
        qkv = torch.randn(tokens, (H + 2 * KVH) * D, dtype=DTYPE, device=DEV)
        positions = torch.arange(tokens, device=DEV) % 4096
        slots = torch.arange(tokens, device=DEV) + 7 * PAGE
        times = []
        for fp8, tile in ((False, 0), (True, 0), (True, V_STORE_TILE)):
            call = functools.partial(qk_norm_rope, qkv, positions, rope.cos_sin_cache, H, KVH, D,
                                     *weights, slot_mapping=slots, v_store_tile=tile, **caches(fp8))
            times.append(bench(call) * 1e3)
        emit(f"{tokens:>6} " + " ".join(f"{t:11.2f}" for t in times))


def decode_store_in_l2(rope, weights):
    """A decode step's fp8 store timed after a gather has read the sectors it writes (and their
    scales') into L2, less the gather: what its one-byte writes cost in DRAM reads."""
    emit("decode fp8 store, us per call: kernel alone / after a gather of its V and scale sectors "
         "(minus the gather) / the gather / bf16 store")
    for tokens in (64, 256, 1024):
        emit(f"{tokens:>6} " + " ".join(f"{t:11.2f}" for t in store_in_l2_times(rope, weights,
                                                                                  tokens)))


def store_in_l2_times(rope, weights, tokens):
    qkv = torch.randn(tokens, (H + 2 * KVH) * D, dtype=DTYPE, device=DEV)
    positions = torch.randint(0, 4096, (tokens,), device=DEV)
    blocks, offsets = random_slots(tokens)
    fp8 = caches(True)
    call, bf16 = (functools.partial(qk_norm_rope, qkv, positions, rope.cos_sin_cache, H, KVH, D,
                                    *weights, slot_mapping=blocks * PAGE + offsets, **cache)
                  for cache in (fp8, caches(False)))

    def gather():
        fp8["v_cache"].view(torch.uint8)[blocks, :, :, offsets].sum()
        fp8["v_scale"][blocks, :, offsets].sum()
        fp8["k_scale"][blocks, :, offsets].sum()

    def gather_then_call():
        gather()
        call()

    t_call, t_gather, t_both, t_bf16 = (bench(f) * 1e3 for f in (call, gather, gather_then_call,
                                                                  bf16))
    return t_call, t_both - t_gather, t_gather, t_bf16


def main():
    rope = RotaryEmbedding(default_inv_freq(D, 1e6), 4096).to(DEV)
    weights = [torch.randn(D, dtype=DTYPE, device=DEV) for _ in range(2)]
    decode_table(rope, weights)
    prefill_table(rope, weights)
    decode_store_in_l2(rope, weights)
    save_report("bench_qk_norm_rope.txt")


if __name__ == "__main__":
    main()
