"""Every Triton kernel goes through Triton's front end for sm_90 with the GPU's dtypes: the CPU
interpreter does not type-check kernels as the compiler does. Building the IR needs no GPU; it runs
in a subprocess without the interpreter (run this file as a script to see the kernels it compiles).
"""

import inspect
import os
import subprocess
import sys

import pytest

# A configuration: (module, kernel, pointer dtypes by name, float parameters, constexprs).
BF16_ATTENTION = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16",
                  "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
                  "cu_seqlens_q_ptr": "*i32", "order_ptr": "*i32", "split_counts_ptr": "*i32"}
FP8_ATTENTION = {**BF16_ATTENTION, "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"}
# The decode kernel's from_qkv arguments: the qkv projection's split-K partials.
FROM_QKV = {"qkv_ptr": "*fp32", "positions_ptr": "*i64", "q_weight_ptr": "*bf16",
            "k_weight_ptr": "*bf16", "slot_mapping_ptr": "*i64"}
# stride_vd / stride_vt: V's unit stride, which Triton specializes as a constant 1.
DECODE = dict(G=2, G_PAD=16, D=128, PAGE=256, BLOCK_N=64, NUM_SPLITS=4, DOT_PRECISION="tf32",
              FP8=False, ORDERED=True, PDL=True, PREFETCH=False, LAST_SPLIT_MERGES=True,
              MERGE_HEADS=2, FROM_QKV=False, QKV_SPLITS=0, HAS_NORM=False, NUM_KV_HEADS=8,
              stride_vd=1)
PREFILL = dict(G=2, D=128, PAGE=256, BLOCK_M=128, BLOCK_N=128, DOT_PRECISION="tf32", FP8=False,
               PAGED=True, stride_vd=1)
VARLEN = dict(PAGE=0, PAGED=False)  # varlen_prefill_attention: plain K/V, no pages
FP8_V = dict(FP8=True, stride_vd=None, stride_vt=1)  # merged into a configuration: None drops a key
STORE = dict(D=1024, BLOCK_D=1024, HEAD_DIM=128, PAGE=256, FP8=False)
QK_NORM_ROPE = {"qkv_ptr": "*bf16", "positions_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16",
                "v_ptr": "*bf16", "q_weight_ptr": "*bf16", "k_weight_ptr": "*bf16",
                "slot_mapping_ptr": "*i64"}  # k/v_scale_ptr: *fp32
QK_NORM_ROPE_CONSTEXPRS = dict(NUM_HEADS=16, NUM_KV_HEADS=8, D=128, HEADS=8, QKV_SPLITS=0,
                               HAS_NORM=True, STORE=False, PAGE=256, FP8=False, PDL=True)
SKINNY_POINTERS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16"}
SKINNY = dict(HAS_BIAS=True, EVEN_K=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=4, PDL=True,
              PREFETCH_LINES=4, GATED=False, X_SPLITS=0, X_HEAD_DIM=0, X_GATED=False, X_ROWS=0)
NORM_POINTERS = {name: "*bf16" for name in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
SAMPLER = {"logits_ptr": "*bf16", "tokens_ptr": "*i64", "arrivals_ptr": "*i32", "out_ptr": "*i64",
           "seed_ptr": "*i64"}
SEARCH = {"logits_ptr": "*bf16", "active_ptr": "*i8", "lo_ptr": "*i32", "arrivals_ptr": "*i32"}
SEARCH_SIZES = dict(NUM_BUCKETS=16, NUM_BINS=32, BLOCK=512)


def merge(*dicts: dict) -> dict:
    """The dicts merged left to right; a None value removes its key."""
    merged = {}
    for d in dicts:
        merged.update(d)
    return {k: v for k, v in merged.items() if v is not None}


def attention_configurations(fp16: dict) -> dict:
    decode, prefill = "nanovllm.kernels.attention.decode", "nanovllm.kernels.attention.prefill"
    kv_cache = "nanovllm.kernels.attention.kv_cache"
    fp8_decode = merge(DECODE, fp16, FP8_V, {"G_PAD": 8, "BLOCK_N": 128})
    from_qkv = {"FROM_QKV": True, "QKV_SPLITS": 4, "HAS_NORM": True}
    store_pointers = {"key_ptr": "*bf16", "value_ptr": "*bf16", "k_cache_ptr": "*bf16",
                      "v_cache_ptr": "*bf16", "slot_mapping_ptr": "*i64"}
    fp8_caches = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
    return {
        "decode bf16": (decode, "_decode_kernel", BF16_ATTENTION, ["sm_scale_log2"],
                        {**DECODE, **fp16}),
        "decode fp8": (decode, "_decode_kernel", FP8_ATTENTION, ["sm_scale_log2"],
                       {**fp8_decode, "NUM_SPLITS": 1}),
        "decode fp8, from qkv": (decode, "_decode_kernel", {**FP8_ATTENTION, **FROM_QKV},
                                 ["sm_scale_log2", "eps"], {**fp8_decode, **from_qkv}),
        "decode bf16, from qkv": (decode, "_decode_kernel", {**BF16_ATTENTION, **FROM_QKV},
                                  ["sm_scale_log2", "eps"], {**DECODE, **fp16, **from_qkv}),
        "decode fp8, prefetch": (decode, "_decode_kernel", FP8_ATTENTION, ["sm_scale_log2"],
                                 {**fp8_decode, "PREFETCH": True}),
        "decode bf16, prefetch": (decode, "_decode_kernel", BF16_ATTENTION, ["sm_scale_log2"],
                                  {**DECODE, **fp16, "PREFETCH": True, "NUM_SPLITS": 16,
                                   "LAST_SPLIT_MERGES": False}),
        "decode splits merge": ("nanovllm.kernels.attention.split_softmax", "_merge_kernel",
                                {"out_ptr": "*bf16"}, [], dict(D=128, NUM_SPLITS=16, PDL=True)),
        "prefill bf16": (prefill, "_prefill_kernel", BF16_ATTENTION, ["sm_scale_log2"],
                         {**PREFILL, **fp16}),
        "prefill fp8": (prefill, "_prefill_kernel", FP8_ATTENTION, ["sm_scale_log2"],
                        merge(PREFILL, fp16, FP8_V, {"BLOCK_M": 64, "BLOCK_N": 128})),
        "prefill varlen": (prefill, "_prefill_kernel", BF16_ATTENTION, ["sm_scale_log2"],
                           merge(PREFILL, fp16, VARLEN)),
        "dequantize fp8": (prefill, "_dequantize_kernel",
                           {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "k_out_ptr": "*bf16",
                            "v_out_ptr": "*bf16", "block_tables_ptr": "*i32",
                            "cu_seqlens_k_ptr": "*i32"}, [],
                           dict(D=128, PAGE=256, BLOCK_N=64, stride_vt=1)),
        "store bf16": (kv_cache, "_store_kvcache_kernel", store_pointers, [], STORE),
        "store fp8": (kv_cache, "_store_kvcache_kernel", {**store_pointers, **fp8_caches}, [],
                      {**STORE, "FP8": True}),
    }


def qk_norm_rope_configurations() -> dict:
    module, kernel = "nanovllm.kernels.qk_norm_rope", "_qk_norm_rope_kernel"
    fp8_caches = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
    fp8_store = {**QK_NORM_ROPE_CONSTEXPRS, "STORE": True, "FP8": True}
    return {
        "q/k norm + rope": (module, kernel, QK_NORM_ROPE, ["eps"], QK_NORM_ROPE_CONSTEXPRS),
        "q/k rope only": (module, kernel, QK_NORM_ROPE, ["eps"],  # no norm weights: None
                          {**QK_NORM_ROPE_CONSTEXPRS, "HAS_NORM": False, "q_weight_ptr": None,
                           "k_weight_ptr": None}),
        "q/k norm + rope + store": (module, kernel, {**QK_NORM_ROPE, "k_cache_ptr": "*bf16",
                                                     "v_cache_ptr": "*bf16"},
                                    ["eps"], {**QK_NORM_ROPE_CONSTEXPRS, "STORE": True}),
        "q/k norm + rope + fp8 store": (module, kernel, {**QK_NORM_ROPE, **fp8_caches}, ["eps"],
                                        fp8_store),
        "fp8 v store by tiles": (module, "_store_v_fp8_tiles_kernel",
                                 {"qkv_ptr": "*bf16", "slot_mapping_ptr": "*i64",
                                  "v_cache_ptr": "*fp8e4nv"}, [],
                                 dict(NUM_HEADS=16, NUM_KV_HEADS=8, D=128, PAGE=256, TILE=64,
                                      PDL=True)),
        "q/k norm + rope + fp8 store, split-k sum": (module, kernel,
                                                     {**QK_NORM_ROPE, **fp8_caches,
                                                      "qkv_ptr": "*fp32"}, ["eps"],
                                                     {**fp8_store, "HEADS": 1, "QKV_SPLITS": 2}),
    }


def other_configurations() -> dict:
    filters = "nanovllm.kernels.sampling_filters"
    skinny = "nanovllm.kernels.gemm.skinny"
    sampler = "nanovllm.kernels.sampling"
    norm = "nanovllm.kernels.norm"
    return {
        "sampler": (sampler, "_sample_kernel", SAMPLER, [],
                    dict(FILTERED=False, ROW_SEEDS=False, BLOCK=4096, MAX_CHUNKS=1, FAST_LOG=True)),
        "sampler, rows split": (sampler, "_sample_kernel", SAMPLER, [],
                                dict(FILTERED=False, ROW_SEEDS=False, BLOCK=1024, MAX_CHUNKS=256,
                                     FAST_LOG=True)),
        "sampler, filtered and seeded": (sampler, "_sample_kernel",
                                         {**SAMPLER, "row_seeds_ptr": "*i64"}, [],
                                         dict(FILTERED=True, ROW_SEEDS=True, BLOCK=1024,
                                              MAX_CHUNKS=4, FAST_LOG=True)),
        "structured outputs' token bitmask": ("nanovllm.kernels.token_bitmask",
                                              "_apply_bitmask_kernel",
                                              {"logits_ptr": "*bf16", "rows_ptr": "*i64",
                                               "bitmask_ptr": "*i32"}, [], dict(BLOCK=1024)),
        "embedding": ("nanovllm.kernels.embedding", "_embedding_kernel",
                      {"ids_ptr": "*i64", "weight_ptr": "*bf16", "out_ptr": "*bf16"}, [],
                      dict(BLOCK=1024, PDL=True)),
        "top-p search pass": (filters, "_search_pass_kernel", SEARCH, [],
                              dict(FIRST=True, KEY_SHIFT=16, **SEARCH_SIZES)),
        "top-p search pass, float32": (filters, "_search_pass_kernel",
                                       {**SEARCH, "logits_ptr": "*fp32"}, [],
                                       dict(FIRST=False, KEY_SHIFT=0, **SEARCH_SIZES)),
        "top-p search pass, one row": (filters, "_search_pass_kernel", SEARCH, [],
                                       dict(FIRST=True, KEY_SHIFT=16, NUM_BUCKETS=256,
                                            NUM_BINS=512, BLOCK=32)),
        "skinny gemm": (skinny, "_skinny_kernel", SKINNY_POINTERS, [], SKINNY),
        "skinny gemm, merging decode attention's splits": (
            skinny, "_skinny_kernel", {**SKINNY_POINTERS, "x_ptr": "*fp32"}, [],
            {**SKINNY, "HAS_BIAS": False, "SPLIT_K": 8, "X_SPLITS": 16, "X_HEAD_DIM": 128,
             "X_ROWS": 1}),
        "skinny gemm, activating gate/up partials": (
            skinny, "_skinny_kernel", {**SKINNY_POINTERS, "x_ptr": "*fp32"}, [],
            {**SKINNY, "HAS_BIAS": False, "SPLIT_K": 12, "X_SPLITS": 4, "X_GATED": True,
             "X_ROWS": 1}),
        "skinny gemm, gated (SwiGLU)": (
            skinny, "_skinny_kernel", {**SKINNY_POINTERS, "out_ptr": "*bf16"}, [],
            {**SKINNY, "HAS_BIAS": False, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 1,
             "PREFETCH_LINES": 16, "GATED": True}),
        "skinny split-k reduce": ("nanovllm.kernels.gemm.split_k", "_split_k_reduce_kernel",
                                  {"b_ptr": "*bf16", "y_ptr": "*bf16"}, [],
                                  dict(HAS_BIAS=True, BLOCK=1024, SPLIT_K=4, PDL=True)),
        "rms norm": (norm, "_rms_norm_kernel", NORM_POINTERS, ["eps"],
                     dict(X_SPLITS=0, HAS_RESIDUAL=True, BLOCK=1024, PDL=True)),
        "rms norm, no residual": (norm, "_rms_norm_kernel", NORM_POINTERS, ["eps"],
                                  dict(X_SPLITS=0, HAS_RESIDUAL=False, BLOCK=4096, PDL=False)),
        "rms norm, split-k sum": (norm, "_rms_norm_kernel", {**NORM_POINTERS, "x_ptr": "*fp32"},
                                  ["eps"], dict(X_SPLITS=4, HAS_RESIDUAL=True, BLOCK=1024,
                                                PDL=True)),
        "silu and mul": ("nanovllm.kernels.activation", "_silu_and_mul_kernel",
                         {"x_ptr": "*bf16", "out_ptr": "*bf16"}, [], dict(BLOCK=1024, PDL=True)),
    }


def moe_configurations() -> dict:
    moe = "nanovllm.kernels.moe"
    ids = {"topk_ids_ptr": "*i64", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32",
           "num_padded_ptr": "*i32", "cursor_ptr": "*i32"}
    gemm = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "weights_ptr": "*bf16", **ids}
    gate_up = dict(TOP_K=8, GATED=True, EVEN_K=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
                   GROUP_M=1)
    return {
        "moe align": (moe, "_align_kernel", ids, [],
                      dict(BLOCK_M=64, BINS=128, CHUNK=1024, SCATTER=False)),
        "moe align + scatter": (moe, "_align_kernel", ids, [],
                                dict(BLOCK_M=16, BINS=128, CHUNK=1024, SCATTER=True)),
        "moe scatter": (moe, "_scatter_kernel", ids, [], dict(CHUNK=1024)),
        "moe router top-k": ("nanovllm.kernels.moe_router", "_topk_softmax_kernel",
                             {"logits_ptr": "*bf16", "weights_ptr": "*bf16", "ids_ptr": "*i32"},
                             [], dict(TOP_K=8, K_PAD=8, RENORMALIZE=True, E_PAD=128, BLOCK_T=16)),
        "moe gate/up (SwiGLU)": (moe, "_grouped_gemm_kernel", gemm, [], gate_up),
        "moe down, uneven K": (
            moe, "_grouped_gemm_kernel", gemm, [],
            {**gate_up, "GATED": False, "EVEN_K": False, "BLOCK_M": 64, "BLOCK_N": 128,
             "BLOCK_K": 64, "GROUP_M": 8}),
        "moe down, float32 partials": (
            moe, "_grouped_gemm_kernel", {**gemm, "out_ptr": "*fp32"}, [],
            {**gate_up, "GATED": False}),
    }


def configurations():
    import triton.language as tl

    return {**attention_configurations(dict(FP8_COMPUTE=tl.float16)),
            **other_configurations(), **qk_norm_rope_configurations(), **moe_configurations()}


def kernel_source(module: str, kernel: str, pointers: dict, floats: list, constexprs: dict,
                  aligned: bool = False, divisible: tuple[str, ...] = ()):
    """Triton's ASTSource of a kernel: pointers as given (others *fp32), floats fp32, constexprs
    fixed, other arguments i32; with `aligned`, pointers and strides divisible by 16, as are the
    integers named in `divisible` (as the runtime specializes them)."""
    import importlib

    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), kernel)
    names = list(inspect.signature(fn.fn).parameters)
    assert set(constexprs) <= set(names), f"{kernel}: unknown constexpr"
    signature = {name: "constexpr" if name in constexprs
                 else pointers.get(name, "*fp32") if name.endswith("_ptr")
                 else "fp32" if name in floats else "i32" for name in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
             if name in divisible or (aligned and name not in constexprs
                                      and (name.endswith("_ptr") or name.startswith("stride")))}
    return ASTSource(fn, signature, {(names.index(k),): v for k, v in constexprs.items()}, attrs)


def build_ir(module: str, kernel: str, pointers: dict, floats: list, constexprs: dict) -> str:
    """Triton IR of the kernel for sm_90 (see kernel_source for the arguments)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = kernel_source(module, kernel, pointers, floats, constexprs)
    return str(source.make_ir(target, options, backend.get_codegen_implementation(options),
                              backend.get_module_map(), context))


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                            timeout=300)
    if "no Triton CUDA backend" in result.stdout:
        pytest.skip("this Triton has no CUDA backend to compile with")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count(": ok") == len(configurations())


SWIGLU_SHARED_MEMORY = """
try:
    import triton.backends.nvidia.compiler
except ImportError:
    print("no Triton CUDA backend")
    raise SystemExit(0)
from nanovllm.kernels.device import HOPPER_SHARED_MEMORY
from nanovllm.kernels.gemm.skinny import _block_m, gated_launch_config
from tests.kernels.test_kernels_compile_for_gpu import configurations
from tools.kernel_sass import compile_for_sm90
module, kernel, pointers, floats, constexprs = configurations()["skinny gemm, gated (SwiGLU)"]
for N, K, rows in [(12288, 4096, 16), (12288, 4096, 32), (3072, 1024, 32)]:
    c = gated_launch_config(N, K, 132, rows, HOPPER_SHARED_MEMORY)
    tiles = dict(BLOCK_M=_block_m(rows), BLOCK_N=c.block_n, BLOCK_K=c.block_k)
    compiled = compile_for_sm90((module, kernel, pointers, floats, {**constexprs, **tiles}),
                                c.num_warps, c.num_stages, ("K", "N", "stride_xm", "k_per_split"))
    print(N, K, rows, c.num_stages, compiled.metadata.shared)
"""


def test_swiglu_stages_fit_in_shared_memory_when_compiled():
    """skinny_swiglu's launch configs compiled for sm_90 (Qwen3-8B's gate/up at 16 and 32 rows,
    Qwen3-0.6B's at 32) use what gated_launch_config counts: (stages - 1) stages of the gate, up
    and x tiles, within the 227 KiB a program may use (4 stages at 32 rows would take 240 KiB)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", SWIGLU_SHARED_MEMORY], env=env,
                            capture_output=True, text=True, timeout=300)
    if "no Triton CUDA backend" in result.stdout:
        pytest.skip("this Triton has no CUDA backend to compile with")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [tuple(map(int, line.split())) for line in result.stdout.splitlines()]
    assert [(stages, shared) for *_, stages, shared in rows] == [
        (4, 3 * (2 * 64 + 16) * 256 * 2), (3, 2 * (2 * 64 + 32) * 256 * 2),
        (4, 3 * (2 * 16 + 32) * 256 * 2)]
    assert max(shared for *_, shared in rows) <= 232448


if __name__ == "__main__":
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError:
        print("no Triton CUDA backend")
        sys.exit(0)
    failed = False
    for name, config in configurations().items():
        try:
            build_ir(*config)
            print(f"{name}: ok")
        except Exception as error:  # report every kernel, not just the first failure
            failed = True
            print(f"{name}: FAILED\n{error}")
    sys.exit(1 if failed else 0)
