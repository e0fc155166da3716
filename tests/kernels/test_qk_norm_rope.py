"""The fused q/k RMSNorm + RoPE kernel against the torch ops it replaces, and its KV stores.

RoPE only is bit-exact. With the norm, the sum of squares is reduced in another order, so 1/rms may
differ in its last bits: 16-bit outputs are equal but for <= 1% of the elements (a dropped rounding
step makes it ~28%), each within 2 ulps of its head's largest |value|; float32 within 8 ulps.
"""

import pytest
import torch

from nanovllm import LLM
from nanovllm.kernels.attention.kv_cache import store_kvcache_torch, store_kvcache_triton
from nanovllm.kernels.gemm.split_k import SplitKSum
from nanovllm.kernels.qk_norm_rope import V_STORE_TILE, _heads_per_program, qk_norm_rope
from nanovllm.layers.layernorm import rms_norm
from nanovllm.layers.rotary_embedding import RotaryEmbedding, apply_rope, default_inv_freq
from nanovllm.testing.tiny_model import write_tiny_llama
from tests.conftest import needs_cuda

MAX_POSITION = 40960
EPS = 1e-6

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, norm, device=DEVICE, seed=0):
    """qkv [T, (H + 2 KVH) * D], positions [T] (the largest, and 0), cos/sin, norm weights."""
    gen = torch.Generator().manual_seed(seed)
    qkv = 3 * torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen)
    positions[-1] = MAX_POSITION - 1
    if num_tokens > 1:
        positions[0] = 0
    cos_sin_cache = RotaryEmbedding(default_inv_freq(head_dim, 1e6), MAX_POSITION).cos_sin_cache
    weights = [2 * torch.rand(head_dim, generator=gen) for _ in range(2)] if norm else [None, None]
    to = dict(device=device, dtype=dtype)
    return (qkv.to(**to), positions.to(device), cos_sin_cache.to(device),
            *[w if w is None else w.to(**to) for w in weights])


def reference(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim, q_weight, k_weight):
    """DecoderAttention's torch path."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim)
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, EPS), rms_norm(k, k_weight, EPS)
    return apply_rope(positions, q, k, cos_sin_cache)


def head_ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| in ulps of the dtype at the largest |ref| of each head."""
    largest = ref.float().abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(ref.dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(largest))) * torch.finfo(ref.dtype).eps
    return ((out.float() - ref.float()).abs() / ulp).max().item()


def assert_matches(out: torch.Tensor, ref: torch.Tensor, norm: bool):
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    if not norm:
        assert torch.equal(out, ref)
    elif ref.dtype == torch.float32:
        assert head_ulps(out, ref) <= 8
    else:
        assert (out != ref).float().mean().item() <= 0.01
        assert head_ulps(out, ref) <= 2


def check(num_tokens, num_heads, num_kv_heads, head_dim, dtype, norm, device=DEVICE,
          heads_per_program=None):
    inputs = make_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, norm, device)
    q, k, v = qk_norm_rope(*inputs[:3], num_heads, num_kv_heads, head_dim, *inputs[3:], eps=EPS,
                           heads_per_program=heads_per_program)
    ref_q, ref_k = reference(*inputs[:3], num_heads, num_kv_heads, head_dim, *inputs[3:])
    assert_matches(q, ref_q, norm)
    assert_matches(k, ref_k, norm)
    qkv = inputs[0]
    v_heads = qkv[:, -num_kv_heads * head_dim:]
    assert v.data_ptr() == v_heads.data_ptr()  # a view of qkv's v heads
    assert torch.equal(v, v_heads.view(num_tokens, num_kv_heads, head_dim))


def make_slots(num_tokens, num_slots, device=DEVICE, seed=0) -> torch.Tensor:
    """slot_mapping [T]: distinct random slots, tokens 3 and 11 (if any) -1."""
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:num_tokens]
    slots[[i for i in (3, 11) if i < num_tokens]] = -1
    return slots.to(device)


def nan_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, fp8, device=DEVICE) -> dict:
    """A layer's caches, NaN-filled, as qk_norm_rope's keyword arguments."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    v_shape = (num_blocks, num_kv_heads, head_dim, block_size) if fp8 else shape
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    cache = {name: torch.full(size, float("nan"), device=device).to(cache_dtype)
             for name, size in (("k_cache", shape), ("v_cache", v_shape))}
    if fp8:
        scale_shape = (num_blocks, num_kv_heads, block_size)
        cache |= {name: torch.full(scale_shape, float("nan"), device=device)
                  for name in ("k_scale", "v_scale")}
    return cache


def reference_stores(fp8: bool, device: str) -> list:
    """The stores the kernel's writes must equal exactly: for fp8 on CUDA the Triton store only
    (torch there divides by 448 through a reciprocal, so a scale's last bit may differ)."""
    if fp8 and device == "cuda":
        return [store_kvcache_triton]
    return [store_kvcache_torch, store_kvcache_triton]


def check_store(num_tokens, num_heads, num_kv_heads, head_dim, dtype, block_size, fp8, norm=True,
                device=DEVICE, heads_per_program=None, v_store_tile=0, slots=None):
    """The cache holds exactly the KV store's writes of the returned k and of v (the rest NaN);
    q and k as accurate as without the store. slots: default make_slots."""
    inputs = make_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, norm, device)
    num_blocks = (num_tokens + block_size - 1) // block_size + 2
    if slots is None:
        slots = make_slots(num_tokens, num_blocks * block_size, device)
    slots = slots.to(device)
    cache_args = (num_blocks, block_size, num_kv_heads, head_dim, dtype, fp8, device)
    cache = nan_cache(*cache_args)
    args = (*inputs[:3], num_heads, num_kv_heads, head_dim, *inputs[3:])
    q, k, _ = qk_norm_rope(*args, eps=EPS, slot_mapping=slots, heads_per_program=heads_per_program,
                           v_store_tile=v_store_tile, **cache)
    ref_q, ref_k = reference(*inputs[:3], num_heads, num_kv_heads, head_dim, *inputs[3:])
    assert_matches(q, ref_q, norm)
    assert_matches(k, ref_k, norm)
    v = inputs[0][:, -num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    for store in reference_stores(fp8, device):
        expected = nan_cache(*cache_args)
        store(k, v, expected["k_cache"], expected["v_cache"], slots, expected.get("k_scale"),
              expected.get("v_scale"))
        for name in cache:
            torch.testing.assert_close(cache[name].float(), expected[name].float(), rtol=0, atol=0,
                                       equal_nan=True)
    written = slots[slots >= 0]
    assert cache["k_cache"].view(-1, num_kv_heads, head_dim)[written].float().isfinite().all()
    if not fp8:
        v_cache = cache["v_cache"].view(-1, num_kv_heads, head_dim)
        assert torch.equal(v_cache[written], v[slots >= 0])


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_one_token(head_dim, dtype, norm):
    check(1, 4, 2, head_dim, dtype, norm)


@pytest.mark.parametrize("head_dim, dtype, norm", [
    (128, torch.float32, True), (128, torch.bfloat16, True), (64, torch.float16, True),
    (64, torch.bfloat16, False),
], ids=str)
@pytest.mark.parametrize("heads_per_program", [1, 2])
def test_many_tokens(head_dim, dtype, norm, heads_per_program):
    check(37, 4, 2, head_dim, dtype, norm, heads_per_program=heads_per_program)


@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,heads", [
    (63, 16, 8, 1), (64, 16, 8, 8), (256, 32, 16, 8), (256, 14, 2, 2), (256, 12, 4, 4),
    (1000, 7, 1, 1),
])
def test_heads_per_program(num_tokens, num_heads, num_kv_heads, heads):
    assert _heads_per_program(num_tokens, num_heads, num_kv_heads) == heads


@pytest.mark.parametrize("fp8", [False, True], ids=["model_dtype_cache", "fp8_cache"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads_per_program", [1, 2])
def test_stores_k_and_v_as_the_kv_store(dtype, fp8, heads_per_program):
    check_store(37, 4, 2, 64, dtype, 16, fp8, heads_per_program=heads_per_program)


@pytest.mark.parametrize("fp8", [False, True], ids=["model_dtype_cache", "fp8_cache"])
@pytest.mark.parametrize("block_size", [1, 256])
def test_stores_at_other_block_sizes(block_size, fp8):
    check_store(37, 4, 2, 64, torch.bfloat16, block_size, fp8)


def test_stores_k_and_v_with_rope_only():
    check_store(37, 4, 2, 128, torch.bfloat16, 16, fp8=True, norm=False)


@pytest.mark.parametrize("fp8", [False, True], ids=["model_dtype_cache", "fp8_cache"])
@pytest.mark.parametrize("contiguous", [False, True], ids=["random_slots", "prefill_slots"])
def test_stores_v_by_tiles_of_tokens(fp8, contiguous):
    """v_store_tile: an fp8 V stored by tiles of 16 tokens (the last ragged), at random slots or
    a prefill's consecutive ones; a model-dtype cache ignores it."""
    slots = torch.arange(37) + 5 if contiguous else None
    check_store(37, 4, 2, 64, torch.bfloat16, 16, fp8, v_store_tile=16, slots=slots)


def check_split_k_sum(num_tokens, num_heads, num_kv_heads, head_dim, splits, fp8, device=DEVICE,
                      heads_per_program=1):
    """Given split-K partials (SplitKSum), the kernel returns and stores exactly what it does
    given their sum; v is then a new tensor."""
    _, positions, cos_sin_cache, q_weight, k_weight = make_inputs(
        num_tokens, num_heads, num_kv_heads, head_dim, torch.bfloat16, True, device)
    gen = torch.Generator().manual_seed(1)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    parts = torch.randn(splits, num_tokens, width, generator=gen).to(device)
    partial, block_size = SplitKSum(parts, torch.bfloat16), 16
    qkv = partial.sum()
    num_blocks = (num_tokens + block_size - 1) // block_size + 2
    slots = make_slots(num_tokens, num_blocks * block_size, device)
    caches = [nan_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.bfloat16, fp8, device)
              for _ in range(2)]
    args = (positions, cos_sin_cache, num_heads, num_kv_heads, head_dim, q_weight, k_weight, EPS,
            slots)
    out = qk_norm_rope(partial, *args, **caches[0], heads_per_program=heads_per_program)
    expected = qk_norm_rope(qkv, *args, **caches[1], heads_per_program=heads_per_program)
    assert all(map(torch.equal, out, expected))
    assert out[2].is_contiguous() and out[2].data_ptr() != qkv.data_ptr()
    for name, cache in caches[0].items():
        torch.testing.assert_close(cache.float(), caches[1][name].float(), rtol=0, atol=0,
                                   equal_nan=True)
    # without a cache (the memory-profiling run) too
    assert all(map(torch.equal, qk_norm_rope(partial, *args[:-1]), qk_norm_rope(qkv, *args[:-1])))


@pytest.mark.parametrize("fp8", [False, True], ids=["model_dtype_cache", "fp8_cache"])
@pytest.mark.parametrize("splits, heads_per_program", [(1, 1), (3, 1), (3, 2)])
def test_split_k_sum_as_qkv(splits, heads_per_program, fp8):
    check_split_k_sum(5, 4, 2, 64, splits, fp8, heads_per_program=heads_per_program)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_decoder_attention_fused_path_matches_torch_path(family, tiny_model, tmp_path):
    """DecoderAttention.norm_rope hands the kernel its layer's heads, norm, cos/sin and cache."""
    path = tiny_model
    if family == "llama":
        path = str(tmp_path)
        write_tiny_llama(path)
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=8) as llm:
        attn = llm.llm_engine.model_runner.model.model.layers[1].self_attn
        weight = attn.qkv_proj.weight
        qkv = torch.randn(5, (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim).to(weight)
        positions = torch.tensor([0, 1, 17, 500, 1023], device=weight.device)
        fused = attn.norm_rope(positions, qkv, fused=True)
        torch_path = attn.norm_rope(positions, qkv, fused=False)
        slots = torch.tensor([3, -1, 20, 127, 64], device=weight.device)
        cache = attn.attn.kv_cache_views()
        expected = {name: x.clone() for name, x in cache.items() if x is not None}
        assert all(map(torch.equal, fused, attn.norm_rope(positions, qkv, True, slots)))
        v = qkv[:, -attn.num_kv_heads * attn.head_dim:].view(5, attn.num_kv_heads, attn.head_dim)
        store_kvcache_torch(fused[1], v, expected["k_cache"], expected["v_cache"], slots)
        for name, x in expected.items():
            torch.testing.assert_close(cache[name], x, rtol=0, atol=0, equal_nan=True)
        attn.attn.k_cache = torch.tensor([])  # before the pool exists: nothing to store
        assert attn.attn.kv_cache_views() == {}
        assert all(map(torch.equal, fused, attn.norm_rope(positions, qkv, True, slots)))
    for out, ref in zip(fused[:2], torch_path[:2]):
        assert_matches(out, ref, norm=family == "qwen3")
    assert torch.equal(fused[2], torch_path[2])  # v: qkv's last heads


@needs_cuda
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope_only"])
@pytest.mark.parametrize("num_tokens", [1, 256, 1000])
def test_qwen3_0_6b_shapes_on_cuda(num_tokens, norm):
    check(num_tokens, 16, 8, 128, torch.bfloat16, norm, device="cuda")


@needs_cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16_cache", "fp8_cache"])
@pytest.mark.parametrize("num_tokens", [1, 256, 1000])
def test_qwen3_0_6b_store_on_cuda(num_tokens, fp8):
    check_store(num_tokens, 16, 8, 128, torch.bfloat16, 256, fp8, device="cuda")


@needs_cuda
@pytest.mark.parametrize("num_tokens", [256, 1000])
def test_qwen3_0_6b_v_store_by_tiles_on_cuda(num_tokens):
    check_store(num_tokens, 16, 8, 128, torch.bfloat16, 256, True, device="cuda",
                v_store_tile=V_STORE_TILE, slots=torch.arange(num_tokens) + 100)


@needs_cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16_cache", "fp8_cache"])
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_qwen3_0_6b_split_k_sum_on_cuda(num_tokens, fp8):
    check_split_k_sum(num_tokens, 16, 8, 128, 2, fp8, device="cuda")


@needs_cuda
def test_cuda_graph_replay():
    qkv, positions, cos_sin_cache, q_weight, k_weight = make_inputs(8, 16, 8, 128, torch.bfloat16,
                                                                    True, "cuda")
    args = (cos_sin_cache, 16, 8, 128, q_weight, k_weight)
    slots, cache = make_slots(8, 64, "cuda"), nan_cache(4, 16, 8, 128, torch.bfloat16, True, "cuda")
    qk_norm_rope(qkv, positions, *args, slot_mapping=slots, **cache)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, k, _ = qk_norm_rope(qkv, positions, *args, slot_mapping=slots, **cache)
    new_qkv, new_positions = make_inputs(8, 16, 8, 128, torch.bfloat16, True, "cuda", seed=1)[:2]
    new_slots = make_slots(8, 64, "cuda", seed=1)
    expected_cache = {name: x.clone() for name, x in cache.items()}
    for x, new in ((qkv, new_qkv), (positions, new_positions), (slots, new_slots)):
        x.copy_(new)
    graph.replay()
    expected_q, expected_k, _ = qk_norm_rope(new_qkv, new_positions, *args, slot_mapping=new_slots,
                                             **expected_cache)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    for name, x in cache.items():
        torch.testing.assert_close(x.float(), expected_cache[name].float(), rtol=0, atol=0,
                                   equal_nan=True)
