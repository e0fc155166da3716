"""vLLM's offline API as clients use it: engine options, prompt forms, the outputs, and the calls
RL trainers make (colocate weight path, reload, wake by tags). Exact against one engine or
transformers on the tiny checkpoint."""

import gc
import shutil

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.inputs import TextPrompt, TokensPrompt
from nanovllm.outputs import CompletionOutput, RequestOutput
from tests.conftest import _hf_model

pytestmark = pytest.mark.cpu_suite

OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, **OPTIONS) as llm:
        yield llm


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_engine_options_as_vllm_clients_pass_them(tiny_model, prompts):
    vllm_style = dict(seed=0, trust_remote_code=True, dtype=torch.float32, quantization=None,
                      max_num_batched_tokens=None, enable_sleep_mode=True, tokenizer=tiny_model,
                      tokenizer_mode="auto", distributed_executor_backend="mp",
                      disable_custom_all_reduce=True, disable_mm_preprocessor_cache=True,
                      load_format="auto", disable_log_stats=True, enable_chunked_prefill=True,
                      model_impl="auto", enable_lora=False, swap_space=4, block_size=16,
                      num_gpu_blocks_override=64, max_model_len=256)
    with LLM(tiny_model, **vllm_style) as llm:
        config = llm.llm_engine.config
        assert (config.kvcache_block_size, config.num_kvcache_blocks) == (16, 64)
        assert config.dtype == "float32" and config.max_num_batched_tokens == 16384
        assert token_ids(llm.generate(prompts[:2], GREEDY, use_tqdm=False))


@pytest.mark.parametrize("option,value,message", [
    ("enable_lora", True, "enable_lora=True is not supported: LoRA adapters are not supported"),
    ("quantization", "awq", "quantization='awq' is not supported: quantized weights"),
    ("model_impl", "transformers", "model_impl='transformers' is not supported"),
    ("distributed_executor_backend", "ray", "distributed_executor_backend='ray' is not supported"),
    ("pipeline_parallel_size", 2, "pipeline_parallel_size=2 is not supported"),
    ("tokenizer_mode", "mistral", "tokenizer_mode='mistral' is not one of"),
    ("load_format", "pt", "load_format='pt' is not one of"),
    ("max_logprobs", 21, r"max_logprobs must be an int in \[0, 20\], got 21"),
])
def test_engine_options_this_engine_cannot_honour(tiny_model, option, value, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, **{option: value}, **OPTIONS)


def test_engine_seed_makes_unseeded_requests_repeat(tiny_model, prompts):
    sampled = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = []
    for seed in (7, 7, 8):
        with LLM(tiny_model, seed=seed, **OPTIONS) as llm:
            runs.append(token_ids(llm.generate(prompts[:4], sampled, use_tqdm=False)))
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_prefix_caching_off_recomputes_every_prompt(tiny_model, prompts):
    prompt = prompts[1] * 3  # several full blocks
    # With the cache the second run computes only what follows the cached full blocks (at least
    # the last token); without it, all of the prompt again.
    cached = 16 * ((len(prompt) - 1) // 16)
    for enabled, second_run in ((True, len(prompt) - cached), (False, len(prompt))):
        with LLM(tiny_model, enable_prefix_caching=enabled, **OPTIONS) as llm:
            (first,) = llm.generate([prompt], GREEDY, use_tqdm=False)
            (again,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, n=2,
                                                              ignore_eos=True),
                                    use_tqdm=False)
            assert token_ids([again])[0] == token_ids([first])[0]
            assert llm.llm_engine.num_prefilled_tokens == len(prompt) + second_run
            # vLLM's RequestOutput.num_cached_tokens: the prompt's prefix-cache hit.
            assert (first.num_cached_tokens, again.num_cached_tokens) == (
                0, len(prompt) - second_run)


def test_the_trainers_calls(tiny_model, prompts):
    """TRL's colocate path, verl's, model_config, reload_weights, reset_prefix_cache -> True."""
    state = _hf_model(tiny_model).state_dict()
    with LLM(tiny_model, **OPTIONS) as llm:
        before = token_ids(llm.generate(prompts[:2], GREEDY, use_tqdm=False))
        engine = llm.llm_engine
        config = engine.model_config
        assert (config.max_model_len, config.dtype, config.model) == (256, torch.float32,
                                                                      tiny_model)
        assert config.hf_config.vocab_size == config.get_vocab_size() == 320
        assert llm.get_default_sampling_params() == SamplingParams()
        trl = engine.model_executor.driver_worker.model_runner.model
        verl = engine.model_executor.driver_worker.worker.model_runner.model
        name = "model.layers.0.mlp.down_proj.weight"
        assert trl.load_weights([(name, torch.zeros_like(state[name]))]) == {name}
        changed = token_ids(llm.generate(prompts[:2], GREEDY, use_tqdm=False))
        assert changed != before
        verl.load_weights(iter([(name, state[name])]))
        assert token_ids(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == before
        trl.load_weights([(name, torch.zeros_like(state[name]))])
        assert llm.collective_rpc("reload_weights") == [None]  # the checkpoint's weights again
        assert token_ids(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == before
        assert llm.reset_prefix_cache() is True and engine.reset_prefix_cache() is True
        with pytest.raises(NotImplementedError, match="'init_weight_update_group'"):
            llm.collective_rpc("init_weight_update_group")


def test_dummy_weights_then_an_update(tiny_model, prompts):
    """load_format="dummy": random weights of the checkpoint's shapes, until update_weights."""
    with LLM(tiny_model, **OPTIONS) as real:
        expected = token_ids(real.generate(prompts[:2], GREEDY, use_tqdm=False))
    with LLM(tiny_model, load_format="dummy", **OPTIONS) as llm:
        assert token_ids(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) != expected
        llm.update_weights(_hf_model(tiny_model).state_dict())
        assert token_ids(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == expected


def test_a_deleted_llm_is_freed(tiny_model, prompts):
    llm = LLM(tiny_model, **OPTIONS)
    expected = token_ids(llm.generate(prompts[:1], GREEDY, use_tqdm=False))
    del llm
    gc.collect()
    with LLM(tiny_model, **OPTIONS) as again:  # refused while the old engine lived
        assert token_ids(again.generate(prompts[:1], GREEDY, use_tqdm=False)) == expected


def test_another_tokenizer_directory(tiny_model, tmp_path, prompts):
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_model}/{name}", tokenizer_dir / name)
    with LLM(tiny_model, tokenizer=str(tokenizer_dir), **OPTIONS) as llm:
        assert llm.llm_engine.model_config.tokenizer == str(tokenizer_dir)
        assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].prompt_token_ids == \
            llm.get_tokenizer().encode("Hello")


def hf_logits(tiny_model: str, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' float32 logits [len(tokens), vocab] at each generated token's position."""
    with torch.no_grad():
        ids = torch.tensor([prompt + tokens[:-1]])
        return _hf_model(tiny_model)(ids).logits[0, len(prompt) - 1:].float()


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes_against_transformers(tiny_model, prompts, mode):
    """processed: after temperature and top-k, what the draw is from (-inf outside the top k)."""
    params = SamplingParams(temperature=0.5, top_k=5, max_tokens=6, ignore_eos=True, logprobs=3,
                            seed=11)
    with LLM(tiny_model, logprobs_mode=mode, **OPTIONS) as llm:
        out = llm.generate([prompts[2]], params, use_tqdm=False)[0].outputs[0]
    logits = hf_logits(tiny_model, prompts[2], out.token_ids)
    if mode.startswith("processed"):
        kth = logits.topk(5, dim=-1).values[:, -1:]
        logits = (logits / 0.5).masked_fill(logits < kth, -float("inf"))
    expected = torch.log_softmax(logits, dim=-1) if mode.endswith("logprobs") else logits
    for i, (token, entries) in enumerate(zip(out.token_ids, out.logprobs)):
        assert set(entries) >= set(expected[i].topk(3).indices.tolist()) and token in entries
        for t, entry in entries.items():
            assert entry.logprob == pytest.approx(expected[i, t].item(), rel=1e-4, abs=1e-4)
        assert entries[token].rank <= 5  # drawn from the top k


def test_logit_bias_allowed_token_ids_and_bad_words(tiny_model, prompts):
    sampled = dict(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3)
    with LLM(tiny_model, **OPTIONS) as llm:
        plain = llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        allowed = llm.generate([prompts[0]], SamplingParams(allowed_token_ids=[5, 9], **sampled),
                               use_tqdm=False)[0].outputs[0].token_ids
        assert set(allowed) <= {5, 9} and len(set(allowed)) == 2
        forced = llm.generate([prompts[0]], SamplingParams(logit_bias={17: 100}, **sampled),
                              use_tqdm=False)[0].outputs[0].token_ids
        assert forced == [17] * 16
        word = llm.tokenizer.decode([plain[0]])
        banned = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word])
        out = llm.generate([prompts[0]], banned, use_tqdm=False)[0].outputs[0].token_ids
        assert plain[0] not in out and out != plain[:8]
        # A row without controls in the same batch keeps its tokens.
        mixed = llm.generate([prompts[0], prompts[0]], [GREEDY, banned], use_tqdm=False)
        assert mixed[0].outputs[0].token_ids == plain and mixed[1].outputs[0].token_ids == out
        with pytest.raises(ValueError, match=r"allowed_token_ids has 320 outside the vocab"):
            llm.generate([prompts[0]], SamplingParams(allowed_token_ids=[320]))
        with pytest.raises(ValueError, match=r"bad_words has 'ab', which is 2 tokens"):
            llm.generate([prompts[0]], SamplingParams(bad_words=["ab"]))
    with LLM(tiny_model, max_logprobs=4, **OPTIONS) as small:
        with pytest.raises(ValueError, match=r"logprobs=5 exceeds the engine's max_logprobs=4"):
            small.generate([prompts[0]], SamplingParams(logprobs=5))


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 7}])
def test_prompt_logprobs_equal_transformers(tiny_model, prompts, options):
    """Every prompt token's logprob (the first: None) and the top 3, as transformers'
    log_softmax gives them, through chunked prefill and a prefix the cache holds."""
    prompt = prompts[1] * 2  # its second half repeats the first: a cached prefix, once computed
    with torch.no_grad():
        logits = _hf_model(tiny_model)(torch.tensor([prompt])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)  # [len(prompt), vocab]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, n=2)
    with LLM(tiny_model, **OPTIONS, **options) as llm:
        llm.generate([prompt], GREEDY, use_tqdm=False)  # fills the prefix cache
        out = llm.generate([prompt], params, use_tqdm=False)[0]
    logprobs = out.prompt_logprobs
    assert len(logprobs) == len(prompt) and logprobs[0] is None
    for position, entries in enumerate(logprobs[1:], 1):
        expected = reference[position - 1]
        token = prompt[position]
        assert set(entries) == {token} | set(expected.topk(3).indices.tolist())
        for t, entry in entries.items():
            assert entry.logprob == pytest.approx(expected[t].item(), abs=1e-5)
            assert entry.decoded_token == llm.tokenizer.decode([t])
        value = expected[token]
        assert int((expected > value + 1e-5).sum()) + 1 <= entries[token].rank
        assert entries[token].rank <= int((expected > value - 1e-5).sum()) + 1
    assert out.outputs[0].token_ids == out.outputs[1].token_ids  # greedy: both samples alike


# The module's engine: the tests above start their own, one engine alive at a time.
def test_request_output_fields_and_nano_vllm_keys(llm, prompts):
    out = llm.generate("Hello", SamplingParams(n=2, temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert isinstance(out, RequestOutput) and out.finished and out.prompt == "Hello"
    assert out.prompt_token_ids == llm.tokenizer.encode("Hello") and out.prompt_logprobs is None
    assert [type(c) for c in out.outputs] == [CompletionOutput] * 2
    assert [c.index for c in out.outputs] == [0, 1] and all(c.finished() for c in out.outputs)
    assert out["text"] == out.outputs[0].text and out["token_ids"] == out.outputs[0].token_ids
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    with pytest.raises(KeyError, match="'prompt_token_ids': a RequestOutput reads text"):
        out["prompt_token_ids"]
    with pytest.raises(TypeError, match="not iterable"):
        list(out)


def test_every_prompt_form_gives_the_same_tokens(llm):
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    forms = [text, ids, TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids),
             {"prompt_token_ids": torch.tensor(ids)}]
    outputs = llm.generate(forms, GREEDY, use_tqdm=False)  # mixed in one call
    assert len({tuple(t) for t in token_ids(outputs)}) == 1
    assert [o.prompt for o in outputs] == [text, None, text, None, None]
    assert all(o.prompt_token_ids == ids for o in outputs)
    older = llm.generate(prompt_token_ids=[ids, ids[:3]], sampling_params=GREEDY, use_tqdm=False)
    assert token_ids(older)[0] == token_ids(outputs)[0]
    assert token_ids(llm.generate(prompt_token_ids=ids, use_tqdm=False))  # one list, defaults
    with pytest.raises(TypeError, match="pass prompts or prompt_token_ids=, not both"):
        llm.generate([ids], prompt_token_ids=[ids])
    with pytest.raises(ValueError, match="lora_request is not supported"):
        llm.generate([ids], GREEDY, lora_request=object())


def test_sampling_params_vllm_fields(llm, prompts):
    prompt = prompts[0]
    base = token_ids(llm.generate([prompt], GREEDY, use_tqdm=False))[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                 best_of=1, detokenize=False), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == base and out.outputs[0].text == ""
    truncated = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                               truncate_prompt_tokens=5)
    out = llm.generate([prompt], truncated, use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-5:]
    assert out.outputs[0].token_ids == token_ids(llm.generate([prompt[-5:]], GREEDY,
                                                              use_tqdm=False))[0]
    with pytest.raises(ValueError, match=r"best_of must be equal to n=2 .* got 3"):
        SamplingParams(n=2, best_of=3)
    with pytest.raises(ValueError, match="stop strings \\['x'\\] need detokenize=True"):
        SamplingParams(stop="x", detokenize=False)
