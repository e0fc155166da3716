"""The KV store kernel and the attention backends against the torch reference."""

import pytest
import torch

from nanovllm.kernels.attention.kv_cache import (
    quantize_cache_fp8,
    quantize_fp8,
    store_kvcache_torch,
    store_kvcache_triton,
    v_token_major,
)
from nanovllm.kernels.gemm.skinny import SKINNY_MAX_ROWS
from nanovllm.kernels.gemm.split_k import SplitKSum
from nanovllm.kernels.qk_norm_rope import qk_norm_rope
from nanovllm.layers.attention import (
    DEQUANT_MIN_QUERIES,
    Attention,
    AttentionMetadata,
    dequantizing_pays,
    flash_attention,
    torch_attention,
    triton_attention,
    workspace_groups,
)
from tests.conftest import needs_cuda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

STORES = [store_kvcache_triton, store_kvcache_torch]


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 16), (3, 8), (8, 128)])
def test_store_kernel_matches_indexed_copy(num_kv_heads, head_dim):
    torch.manual_seed(0)
    num_blocks, block_size, num_tokens = 6, 16, 20
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, device=DEVICE)
    key, value = kv[:, 0], kv[:, 1]  # strided views, as the QKV split produces
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[3] = slots[11] = -1  # padding rows write nothing
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, float("nan"), device=DEVICE) for _ in range(4)]
    store_kvcache_triton(key, value, caches[0], caches[1], slots)
    store_kvcache_torch(key, value, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], equal_nan=True)
    torch.testing.assert_close(caches[1], caches[3], equal_nan=True)
    written = caches[0].view(-1, num_kv_heads, head_dim)[slots[slots >= 0]]
    torch.testing.assert_close(written, key[slots >= 0])


def fp8_caches(num_blocks, block_size, num_kv_heads, head_dim, fill) -> list[torch.Tensor]:
    """fp8 K and V caches (V's tokens contiguous) filled with `fill`."""
    shapes = ((num_blocks, block_size, num_kv_heads, head_dim),
              (num_blocks, num_kv_heads, head_dim, block_size))
    return [torch.full(shape, fill, device=DEVICE).to(torch.float8_e4m3fn) for shape in shapes]


@pytest.mark.parametrize("store", STORES, ids=["triton", "torch"])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 16), (3, 8), (8, 128)])
def test_fp8_store_never_saturates(store, num_kv_heads, head_dim):
    torch.manual_seed(0)
    num_blocks, block_size, num_tokens = 6, 16, 20
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, device=DEVICE)
    kv *= 10.0 ** torch.randint(-6, 9, (num_tokens, 2, num_kv_heads, 1), device=DEVICE)  # per head
    kv[0, :, 0] = 0  # an all-zero head
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[3] = slots[11] = -1
    caches = fp8_caches(num_blocks, block_size, num_kv_heads, head_dim, float("nan"))
    scales = [torch.full((num_blocks, num_kv_heads, block_size), float("nan"), device=DEVICE)
              for _ in range(2)]
    store(key, value, *caches, slots, *scales)
    valid = slots >= 0
    for x, cache, scale in zip((key, value), (caches[0], v_token_major(caches[1])), scales):
        cache = cache.float().reshape(-1, num_kv_heads, head_dim)
        scale = scale.transpose(1, 2).reshape(-1, num_kv_heads)
        assert cache[slots[valid]].isfinite().all() and scale[slots[valid]].isfinite().all()
        unwritten = torch.ones(len(cache), dtype=torch.bool, device=DEVICE)
        unwritten[slots[valid]] = False
        assert cache[unwritten].isnan().all() and scale[unwritten].isnan().all()
        x, cache, scale = x[valid], cache[slots[valid]], scale[slots[valid]]
        amax = x.abs().amax(-1)
        torch.testing.assert_close(scale, amax.clamp(min=1e-12) / 448, rtol=1e-6, atol=0)
        assert (cache.abs().amax(-1)[amax > 0] == 448).all()  # the full range
        # e4m3: half an ulp is |y| / 16 (normal) or 2**-10 (subnormal), at most amax / 28
        error = (cache * scale[..., None] - x).abs()
        assert (error <= torch.maximum(x.abs() / 16, scale[..., None] / 1024) * (1 + 1e-5)).all()
        assert (error <= amax[..., None] / 28 * (1 + 1e-5)).all()


def fp8_store_fused(key, value, k_cache, v_cache, slots, k_scale, v_scale):
    """The q/k norm + RoPE kernel's KV store (RoPE only, at position 0: k passes unchanged)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    qkv = torch.cat([key, key, value], dim=1).flatten(1)  # one q head per kv head
    cos_sin = torch.cat([torch.ones(1, head_dim // 2), torch.zeros(1, head_dim // 2)], dim=1)
    positions = torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE)
    qk_norm_rope(qkv, positions, cos_sin.to(DEVICE), num_kv_heads, num_kv_heads, head_dim,
                 slot_mapping=slots, k_cache=k_cache, v_cache=v_cache, k_scale=k_scale,
                 v_scale=v_scale)


@pytest.mark.parametrize("store", [store_kvcache_triton, store_kvcache_torch, fp8_store_fused],
                         ids=["triton", "torch", "fused_qk_norm_rope"])
def test_fp8_store_writes_no_nan(store):
    """An fp8 cache holds no NaN (kv_cache.py): a NaN element is stored as 0, and so is a head with
    an infinite element (its other elements may differ between the stores)."""
    num_blocks, block_size, num_kv_heads, head_dim = 2, 16, 2, 8
    kv = torch.randn(2, 4, num_kv_heads, head_dim, device=DEVICE)
    kv[:, 0, 0, 3] = float("nan")
    kv[:, 1, 1, 5] = float("inf")
    caches = fp8_caches(num_blocks, block_size, num_kv_heads, head_dim, 0.0)
    scales = [torch.zeros(num_blocks, num_kv_heads, block_size, device=DEVICE) for _ in range(2)]
    slots = torch.tensor([0, 1, 17, 30], device=DEVICE)
    store(kv[0], kv[1], *caches, slots, *scales)
    for cache in (caches[0], v_token_major(caches[1])):
        cache = cache.float().flatten(0, 1)  # [slots, heads, dim]
        assert not cache.isnan().any()
        assert cache[0, 0, 3] == 0 and (cache[1, 1] == 0).all()
        assert (cache[[17, 30]].abs().amax(-1) == 448).all()  # the other tokens as usual


@pytest.mark.parametrize("store", STORES, ids=["triton", "torch"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_fp8_store_layout(store, block_size):
    """Slot s of head h: scale at [s // bs, h, s % bs], K at [s // bs, s % bs, h, :], V at
    [s // bs, h, :, s % bs]; nothing else written."""
    torch.manual_seed(0)
    num_blocks, num_kv_heads, head_dim = 3, 3, 8
    slots = [0, 1, block_size - 1, block_size, 2 * block_size + 5, 3 * block_size - 1]
    key, value = torch.randn(2, len(slots), num_kv_heads, head_dim, device=DEVICE)
    caches = fp8_caches(num_blocks, block_size, num_kv_heads, head_dim, 0.0)
    scales = [torch.zeros(num_blocks, num_kv_heads, block_size, device=DEVICE) for _ in range(2)]
    store(key, value, *caches, torch.tensor(slots, device=DEVICE), *scales)
    for x, cache, scale, is_v in zip((key, value), caches, scales, (False, True)):
        expected = torch.zeros_like(cache, dtype=torch.float32)
        expected_scale = torch.zeros_like(scale)
        for i, slot in enumerate(slots):
            block, offset = slot // block_size, slot % block_size
            quantized, expected_scale[block, :, offset] = quantize_fp8(x[i])
            if is_v:
                expected[block, :, :, offset] = quantized.float()
            else:
                expected[block, offset] = quantized.float()
        torch.testing.assert_close(scale, expected_scale, rtol=1e-6, atol=0)
        torch.testing.assert_close(cache.float(), expected, rtol=0, atol=0)


def make_paged_step(prompt_lens, cached_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                    is_prefill=True):
    """Random caches holding `cached_lens` tokens per sequence, and a step computing the rest."""
    torch.manual_seed(0)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in prompt_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks).tolist()
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(perm[start:start + n])
        start += n
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                device=DEVICE)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE,
                          dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    new_lens = [p - c for p, c in zip(prompt_lens, cached_lens)]
    num_tokens = sum(new_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    slots = []
    for table, c, p in zip(tables, cached_lens, prompt_lens):
        slots += [table[pos // block_size] * block_size + pos % block_size
                  for pos in range(c, p)]
    cu_q = torch.tensor([0] + new_lens, device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + list(prompt_lens), device=DEVICE).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        is_prefill=is_prefill, slot_mapping=torch.tensor(slots, device=DEVICE),
        context_lens=torch.tensor(prompt_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables, cu_seqlens_q=cu_q if is_prefill else None,
        cu_seqlens_k=cu_k if is_prefill else None, max_seqlen_q=max(new_lens),
        max_seqlen_k=max(prompt_lens), prefix_cached=any(cached_lens))
    store_kvcache_torch(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta


def dense_reference(q, k_all, v_all, scale):
    """Causal attention of the last len(q) positions over all keys, float64, GQA by repeat."""
    group = q.size(1) // k_all.size(1)
    k_all = k_all.repeat_interleave(group, 1).double()
    v_all = v_all.repeat_interleave(group, 1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k_all) * scale
    n_q, n_k = q.size(0), k_all.size(0)
    mask = torch.arange(n_k)[None, :] > torch.arange(n_k - n_q, n_k)[:, None]
    probs = scores.masked_fill(mask.to(q.device), float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v_all)


def test_torch_reference_matches_dense_attention():
    q, k, v, k_cache, v_cache, meta = make_paged_step([5, 19, 1], [0, 16, 0], 4, 2, 8, 4,
                                                      torch.float32)
    out = torch_attention(q, k, v, k_cache, v_cache, meta, 0.3)
    starts = meta.cu_seqlens_q.tolist()
    for i, n_k in enumerate(meta.context_lens.tolist()):
        table = meta.block_tables[i, :(n_k + 3) // 4].long()
        k_all = k_cache[table].flatten(0, 1)[:n_k]
        v_all = v_cache[table].flatten(0, 1)[:n_k]
        expected = dense_reference(q[starts[i]:starts[i + 1]], k_all, v_all, 0.3)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]].double(), expected, rtol=1e-5,
                                   atol=1e-5)


def test_torch_reference_reads_an_fp8_cache():
    q, k, v, k_cache, v_cache, meta = make_paged_step([5, 19, 1], [0, 16, 0], 4, 2, 8, 4,
                                                      torch.float32)
    k8, k_scale, v8, v_scale = quantize_cache_fp8(k_cache, v_cache)
    out = torch_attention(q, k, v, k8, v8, meta, 0.3, k_scale, v_scale)
    dequantized = [x.float() * s.transpose(1, 2)[..., None]
                   for x, s in ((k8, k_scale), (v_token_major(v8), v_scale))]
    expected = torch_attention(q, k, v, *dequantized, meta, 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("is_prefill,cached_lens,capacity", [
    (True, [0, 0, 0], None), (True, [32, 16, 0], None), (False, [39, 18, 0], None),
    (True, [32, 16, 0], 45),  # the prefix dequantized into a workspace, two groups of sequences
])
def test_fp8_layer_triton_matches_torch(is_prefill, cached_lens, capacity):
    """The Attention layer on an fp8 cache: Triton vs torch, and both vs the unquantized cache."""
    lens = [40, 19, 1]
    q, k, v, k_cache, v_cache, meta = make_paged_step(lens, cached_lens, 4, 2, 16, 16,
                                                      torch.float32, is_prefill)
    if capacity:
        meta.dequant_workspace = torch.full((2, capacity, 2, 16), float("nan"), device=DEVICE)
        meta.dequant_groups = workspace_groups([0, 8, 11, 12], [0, 40, 59, 60], capacity)
        assert meta.dequant_groups == [(0, 1, 8, 40), (1, 3, 3, 19)]
    k8, k_scale, v8, v_scale = quantize_cache_fp8(k_cache, v_cache)
    slots, page = meta.slot_mapping, k8.size(1)  # the step's slots: what the layer's store writes
    for x in (k8, v_token_major(v8)):
        x[slots // page, slots % page] = float("nan")
    for x in (k_scale, v_scale):
        x[slots // page, :, slots % page] = float("nan")
    outs = {}
    for backend in ("triton", "torch"):
        layer = Attention(4, 16, 0.25, 2, backend)
        cache = (x.clone() for x in (k8, v8, k_scale, v_scale))
        layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale = cache
        outs[backend] = layer(q, k, v, meta)
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-4, atol=1e-4)
    exact = torch_attention(q, k, v, k_cache, v_cache, meta, 0.25)
    # e4m3 keeps 4 significant bits: N(0, 1) values are off by up to amax / 28 ~ 0.1
    assert (outs["torch"] - exact).abs().max() < 0.15


def test_decodes_from_qkv_at_up_to_skinny_rows():
    """Triton decode steps of up to SKINNY_MAX_ROWS 16-bit rows, split-K or not, once the pool
    exists."""
    def decodes(backend="triton", rows=SKINNY_MAX_ROWS, is_prefill=False, pool=True, split=False,
                dtype=torch.bfloat16):
        layer = Attention(4, 16, 0.25, 2, backend)
        if pool:
            layer.k_cache = torch.zeros(4, 16, 2, 16)
        qkv = torch.zeros(rows, 8 * 16, dtype=dtype)
        if split:
            qkv = SplitKSum(torch.zeros(2, rows, 8 * 16), dtype)
        meta = AttentionMetadata(is_prefill, torch.zeros(rows, dtype=torch.int64),
                                 torch.ones(rows, dtype=torch.int32),
                                 torch.zeros(rows, 1, dtype=torch.int32))
        return layer.decodes_from_qkv(qkv, meta)

    assert decodes() and decodes(rows=1) and decodes(split=True)
    assert not decodes(rows=SKINNY_MAX_ROWS + 1)
    assert not decodes(is_prefill=True)
    assert not decodes(backend="torch")
    assert not decodes(pool=False)
    assert not decodes(dtype=torch.float32) and not decodes(split=True, dtype=torch.float32)


def test_workspace_groups():
    cu_q, cu_k = [0, 5, 6, 16, 20], [0, 50, 60, 100, 120]  # contexts 50, 10, 40, 20
    assert workspace_groups(cu_q, cu_k, 120) == [(0, 4, 10, 50)]
    assert workspace_groups(cu_q, cu_k, 60) == [(0, 2, 5, 50), (2, 4, 10, 40)]
    assert workspace_groups(cu_q, cu_k, 50) == [(0, 1, 5, 50), (1, 3, 10, 40), (3, 4, 4, 20)]
    with pytest.raises(ValueError, match="context of 50 tokens exceeds the dequantization "
                                         "workspace of 49"):
        workspace_groups(cu_q, cu_k, 49)


def test_dequantizing_pays_by_queries_per_context_token():
    assert dequantizing_pays([0, DEQUANT_MIN_QUERIES], [0, 1000])
    assert not dequantizing_pays([0, DEQUANT_MIN_QUERIES - 1], [0, 1000])
    # one long chunk among many short prefix hits: 26 queries a context token
    cu_q = [0, 512, *range(528, 528 + 16 * 100, 16)]
    cu_k = [0, 2048, *range(3072, 2048 + 1024 * 101, 1024)]
    assert not dequantizing_pays(cu_q, cu_k)
    assert dequantizing_pays(cu_q[:2], cu_k[:2])


BACKENDS = [pytest.param(triton_attention, id="triton"),
            pytest.param(flash_attention, id="flash_attn", marks=[needs_cuda, pytest.mark.skipif(
                not _has_flash_attn(), reason="flash-attn not installed")])]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prompt_lens,cached_lens", [
    ([300, 17, 513], [0, 0, 0]),  # plain prefill
    ([300, 290, 600], [256, 0, 512]),  # cached prefix + chunk
])
def test_prefill_backend_matches_reference(backend, prompt_lens, cached_lens):
    on_gpu = DEVICE == "cuda"
    dtype, head_dim = (torch.bfloat16, 128) if on_gpu else (torch.float32, 16)
    if not on_gpu:  # the interpreter is slow: shrink the case
        prompt_lens, cached_lens = [n // 8 for n in prompt_lens], [0 for _ in cached_lens]
    q, k, v, k_cache, v_cache, meta = make_paged_step(prompt_lens, cached_lens, 16, 8, head_dim,
                                                      256 if on_gpu else 16, dtype)
    expected = torch_attention(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5)
    out = backend(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5)
    tol = 2e-2 if on_gpu else 1e-4
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_backend_matches_reference(backend):
    on_gpu = DEVICE == "cuda"
    dtype, head_dim, block_size = (torch.bfloat16, 128, 256) if on_gpu else (torch.float32, 16, 16)
    lens = [1, 255, 256, 257, 1000, 4000] if on_gpu else [1, 15, 16, 17, 40]
    q, k, v, k_cache, v_cache, meta = make_paged_step(lens, [n - 1 for n in lens], 16, 8, head_dim,
                                                      block_size, dtype, is_prefill=False)
    expected = torch_attention(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5)
    out = backend(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5)
    tol = 2e-2 if on_gpu else 1e-4
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


@needs_cuda
def test_fp8_engine_on_cuda(tiny_model, prompts):
    """kv_cache_dtype="fp8" picks the Triton kernels on CUDA; CUDA graphs decode as eager does."""
    from nanovllm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        with LLM(tiny_model, kv_cache_dtype="fp8", enforce_eager=eager, max_num_seqs=20,
                 kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=512) as llm:
            assert llm.llm_engine.config.attention_backend == "triton"
            tokens[eager] = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert tokens[True] == tokens[False]
