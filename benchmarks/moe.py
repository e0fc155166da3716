"""The fused MoE kernels against the unfused paths at Qwen3-30B-A3B's layer shape (128 experts, top
8, hidden 2048, expert intermediate 768), bf16, random weights and routing (CUDA):

    python -m benchmarks.moe                 # 1, 8, 64, 256 and 4096 tokens
    python -m benchmarks.moe --tokens 1 8    # chosen sizes
    python -m benchmarks.moe --sweep         # the fused path alone under candidate tiles

Per size: our fused path (align + gate/up + down + sum), our torch reference (a loop over experts),
transformers' Qwen3MoeExperts ("grouped_mm" and "eager"), each from a CUDA graph where it captures;
then the fused path's weight bytes per call against the copy bandwidth (its floor while it is
bandwidth bound), and the decode step's MoE floor for 1 and 8 streams of the whole model."""

import argparse
import itertools

import torch

from benchmarks.gpu_timing import bench, copy_bandwidth, emit, save_report
from nanovllm.kernels.moe import MoeTiles, fused_moe, moe_tiles
from nanovllm.layers.fused_moe import moe_reference, select_experts
from nanovllm.testing.tiny_model import QWEN3_30B_A3B as ARCH

E, TOP_K = ARCH["num_experts"], ARCH["num_experts_per_tok"]
H, INTER = ARCH["hidden_size"], ARCH["moe_intermediate_size"]
EXPERT_BYTES = 3 * H * INTER * 2  # gate, up and down in bf16


def inputs(T: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).bfloat16()

    x = rand(T, H)
    w13, w2 = rand(E, 2 * INTER, H, scale=H ** -0.5), rand(E, H, INTER, scale=INTER ** -0.5)
    weights, ids = select_experts(rand(T, E), TOP_K, renormalize=True)
    return x, w13, w2, weights, ids


def transformers_experts(w13, w2, implementation: str):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E,
                            num_experts_per_tok=TOP_K, experts_implementation=implementation)
    with torch.device("meta"):
        experts = Qwen3MoeExperts(config)
    experts.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)  # same [E, 2I, H] layout
    experts.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return experts


def expected_experts_hit(tokens: int) -> float:
    """Distinct experts a layer reads for `tokens` uniformly routed tokens (top-k, no repeats)."""
    return E * (1 - (1 - TOP_K / E) ** tokens)


def time_size(T: int, bandwidth: float):
    x, w13, w2, weights, ids = inputs(T)
    expected = moe_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)
    out = fused_moe(x, w13, w2, weights, ids)
    error = (out.float() - expected).abs().max().item()
    fused = bench(lambda: fused_moe(x, w13, w2, weights, ids))
    unfused = bench(lambda: moe_reference(x, w13, w2, weights, ids), quick=True)
    theirs = []
    for implementation in ("grouped_mm", "eager"):
        try:
            experts = transformers_experts(w13, w2, implementation)
            with torch.inference_mode():
                ms = bench(lambda e=experts: e(x, ids.long(), weights), quick=True)
            theirs.append(f"transformers {implementation} {ms:.3f} ms")
        except Exception as e:  # an implementation this transformers or GPU lacks
            theirs.append(f"transformers {implementation}: {type(e).__name__}")
    hit = len(torch.unique(ids))
    floor_ms = hit * EXPERT_BYTES / bandwidth * 1e3
    tiles = moe_tiles(T * TOP_K, E)
    emit(f"T={T:5d}: fused {fused:.3f} ms ({hit} experts hit, weight floor {floor_ms:.3f} ms, "
         f"{floor_ms / fused:.0%} of it; tiles {tiles.block_m}x{tiles.block_n}x{tiles.block_k}), "
         f"torch loop {unfused:.3f} ms ({unfused / fused:.1f}x), " + ", ".join(theirs)
         + f"; max |fused - fp32 reference| {error:.3g}")


def sweep_size(T: int):
    """The fused path's time under each candidate tile config; the default's and the best."""
    x, w13, w2, weights, ids = inputs(T)
    expected = fused_moe(x, w13, w2, weights, ids).float()
    default = moe_tiles(T * TOP_K, E)
    candidates = [default] + [
        MoeTiles(bm, bn, bk, group_m=1 if bm == 16 else 8, num_warps=warps, num_stages=stages)
        for bm, bn, bk, warps, stages in itertools.product((16, 32, 64), (32, 64, 128), (64, 128),
                                                           (4, 8), (3, 4))]
    results = []
    for tiles in candidates:
        try:
            out = fused_moe(x, w13, w2, weights, ids, tiles=tiles)
            torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
            results.append((bench(lambda t=tiles: fused_moe(x, w13, w2, weights, ids, tiles=t),
                                  quick=True), tiles))
        except Exception as e:  # out of shared memory or registers
            emit(f"  T={T} {tiles}: {type(e).__name__}"[:160])
    ms_default = results[0][0] if results and results[0][1] == default else float("nan")
    for ms, tiles in sorted(results, key=lambda r: r[0])[:3]:
        emit(f"T={T:5d}: {ms:.3f} ms {tiles} ({ms_default / ms:.2f}x the default, "
             f"{ms_default:.3f} ms)")


def decode_floor(bandwidth: float):
    """The decode step's weight bytes for S streams: attention, router, the experts hit, head."""
    layers, heads = ARCH["num_hidden_layers"], ARCH["num_attention_heads"]
    kv = ARCH["num_key_value_heads"]
    head_dim, vocab = ARCH["head_dim"], ARCH["vocab_size"]
    attention = H * (heads + 2 * kv) * head_dim + heads * head_dim * H
    for streams in (1, 8):
        experts = expected_experts_hit(streams)
        params = layers * (attention + E * H) + vocab * H
        total = 2 * params + layers * experts * EXPERT_BYTES
        emit(f"decode floor, {streams} stream(s): {experts:.1f} experts a layer, "
             f"{total / 2**30:.2f} GiB of weights a step = {total / bandwidth * 1e3:.3f} ms "
             f"({streams * bandwidth / total:,.0f} tok/s at most); bench.py --random-arch "
             f"qwen3-30b-a3b {'--single-stream' if streams == 1 else '--streams 8'} measures it")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 4096])
    parser.add_argument("--sweep", action="store_true", help="time candidate tile configs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs CUDA")
    bandwidth = copy_bandwidth()  # bytes moved a second, as the other benchmarks count it
    emit(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
         f"Qwen3-30B-A3B MoE layer: {E} experts, top {TOP_K}, hidden {H}, intermediate {INTER}")
    for T in args.tokens:
        sweep_size(T) if args.sweep else time_size(T, bandwidth)
    if not args.sweep:
        decode_floor(bandwidth)
    save_report("moe.txt")


if __name__ == "__main__":
    main()
