"""End-to-end checks on an NVIDIA GPU (skipped without CUDA): bf16, both backends, CUDA graphs."""

import random
import subprocess
import sys

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.layers.attention import Attention
from nanovllm.runner.cuda_graph import DecodeGraphs
from nanovllm.testing.tiny_model import write_tiny_qwen3
from tests.conftest import needs_cuda

pytestmark = needs_cuda  # conftest adds the `cuda` marker
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_bf16_split_k(tmp_path_factory) -> str:
    """hidden_size 512: decode_from_qkv sums the split-K qkv projection's partials itself."""
    path = str(tmp_path_factory.mktemp("tiny-bf16-split-k"))
    write_tiny_qwen3(path, dtype="bfloat16", hidden_size=512, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=128, intermediate_size=1024)
    return path


def _generate(path, prompts, max_model_len=1024, **options):
    with LLM(path, max_model_len=max_model_len, **options) as llm:
        return [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("backend", ["flash_attn", "triton"])
def test_cuda_graph_decode_equals_eager(tiny_bf16, prompts, backend):
    """Graphs replay batches padded to their bucket (Triton: in the metadata's decode order)."""
    if backend == "flash_attn":
        pytest.importorskip("flash_attn")
    eager = _generate(tiny_bf16, prompts, enforce_eager=True, attention_backend=backend)
    graphs = _generate(tiny_bf16, prompts, enforce_eager=False, max_num_seqs=20,  # 1,2,4,8,16,20
                       attention_backend=backend)
    assert graphs == eager


def test_triton_backend_equals_flash_attn(tiny_bf16, prompts):
    pytest.importorskip("flash_attn")
    assert _generate(tiny_bf16, prompts, attention_backend="triton") == _generate(
        tiny_bf16, prompts, attention_backend="flash_attn")


def test_decode_from_qkv_equals_flash_attn(tiny_bf16_split_k, prompts, monkeypatch):
    """decode_from_qkv (eager and in graphs) generates what flash-attn after qk_norm_rope does."""
    pytest.importorskip("flash_attn")
    calls, decode_from_qkv = [], Attention.decode_from_qkv
    monkeypatch.setattr(Attention, "decode_from_qkv",
                        lambda *args: calls.append(1) or decode_from_qkv(*args))
    eager = _generate(tiny_bf16_split_k, prompts, enforce_eager=True, attention_backend="triton")
    assert calls, "the Triton decode did not take decode_from_qkv"
    assert eager == _generate(tiny_bf16_split_k, prompts, attention_backend="flash_attn")
    assert _generate(tiny_bf16_split_k, prompts, attention_backend="triton",
                     max_num_seqs=20) == eager


def test_decode_of_17_to_32_rows_equals_flash_attn_after_cublas(tiny_bf16, monkeypatch):
    """Decode steps of 28 rows in the skinny GEMMs and decode_from_qkv, eager and from graphs,
    generate what flash-attn after cuBLAS does. max_model_len 256: one split of the keys, as eager
    steps take (two sum in another order); no split K (its sums can turn a greedy token)."""
    pytest.importorskip("flash_attn")
    import nanovllm.layers.linear as linear_module

    def generate(**options):
        return _generate(tiny_bf16, many, max_model_len=256, **options)

    rng = random.Random(1)
    many = [[rng.randrange(256) for _ in range(rng.randrange(1, 80))] for _ in range(28)]
    skinny_applies = linear_module.skinny_applies
    monkeypatch.setattr(linear_module, "skinny_applies",
                        lambda x: skinny_applies(x) and x.shape[0] <= 16)
    reference = generate(enforce_eager=True, attention_backend="flash_attn")
    monkeypatch.undo()
    gemm_rows, attention_rows = [], []
    skinny_linear, decode_from_qkv = linear_module.skinny_linear, Attention.decode_from_qkv
    monkeypatch.setattr(linear_module, "skinny_linear", lambda x, *args, **kwargs:
                        gemm_rows.append(x.shape[0]) or skinny_linear(x, *args, **kwargs))
    monkeypatch.setattr(Attention, "decode_from_qkv", lambda self, inputs, meta:
                        attention_rows.append(meta.context_lens.numel())
                        or decode_from_qkv(self, inputs, meta))
    assert generate(enforce_eager=True, attention_backend="triton") == reference
    assert 28 in gemm_rows and 28 in attention_rows, (sorted(set(gemm_rows)),
                                                      sorted(set(attention_rows)))
    monkeypatch.undo()
    assert generate(attention_backend="triton", max_num_seqs=32) == reference


def test_bf16_logits_and_first_tokens_agree_with_transformers(tiny_bf16, prompts):
    """Our bf16 logits are as close to float32's as transformers' bf16 ones; clear winners agree."""
    from transformers import AutoModelForCausalLM

    from tests.models.test_model import our_logits

    hf16 = AutoModelForCausalLM.from_pretrained(tiny_bf16, dtype=torch.bfloat16).cuda().eval()
    hf32 = AutoModelForCausalLM.from_pretrained(tiny_bf16, dtype=torch.float32).cuda().eval()
    with LLM(tiny_bf16, max_model_len=1024, enforce_eager=True) as llm:
        ours = our_logits(llm, prompts)
        first_tokens = [o["token_ids"][0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    clear = 0
    for prompt, logits, first in zip(prompts, ours, first_tokens):
        with torch.no_grad():
            ids = torch.tensor([prompt], device="cuda")
            ref = hf32(ids).logits[0].float()
            theirs = hf16(ids).logits[0].float()
        our_err, their_err = (logits.float() - ref).abs().max(), (theirs - ref).abs().max()
        assert our_err <= 2 * their_err + 1e-2, (our_err, their_err)
        top2 = ref[-1].topk(2).values
        if top2[0] - top2[1] > 4 * max(our_err, their_err):
            clear += 1
            assert first == ref[-1].argmax().item()
    assert clear >= len(prompts) // 2, f"only {clear} prompts had a clear float32 winner"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_2_agrees_with_1(tiny_bf16, prompts):
    one = _generate(tiny_bf16, prompts)
    two = _generate(tiny_bf16, prompts, tensor_parallel_size=2)
    agreed = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
              for x, y in zip(one, two)]
    print(f"TP=2 tokens agreeing with TP=1 before the first difference: {agreed}")
    assert sum(a > 0 for a in agreed) >= len(prompts) - 1  # bf16 sums reorder across ranks


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_killed_worker_raises_instead_of_hanging_in_nccl(tiny_bf16):
    """Waiting for a step watches the workers (in a process of its own: NCCL's abort may hang)."""
    code = ("from nanovllm import LLM; "
            "from tests.runner.test_tensor_parallel import check_killed_worker_raises; "
            f"check_killed_worker_raises(LLM({tiny_bf16!r}, tensor_parallel_size=2, "
            "max_model_len=1024), max_tokens=500)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def test_memory_profiled_pool(tiny_bf16):
    with LLM(tiny_bf16, gpu_memory_utilization=0.5) as llm:
        blocks = llm.llm_engine.num_kvcache_blocks
        used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    total = torch.cuda.mem_get_info()[1]
    assert blocks > 0
    assert used <= 0.5 * total * 1.02  # the pool filled what utilization allowed, not more
    with pytest.raises(RuntimeError, match="no GPU memory left for the KV cache"):
        LLM(tiny_bf16, gpu_memory_utilization=0.001)


def test_sampling_controls_on_cuda(tiny_bf16, prompts):
    """The general sampler path (filters, penalties, seeds, logprobs) beside greedy rows."""
    controlled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=7,
                                repetition_penalty=1.2, presence_penalty=0.5,
                                frequency_penalty=0.3, logprobs=3, max_tokens=8, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    params = [controlled, greedy] * (len(prompts) // 2)
    with LLM(tiny_bf16, max_model_len=1024) as llm:
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts[::-1], params[::-1], use_tqdm=False)[::-1]
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second]  # reproduced
    for out in first[0::2]:
        assert len(out["logprobs"]) == 8 and all(len(step) >= 3 for step in out["logprobs"])
        assert all(lp.logprob <= 0 for step in out["logprobs"] for lp in step.values())


def test_sampler_graphs_sample_what_the_eager_sampler_does(tiny_bf16, prompts):
    """Every control, from sampler graphs, samples what the eager sampler does, logprobs too."""
    def params(i: int) -> SamplingParams:
        length = dict(max_tokens=10 + 3 * i, ignore_eos=True)
        if i % 3 == 0:
            return SamplingParams(temperature=0, min_tokens=4, logprobs=1, **length)
        if i % 3 == 1:
            return SamplingParams(temperature=0.8, top_k=10 + i, top_p=0.9, min_p=0.05, seed=i,
                                  logprobs=3, repetition_penalty=1.2, presence_penalty=0.5,
                                  frequency_penalty=0.3, **length)
        return SamplingParams(temperature=0.7, top_p=0.8, seed=i, **length)

    batch = [params(i) for i in range(len(prompts))]
    outputs = {}
    for eager in (True, False):  # max_model_len 256: one split of the keys, as in eager steps
        with LLM(tiny_bf16, max_model_len=256, enforce_eager=eager) as llm:
            outputs[eager] = llm.generate(prompts, batch, use_tqdm=False)
            if not eager:
                # the graphs did the sampling
                assert llm.llm_engine.model_runner.sampler_graphs.captured
    for want, got in zip(outputs[True], outputs[False]):
        assert got["token_ids"] == want["token_ids"]
        assert ("logprobs" in got) == ("logprobs" in want)
        for got_step, want_step in zip(got["logprobs"] or [], want["logprobs"] or []):
            assert got_step.keys() == want_step.keys()
            for token, entry in got_step.items():
                assert entry.logprob == pytest.approx(want_step[token].logprob, abs=1e-5)
                assert entry.rank == want_step[token].rank


def test_decode_graphs_sample_temperature_steps_as_the_eager_sampler_does(tiny_bf16, prompts,
                                                                          monkeypatch):
    """Temperature-only decode steps draw from the head graphs what the eager engine draws."""
    replayed_rows = []
    sample = DecodeGraphs.sample
    monkeypatch.setattr(DecodeGraphs, "sample", lambda self, meta, num_seqs: replayed_rows.append(
        num_seqs) or sample(self, meta, num_seqs))
    params = [SamplingParams(temperature=0, min_tokens=6, max_tokens=8, stop_token_ids=[3])
              if i == 0 else SamplingParams(temperature=0.8, max_tokens=4 + 3 * i, ignore_eos=True)
              for i in range(len(prompts))]
    outputs = {}
    for eager in (True, False):  # max_model_len 256: one split of the keys, as in eager steps
        with LLM(tiny_bf16, max_model_len=256, enforce_eager=eager, max_num_seqs=20) as llm:
            torch.manual_seed(1)
            outputs[eager] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs[False] == outputs[True]
    # Prefill samples every first token; the first 5 decode steps hold row 0's stop ids back
    # (eager); then every decode step samples in the graphs, down to the longest row alone.
    num_decode_steps = max(p.max_tokens for p in params) - 1
    assert len(replayed_rows) == num_decode_steps - 5 and replayed_rows[-1] == 1
    assert replayed_rows == sorted(replayed_rows, reverse=True)
