"""Triton paged attention against a float64 torch reference: under the interpreter on CPU
(conftest), compiled with CUDA (plus Qwen3-0.6B shapes)."""

import math

import pytest
import torch

from nanovllm.kernels import device as device_facts
from nanovllm.kernels.attention import decode as triton_decode
from nanovllm.kernels.attention import prefill as triton_prefill
from nanovllm.kernels.attention.kv_cache import quantize_cache_fp8, quantize_fp8, v_token_major
from nanovllm.kernels.attention.split_softmax import SplitSoftmax
from nanovllm.kernels.gemm.split_k import SplitKSum
from nanovllm.kernels.qk_norm_rope import NormRopeInputs, qk_norm_rope
from nanovllm.layers.attention import workspace_groups
from nanovllm.layers.rotary_embedding import RotaryEmbedding, default_inv_freq
from tests.conftest import needs_cuda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

GARBAGE_BLOCK = 1 << 30  # block-table entries past a sequence's blocks: reading one faults


def make_cache(context_lens, block_size, kvh, d, dtype=torch.float32, spare_blocks=3, seed=0):
    """(k_cache, v_cache, block_tables, context_lens): random K/V for context_lens[b] tokens in
    shuffled blocks; every other slot NaN, so that reading a wrong slot poisons the output."""
    gen = torch.Generator().manual_seed(seed)
    pages = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(pages) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(max(pages), 1) + 1
    tables = torch.full((len(context_lens), width), GARBAGE_BLOCK, dtype=torch.int32)
    shape = (num_blocks, block_size, kvh, d)
    k_cache = torch.full(shape, float("nan"), dtype=torch.float32)
    v_cache = torch.full(shape, float("nan"), dtype=torch.float32)
    used = 0
    for b, n in enumerate(context_lens):
        blocks = perm[used:used + pages[b]]
        used += pages[b]
        tables[b, :pages[b]] = blocks.to(torch.int32)
        tok = torch.arange(n)
        k_cache[blocks[tok // block_size], tok % block_size] = torch.randn(n, kvh, d, generator=gen)
        v_cache[blocks[tok // block_size], tok % block_size] = torch.randn(n, kvh, d, generator=gen)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), tables.to(DEVICE), lens.to(DEVICE)


def fp8_cache(k_cache, v_cache):
    """(fp8 k, v, their scales as kwargs, the dequantized float64 k, v): the NaN slots get NaN
    scales and the largest e4m3 value, so that a key past the context poisons the output."""
    k8, k_scale, v8, v_scale = quantize_cache_fp8(k_cache, v_cache)
    for x, scale in ((k8, k_scale), (v_token_major(v8), v_scale)):
        x.view(torch.uint8)[scale.transpose(1, 2).isnan()] = 0x7E  # 448
    dequantized = [x.double() * s.transpose(1, 2)[..., None].double()
                   for x, s in ((k8, k_scale), (v_token_major(v8), v_scale))]
    return k8, v8, dict(k_scale=k_scale, v_scale=v_scale), *dequantized


def reference(q, k_cache, v_cache, table, ctx, scale):
    """Attention of q [n_q, H, D] (the last n_q positions of ctx keys) in float64: [n_q, H, D]."""
    n_q, h, _ = q.shape
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    tok = torch.arange(ctx, device=q.device)
    blocks = table[tok // block_size].long()
    k = k_cache[blocks, tok % block_size].double().repeat_interleave(h // kvh, dim=1)
    v = v_cache[blocks, tok % block_size].double().repeat_interleave(h // kvh, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    pos = ctx - n_q + torch.arange(n_q, device=q.device)
    s = s.masked_fill(tok[None, None, :] > pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def run_decode(context_lens, block_size, h, kvh, d, dtype=torch.float32, fp8=False, **kwargs):
    k_cache, v_cache, tables, lens = make_cache(context_lens, block_size, kvh, d, dtype)
    ref_k, ref_v = k_cache, v_cache
    if fp8:
        k_cache, v_cache, scales, ref_k, ref_v = fp8_cache(k_cache, v_cache)
        kwargs.update(scales)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(context_lens), h, d, generator=gen).to(DEVICE, dtype)
    out = torch.full_like(q, float("nan"))
    scale = d ** -0.5
    triton_decode.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out=out,
                                         **kwargs)
    refs = [reference(q[b:b + 1], ref_k, ref_v, tables[b], n, scale)[0] if n > 0 else None
            for b, n in enumerate(context_lens)]
    return q, (k_cache, v_cache, tables, lens, scale), out, refs


def check_decode(context_lens, block_size, h, kvh, d, atol=1e-4, **kwargs):
    _, _, out, refs = run_decode(context_lens, block_size, h, kvh, d, **kwargs)
    assert torch.isfinite(out).all()
    for b, ref in enumerate(refs):
        if ref is not None:
            torch.testing.assert_close(out[b].double(), ref, atol=atol, rtol=atol)


@pytest.mark.parametrize(
    "block_size,h,kvh,d,context_lens",
    [
        (16, 4, 4, 32, [1, 15, 16, 17, 33]),  # MHA, around block boundaries
        (32, 4, 2, 32, [31, 32, 33, 64, 5]),
        (256, 8, 2, 16, [255, 256, 257, 1]),  # GQA 4, big pages
        (16, 16, 8, 16, [40, 7]),
    ],
)
def test_decode(block_size, h, kvh, d, context_lens):
    check_decode(context_lens, block_size, h, kvh, d, num_splits=1)


@pytest.mark.parametrize("num_splits,h", [(None, 4), (4, 4), (8, 16), (8, 6), (16, 4), (32, 6)])
def test_decode_split_k(num_splits, h):
    # some splits empty; merged by the last split (a few heads at a time) or the merge kernel
    check_decode([700, 3, 0, 129, 0], 16, h, 2, 32, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [2, 8, 16, 32])
def test_decode_defer_merge(num_splits):
    """Unmerged splits come back as a SplitSoftmax whose merge() is the output, bit for bit."""
    lens, h, kvh, d = [700, 3, 0, 129, 0], 4, 2, 32
    q, (k_cache, v_cache, tables, ctx, scale), out, _ = run_decode(lens, 16, h, kvh, d,
                                                                   num_splits=num_splits)
    deferred = triton_decode.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale,
                                                    num_splits=num_splits, defer_merge=True)
    if num_splits <= triton_decode.MAX_SPLITS_MERGED_BY_THE_LAST:
        assert torch.equal(deferred, out)
        return
    assert isinstance(deferred, SplitSoftmax) and deferred.dtype == q.dtype
    assert deferred.acc.shape == (len(lens), h, num_splits, d)
    assert deferred.m.shape == (len(lens), h, num_splits)
    assert deferred.shape == (len(lens), h * d)
    merged = deferred.merge()
    assert merged.shape == (len(lens), h, d) and torch.equal(merged, out)
    assert (merged[[2, 4]] == 0).all()  # padding rows: no split saw a key


def test_decode_splits_leave_their_counts_zeroed():
    """The last split to finish merges and resets its count to 0 for the next launch."""
    for _ in range(2):
        check_decode([700, 3, 0, 129, 0], 16, 4, 2, 32, num_splits=8)
    counts = device_facts._ARRIVAL_COUNTS["decode splits", torch.empty(0, device=DEVICE).device]
    assert sum(c.count_nonzero().item() for c in counts) == 0


@pytest.mark.parametrize("block_size,block_n", [(256, 16), (16, 64), (64, 128)])
def test_decode_tile_vs_page(block_size, block_n):
    check_decode([block_size * 2 + 1, 100, 1], block_size, 4, 2, 32, block_n=block_n, num_splits=2)


@pytest.mark.parametrize("num_splits,fp8", [(1, False), (4, False), (None, True)])
def test_decode_in_an_order(num_splits, fp8):
    """Rows taken up in a given order still write their own output."""
    lens = [5, 300, 0, 33, 129, 33]
    order = torch.tensor(sorted(range(len(lens)), key=lambda b: -lens[b]), dtype=torch.int32,
                         device=DEVICE)
    check_decode(lens, 16, 4, 2, 32, num_splits=num_splits, fp8=fp8, order=order)


def test_decode_padding_rows_only():
    for num_splits in (1, 2):
        _, _, out, _ = run_decode([0, 0], 16, 4, 2, 16, num_splits=num_splits)
        assert (out == 0).all()


def erased_newest_token(caches: dict, tables, lens) -> torch.Tensor:
    """Each row's newest slot (-1: padding), its K/V in `caches` made NaN (the step writes it)."""
    block_size = caches["k_cache"].shape[1]
    slots = torch.tensor([int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          if n else -1 for b, n in enumerate(lens.tolist())],
                         dtype=torch.int64, device=DEVICE)
    written = slots[slots >= 0]
    blocks, offsets = written // block_size, written % block_size
    if caches.get("k_scale") is None:
        caches["k_cache"][blocks, offsets] = caches["v_cache"][blocks, offsets] = float("nan")
    else:
        caches["k_scale"][blocks, :, offsets] = caches["v_scale"][blocks, :, offsets] = float("nan")
    return slots


@pytest.mark.parametrize("dtype,fp8,splits,num_splits", [
    (torch.float32, False, 0, 1), (torch.float16, False, 2, 4), (torch.float16, True, 3, 1),
    (torch.float32, True, 2, 8)])
def test_decode_from_qkv(dtype, fp8, splits, num_splits):
    """Given the qkv projection, the decode kernel returns and stores what qk_norm_rope then the
    decode kernel do: exactly on CPU, to a few ulps compiled (another reduction order)."""
    h, kvh, d, block_size, lens = 4, 2, 32, 16, [1, 40, 0, 129, 33]
    k_cache, v_cache, tables, ctx = make_cache(lens, block_size, kvh, d, dtype)

    def layer_cache() -> tuple[dict, torch.Tensor]:
        if fp8:
            k8, v8, scales, _, _ = fp8_cache(k_cache, v_cache)
            cache = dict(k_cache=k8, v_cache=v8, **scales)
        else:
            cache = dict(k_cache=k_cache.clone(), v_cache=v_cache.clone())
        return cache, erased_newest_token(cache, tables, ctx)

    (two_kernels, slots), (one_kernel, _) = layer_cache(), layer_cache()
    gen = torch.Generator().manual_seed(2)
    parts = torch.randn(max(splits, 1), len(lens), (h + 2 * kvh) * d, generator=gen).to(DEVICE)
    qkv = SplitKSum(parts, dtype) if splits else parts[0].to(dtype)
    positions = (ctx.long() - 1).clamp(min=0)
    cos_sin = RotaryEmbedding(default_inv_freq(d, 1e6), 4096).cos_sin_cache.to(DEVICE)
    weights = [(2 * torch.rand(d, generator=gen)).to(DEVICE, dtype) for _ in range(2)]
    order = torch.tensor(sorted(range(len(lens)), key=lambda b: -lens[b]), dtype=torch.int32,
                         device=DEVICE)

    def decode(q, cache, **kwargs):
        return triton_decode.paged_decode_attention(
            q, cache["k_cache"], cache["v_cache"], tables, ctx, d ** -0.5,
            k_scale=cache.get("k_scale"), v_scale=cache.get("v_scale"), order=order,
            num_splits=num_splits, **kwargs)

    q, _, _ = qk_norm_rope(qkv, positions, cos_sin, h, kvh, d, *weights, 1e-6, slots,
                           **two_kernels)
    expected = decode(q, two_kernels)
    inputs = NormRopeInputs(qkv, positions, cos_sin, slots, h, *weights, 1e-6)
    out = decode(None, one_kernel, from_qkv=inputs)
    assert torch.isfinite(expected).all()
    exact = DEVICE == "cpu"
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(out, expected, **tol)
    for name, cache in one_kernel.items():
        rtol = 0.13 if fp8 and "cache" in name else 2e-3  # an fp8 byte may round the other way
        tol = dict(rtol=0, atol=0) if exact else dict(rtol=rtol, atol=1e-3)
        torch.testing.assert_close(cache.float(), two_kernels[name].float(), equal_nan=True, **tol)


def test_decode_num_splits_heuristic():
    dev = torch.device("cpu")
    assert triton_decode._decode_num_splits(256, 8, 1024, dev) == 1
    assert triton_decode._decode_num_splits(1, 8, 64, dev) == 1
    assert triton_decode._decode_num_splits(1, 8, 4096, dev) == 16  # >= 256 keys per split
    assert triton_decode._decode_num_splits(1, 8, 8192, dev) == 32  # 256 programs on 132 SMs
    assert triton_decode._decode_num_splits(8, 8, 4096, dev) == 8  # 512 programs on 132 SMs
    assert triton_decode._decode_num_splits(64, 8, 4096, dev) == 1


def rounded_to_fp8(q):
    """q rounded to e4m3 a head at a time, as the fp8 prefill kernel's 64-row tiles do (float64)."""
    q8, scale = quantize_fp8(q)
    return q8.double() * scale[..., None].double()


def prefill_case(context_lens, q_lens, block_size, h, kvh, d, dtype, fp8, round_queries=False):
    """A paged cache (fp8: quantized), queries at the last q_lens[b] positions, a NaN output and
    the float64 reference (round_queries: of the queries rounded to fp8)."""
    k_cache, v_cache, tables, lens = make_cache(context_lens, block_size, kvh, d, dtype)
    ref_k, ref_v, scales = k_cache, v_cache, {}
    if fp8:
        k_cache, v_cache, scales, ref_k, ref_v = fp8_cache(k_cache, v_cache)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEVICE)
    q = torch.randn(sum(q_lens), h, d, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    scale = d ** -0.5
    ref_q = rounded_to_fp8(q) if round_queries else q
    ref = torch.cat([reference(ref_q[cu[b]:cu[b + 1]], ref_k, ref_v, tables[b], n, scale)
                     for b, n in enumerate(context_lens)])
    out = torch.full_like(q, float("nan"))
    return q, k_cache, v_cache, scales, tables, cu, lens, scale, out, ref


def run_prefill(context_lens, q_lens, block_size, h, kvh, d, dtype=torch.float32, fp8=False,
                round_queries=False, **kwargs):
    q, k_cache, v_cache, scales, tables, cu, lens, scale, out, ref = prefill_case(
        context_lens, q_lens, block_size, h, kvh, d, dtype, fp8, round_queries)
    triton_prefill.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, max(q_lens),
                                           scale, out=out, **scales, **kwargs)
    return q, (k_cache, v_cache, tables, cu, lens, scale), out, ref


@pytest.mark.parametrize(
    "block_size,h,kvh,d,context_lens,q_lens",
    [
        (16, 4, 2, 32, [1, 17, 40, 16], [1, 17, 40, 16]),  # plain prefill, varlen
        (32, 4, 4, 32, [50, 300, 33], [10, 44, 1]),  # cached prefix + chunk (1 = decode-like)
        (256, 8, 2, 16, [257, 100, 255], [200, 100, 0]),  # GQA 4, big pages, an empty chunk
        (16, 16, 8, 16, [70, 24], [30, 24]),
    ],
)
def test_prefill(block_size, h, kvh, d, context_lens, q_lens):
    _, _, out, ref = run_prefill(context_lens, q_lens, block_size, h, kvh, d)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 64), (64, 32)])
def test_prefill_tiles(block_m, block_n):
    _, _, out, ref = run_prefill([150, 61], [90, 61], 32, 4, 2, 16, block_m=block_m,
                                 block_n=block_n)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


def run_varlen_prefill(seq_lens, h, kvh, d, dtype=torch.float32, **kwargs):
    """varlen_prefill_attention over strided views of one qkv tensor, as the model passes them."""
    gen = torch.Generator().manual_seed(2)
    total = sum(seq_lens)
    qkv = torch.randn(total, h + 2 * kvh, d, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([h, kvh, kvh], dim=1)
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEVICE)
    out = torch.full_like(q, float("nan"))
    scale = d ** -0.5
    triton_prefill.varlen_prefill_attention(q, k, v, cu, max(seq_lens), scale, out=out, **kwargs)
    one_page = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    ref = torch.cat([reference(q[cu[b]:cu[b + 1]], k[None, cu[b]:cu[b + 1]],
                               v[None, cu[b]:cu[b + 1]], one_page, n, scale)
                     for b, n in enumerate(seq_lens) if n > 0])
    return q, k, v, cu, out, ref


@pytest.mark.parametrize(
    "h,kvh,d,seq_lens,config",
    [
        (4, 2, 32, [1, 17, 40, 16], {}),  # GQA 2, varlen, a one-token prompt
        (4, 4, 16, [150, 61, 0, 64], dict(block_m=32, block_n=16)),  # many tiles, an empty one
        (8, 2, 16, [33, 100], dict(block_m=16, block_n=64)),  # key tiles wider than query tiles
        (16, 8, 16, [70, 24], {}),
    ],
)
def test_varlen_prefill(h, kvh, d, seq_lens, config):
    _, _, _, _, out, ref = run_varlen_prefill(seq_lens, h, kvh, d, **config)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "block_size,h,kvh,d,context_lens,num_splits,block_n",
    [
        (16, 4, 4, 32, [1, 15, 16, 17, 33], 1, 64),  # around block boundaries, tiles span pages
        (32, 8, 2, 16, [1, 31, 32, 33, 0, 300], 4, 16),  # split-K, a padding row, 2 tiles a page
        (16, 16, 8, 16, [40, 7], None, None),
        (16, 6, 2, 32, [40, 7, 129], 4, 32),  # GQA 3: 5 of the keys-major step's 8 columns masked
        (16, 16, 1, 32, [50, 3], 1, 32),  # GQA 16: 16 query columns
    ],
)
def test_decode_fp8(block_size, h, kvh, d, context_lens, num_splits, block_n):
    check_decode(context_lens, block_size, h, kvh, d, num_splits=num_splits, block_n=block_n,
                 fp8=True)


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_decode_fp8_default_tile(block_size):
    check_decode([2 * block_size + 1, block_size - 1, 1, 0, 300], block_size, 8, 2, 32, fp8=True)


@pytest.mark.parametrize(
    "block_size,h,kvh,d,context_lens,q_lens",
    [
        (16, 4, 2, 32, [1, 17, 40, 16], [1, 17, 40, 16]),  # plain prefill, varlen
        (32, 4, 4, 32, [50, 300, 33], [10, 44, 1]),  # cached prefix + chunk
        (16, 16, 8, 16, [70, 24], [30, 24]),
    ],
)
def test_prefill_fp8(block_size, h, kvh, d, context_lens, q_lens):
    _, _, out, ref = run_prefill(context_lens, q_lens, block_size, h, kvh, d, fp8=True, block_m=16,
                                 block_n=32)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_n", [32, 128])
def test_prefill_fp8_rounds_queries_in_64_row_tiles(block_n):
    """64-row tiles compute exactly the attention of the queries rounded to e4m3."""
    context_lens, q_lens = [150, 300, 61], [90, 44, 61]
    _, _, out, ref = run_prefill(context_lens, q_lens, 32, 4, 2, 32, fp8=True, round_queries=True,
                                 block_m=64, block_n=block_n)
    tolerance = 1e-3 if DEVICE == "cuda" else 1e-4  # the GPU's fp8 MMA sums with fewer bits
    torch.testing.assert_close(out.double(), ref, atol=tolerance, rtol=tolerance)
    _, _, _, unrounded = run_prefill(context_lens, q_lens, 32, 4, 2, 32, fp8=True, block_m=16,
                                     block_n=32)
    assert (out.double() - unrounded).abs().max() < 0.05


def run_dequantized_prefill(context_lens, q_lens, block_size, h, kvh, d, capacity,
                            dtype=torch.float32):
    """dequantized_prefill_attention with a NaN-filled workspace of `capacity` tokens."""
    q, k8, v8, scales, tables, cu_q, lens, scale, out, ref = prefill_case(
        context_lens, q_lens, block_size, h, kvh, d, dtype, fp8=True)
    cu_k = torch.tensor([0, *lens.cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    groups = workspace_groups(cu_q.tolist(), cu_k.tolist(), capacity)
    workspace = torch.full((2, capacity, kvh, d), float("nan"), dtype=dtype, device=DEVICE)
    triton_prefill.dequantized_prefill_attention(q, k8, v8, scales["k_scale"], scales["v_scale"],
                                                 tables, cu_q, cu_k, groups, scale, workspace,
                                                 out=out)
    return groups, out, ref


@pytest.mark.parametrize(
    "block_size,h,kvh,d,context_lens,q_lens,capacity,num_groups",
    [
        (16, 4, 2, 32, [50, 300, 33], [10, 44, 1], 512, 1),
        (32, 4, 4, 32, [50, 300, 33, 64], [10, 44, 0, 64], 300, 3),  # an empty chunk
        (256, 16, 8, 16, [257, 70], [200, 30], 257, 2),  # a context filling the workspace
    ],
)
def test_dequantized_prefill_fp8(block_size, h, kvh, d, context_lens, q_lens, capacity, num_groups):
    groups, out, ref = run_dequantized_prefill(context_lens, q_lens, block_size, h, kvh, d,
                                               capacity)
    assert len(groups) == num_groups
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


QWEN3 = dict(h=16, kvh=8, d=128, block_size=256)


@needs_cuda
def test_decode_bf16_qwen3():
    lens = [1, 255, 256, 257, 4000, 0, 1024]
    q, (k_cache, v_cache, tables, ctx, scale), out, refs = run_decode(lens, dtype=torch.bfloat16,
                                                                      **QWEN3)
    assert torch.isfinite(out).all()
    for b, ref in enumerate(refs):
        if ref is not None:
            torch.testing.assert_close(out[b].double(), ref, atol=2e-2, rtol=2e-2)
    flash_attn = pytest.importorskip("flash_attn")
    fa = flash_attn.flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=ctx,
                                            block_table=tables, softmax_scale=scale, causal=True)
    live = ctx > 0
    torch.testing.assert_close(out[live], fa.squeeze(1)[live], atol=2e-2, rtol=2e-2)


@needs_cuda
def test_prefill_bf16_qwen3():
    lens, q_lens = [1000, 2048, 300], [1000, 512, 1]
    q, (k_cache, v_cache, tables, cu, ctx, scale), out, ref = run_prefill(
        lens, q_lens, dtype=torch.bfloat16, **QWEN3)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    flash_attn = pytest.importorskip("flash_attn")
    cu_k = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)
    fa = flash_attn.flash_attn_varlen_func(q, k_cache, v_cache, cu, cu_k, max(q_lens),
                                           max(lens), softmax_scale=scale, causal=True,
                                           block_table=tables)
    torch.testing.assert_close(out, fa, atol=2e-2, rtol=2e-2)


@needs_cuda
def test_varlen_prefill_bf16_qwen3():
    q, k, v, cu, out, ref = run_varlen_prefill([1000, 2048, 1, 300], dtype=torch.bfloat16, h=16,
                                               kvh=8, d=128)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    flash_attn = pytest.importorskip("flash_attn")
    fa = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 2048, 2048, softmax_scale=128 ** -0.5,
                                           causal=True)
    torch.testing.assert_close(out, fa, atol=2e-2, rtol=2e-2)


@needs_cuda
def test_fp8_bf16_qwen3():
    """fp8 cache, Qwen3-0.6B shapes: against the reference on the dequantized cache, and within
    the quantization error of the bf16 kernel on the unquantized cache."""
    lens = [1, 255, 256, 257, 4000, 0, 1024]
    _, _, fp8, refs = run_decode(lens, dtype=torch.bfloat16, fp8=True, **QWEN3)
    _, _, exact, _ = run_decode(lens, dtype=torch.bfloat16, **QWEN3)
    for b, ref in enumerate(refs):
        if ref is not None:
            torch.testing.assert_close(fp8[b].double(), ref, atol=2e-2, rtol=2e-2)
    assert (fp8.float() - exact.float()).abs().max() < 0.2
    lens, q_lens = [1000, 2048, 300], [1000, 512, 1]  # 64-row tiles: the queries rounded to fp8
    _, _, fp8, ref = run_prefill(lens, q_lens, dtype=torch.bfloat16, fp8=True, round_queries=True,
                                 **QWEN3)
    torch.testing.assert_close(fp8.double(), ref, atol=4e-2, rtol=2e-2)
    _, _, exact, _ = run_prefill(lens, q_lens, dtype=torch.bfloat16, **QWEN3)
    assert (fp8.float() - exact.float()).abs().max() < 0.2
    _, dequantized, ref = run_dequantized_prefill(lens, q_lens, capacity=4096,
                                                  dtype=torch.bfloat16, **QWEN3)
    torch.testing.assert_close(dequantized.double(), ref, atol=2e-2, rtol=2e-2)
    assert (dequantized.float() - exact.float()).abs().max() < 0.2


@pytest.mark.parametrize("v_magnitude", [1e-4, 1e2])
def test_fp8_values_far_from_one(v_magnitude):
    """The fp8 kernels' float16 P V: tiny V must not underflow, nor large V overflow."""
    lens = [1, 300, 1024]
    k_cache, v_cache, tables, ctx = make_cache(lens, 256, 8, 128)
    k8, v8, scales, ref_k, ref_v = fp8_cache(k_cache, v_cache * v_magnitude)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(len(lens), 16, 128, generator=gen).to(DEVICE, torch.bfloat16)
    out = triton_decode.paged_decode_attention(q, k8, v8, tables, ctx, 128 ** -0.5, **scales)
    for b, n in enumerate(lens):
        ref = reference(q[b:b + 1], ref_k, ref_v, tables[b], n, 128 ** -0.5)[0]
        torch.testing.assert_close(out[b].double() / v_magnitude, ref / v_magnitude, atol=2e-2,
                                   rtol=2e-2)
    q_lens = [1, 100, 64]
    q = torch.randn(sum(q_lens), 16, 128, generator=gen).to(DEVICE, torch.bfloat16)
    cu = torch.tensor([0, 1, 101, 165], dtype=torch.int32, device=DEVICE)
    out = triton_prefill.paged_prefill_attention(q, k8, v8, tables, cu, ctx, 100, 128 ** -0.5,
                                                 **scales)
    for b, n in enumerate(lens):
        ref = reference(rounded_to_fp8(q[cu[b]:cu[b + 1]]), ref_k, ref_v, tables[b], n,
                        128 ** -0.5)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]].double() / v_magnitude, ref / v_magnitude,
                                   atol=4e-2, rtol=2e-2)
