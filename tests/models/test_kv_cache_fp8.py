"""kv_cache_dtype="fp8" through the engine on the tiny model (CPU, torch backend): the pool size,
the exactness of the quantized path, and its error against the model-dtype cache."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.kernels.attention import kv_cache
from nanovllm.layers import attention
from nanovllm.runner import model_runner
from nanovllm.testing.tiny_model import write_tiny_qwen3
from tests.conftest import NUM_NEW_TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=20)
OPTIONS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)


def test_fp8_resolves_to_a_backend_that_reads_it(tiny_model):
    config = Config(tiny_model, device="cpu", kv_cache_dtype="fp8")
    assert config.attention_backend == "torch"
    assert config.kv_cache_torch_dtype == torch.float8_e4m3fn
    assert Config(tiny_model, device="cpu").kv_cache_torch_dtype == torch.float32


@pytest.fixture(scope="module")
def tiny_model_head_dim_128(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-qwen3-hd128"))
    write_tiny_qwen3(path, head_dim=128)
    return path


@pytest.mark.parametrize("head_dim", [16, 128])
def test_fp8_pool_holds_about_twice_the_tokens(tiny_model, tiny_model_head_dim_128, head_dim,
                                               monkeypatch):
    budget = 16 << 20
    monkeypatch.setattr(model_runner, "CPU_KV_CACHE_BYTES", budget)
    path = tiny_model if head_dim == 16 else tiny_model_head_dim_128
    blocks = {}
    for kv_cache_dtype in ("auto", "fp8"):
        with LLM(path, device="cpu", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                 kvcache_block_size=16) as llm:
            blocks[kv_cache_dtype] = llm.llm_engine.num_kvcache_blocks
    # 2 layers, 2 KV heads, 16 tokens a block, K and V: bf16 values, or fp8 values + a float32 scale
    assert blocks["auto"] == budget // (2 * 2 * 16 * 2 * head_dim * 2)
    assert blocks["fp8"] == budget // (2 * 2 * 16 * 2 * (head_dim + 4))
    ratio = 2 * head_dim / (head_dim + 4)
    assert blocks["fp8"] / blocks["auto"] == pytest.approx(ratio, rel=1e-2)


def test_fp8_pool_starts_without_nan(tiny_model, monkeypatch):
    """An fp8 pool holds no NaN from the start (kv_cache.py), whatever torch.empty returns."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        if tensor.dtype == torch.float8_e4m3fn:
            tensor.view(torch.uint8).fill_(0x7F)
        elif tensor.is_floating_point():
            tensor.fill_(float("nan"))
        return tensor

    monkeypatch.setattr(torch, "empty", nan_empty)
    for kv_cache_dtype in ("auto", "fp8"):
        with LLM(tiny_model, kv_cache_dtype=kv_cache_dtype, **OPTIONS) as llm:
            pool = llm.llm_engine.model_runner.kv_cache
            assert pool.float().isnan().any() == (kv_cache_dtype == "auto")


def _rounding_store(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None,
                    store=kv_cache.store_kvcache_torch):
    """The torch store of a float cache, writing K/V rounded through fp8 and back."""
    key, value = (q.float() * s[..., None]
                  for q, s in map(kv_cache.quantize_fp8, (key, value)))
    store(key, value, k_cache, v_cache, slot_mapping)


@pytest.fixture(scope="module")
def runs(tiny_model, prompts) -> dict[str, list[dict]]:
    """Greedy outputs with logprobs: float32 cache, fp8 cache, float32 cache of fp8-rounded K/V."""
    outputs = {}
    for name in ("auto", "fp8", "rounded"):
        with pytest.MonkeyPatch.context() as patch:
            if name == "rounded":
                patch.setattr(attention, "store_kvcache_torch", _rounding_store)
            kv_cache_dtype = "fp8" if name == "fp8" else "auto"
            with LLM(tiny_model, kv_cache_dtype=kv_cache_dtype, **OPTIONS) as llm:
                outputs[name] = llm.generate(prompts, GREEDY, use_tqdm=False)
    return outputs


def test_fp8_cache_is_attention_over_the_rounded_kv(runs):
    """The only difference fp8 makes is the rounding of K/V: the scales are applied exactly."""
    for fp8, rounded in zip(runs["fp8"], runs["rounded"]):
        assert fp8["token_ids"] == rounded["token_ids"]
        for a, b in zip(fp8["logprobs"], rounded["logprobs"]):
            assert a.keys() == b.keys()
            assert max(abs(a[t].logprob - b[t].logprob) for t in a) < 1e-5


@pytest.mark.cpu_suite  # tensor parallel over gloo
def test_fp8_cache_at_tp2_gives_tp1_tokens(tiny_model, prompts, runs):
    """Each rank quantizes its own KV heads: TP=2 changes no token, logprobs only by rounding."""
    with LLM(tiny_model, kv_cache_dtype="fp8", tensor_parallel_size=2, **OPTIONS) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for tp2, tp1 in zip(outputs, runs["fp8"]):
        assert tp2["token_ids"] == tp1["token_ids"]
        for a, b in zip(tp2["logprobs"], tp1["logprobs"]):
            assert a.keys() == b.keys()
            assert max(abs(a[t].logprob - b[t].logprob) for t in a) < TP_BOUND


# TP=2 sums the row-parallel products (o_proj, down_proj) in another order, so its K/V differ from
# TP=1's by a few float32 ulps (the float32 cache's logprobs move < 1e-5). e4m3 rounding keeps
# that, except for a value x / scale lying within those ulps of a rounding midpoint: it then
# stores the neighbour, one 3-bit-mantissa step away (2^-3 relative: twice the 2^-4 rounding
# bound). Rounding all N cached values (N ~ 80 tokens x 2 layers x 2 KV heads x 16 x K,V ~ 10^4)
# by up to 2^-4 moves logprobs by at most ~2 (test_fp8_logprobs_close_to_the_model_dtype_cache),
# so one flipped value moves them by about 2 * 2 / N ~ 4e-4 at most. The bound admits a couple of
# flips and stays 10^3 below the error of a mis-scaled or mis-indexed cache (several units).
TP_BOUND = 1e-3


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


# This tiny model is unusually sensitive (top-2 logit gaps ~1e-2); a mis-scaled or mis-indexed
# cache gives errors of several units and near-zero agreement.
def test_fp8_logprobs_close_to_the_model_dtype_cache(runs):
    errors = []
    for auto, fp8 in zip(runs["auto"], runs["fp8"]):
        same_context = _first_divergence(auto["token_ids"], fp8["token_ids"]) + 1
        for a, b in zip(auto["logprobs"][:same_context], fp8["logprobs"][:same_context]):
            errors.append(max(abs(a[t].logprob - b[t].logprob) for t in a.keys() & b.keys()))
    assert max(errors) < 2.0
    assert sum(errors) / len(errors) < 0.5


def test_fp8_greedy_tokens_mostly_agree(runs):
    agreeing = sum(_first_divergence(a["token_ids"], b["token_ids"])
                   for a, b in zip(runs["auto"], runs["fp8"]))
    assert agreeing / (len(runs["auto"]) * NUM_NEW_TOKENS) > 0.3


@pytest.mark.cpu_suite  # Triton kernels on CPU tensors, under the interpreter (see conftest)
def test_fp8_chunked_prefill_dequantizes_the_prefix(tiny_model, monkeypatch):
    """Chunked prefill over an fp8 cache goes through the dequantization workspace on Triton."""
    from nanovllm.kernels.attention import prefill as triton_prefill

    calls = []
    dequantize = triton_prefill.dequantized_prefill_attention
    monkeypatch.setattr(triton_prefill, "dequantized_prefill_attention",
                        lambda *args, **kwargs: calls.append(args[8])
                        or dequantize(*args, **kwargs))
    prompt = list(range(3, 303))
    options = {**OPTIONS, "max_model_len": 512}
    outputs = {}
    for backend in ("triton", "torch"):
        with LLM(tiny_model, kv_cache_dtype="fp8", attention_backend=backend,
                 max_num_batched_tokens=150, **options) as llm:
            workspace = llm.llm_engine.model_runner.inputs.dequant_workspace
            if backend == "triton":  # K and V of max_model_len tokens, 2 kv heads of 16
                assert workspace.shape == (2, 512, 2, 16) and workspace.dtype == torch.float32
            else:
                assert workspace is None
            (outputs[backend],) = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert calls == [[(0, 1, 150, 300)]] * 2  # in each of 2 layers
    assert outputs["triton"]["token_ids"] == outputs["torch"]["token_ids"]
    for a, b in zip(outputs["triton"]["logprobs"], outputs["torch"]["logprobs"]):
        assert max(abs(a[t].logprob - b[t].logprob) for t in a.keys() & b.keys()) < 1e-4
