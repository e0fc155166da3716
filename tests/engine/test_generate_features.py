"""vLLM's sampling, stopping and output features end to end: filters, seeds, min_tokens, stop ids
and strings, logprobs against transformers, chat, stream."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer, StreamDecoder, WindowDecoder
from tests.conftest import NUM_NEW_TOKENS, _hf_model

pytestmark = pytest.mark.cpu_suite  # exact against transformers on the CPU (see conftest)

GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=96, max_model_len=256) as engine:
        yield engine


@pytest.fixture
def eos_is(llm):
    """Pretend `token` is the EOS token (the random model rarely samples the real one)."""
    saved = llm.llm_engine.eos_token_ids, llm.llm_engine.scheduler.eos_token_ids

    def set_eos(token: int):
        llm.llm_engine.eos_token_ids = llm.llm_engine.scheduler.eos_token_ids = {token}

    yield set_eos
    llm.llm_engine.eos_token_ids, llm.llm_engine.scheduler.eos_token_ids = saved


def generate(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("controls", [{"top_k": 1}, {"top_p": 1e-6},
                                      {"top_k": 1, "top_p": 0.5, "min_p": 0.9}])
def test_tightest_filters_generate_the_greedy_tokens(llm, prompts, hf_reference, controls):
    params = SamplingParams(temperature=1.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, **controls)
    assert [o["token_ids"] for o in generate(llm, prompts[:5], params)] == hf_reference[:5]


def test_same_seed_same_tokens_in_any_batch(llm, prompts):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = generate(llm, [prompts[2]], seeded)[0]["token_ids"]
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (3, 20, 9)]
    seed_99 = SamplingParams(temperature=0.8, seed=99, max_tokens=12)
    crowded = generate(llm, [prompts[0], prompts[4], prompts[2], prompts[1]],
                       [others[0], seed_99, seeded, others[1]])
    assert crowded[2]["token_ids"] == alone
    assert generate(llm, [prompts[2], prompts[2]], [others[2], seeded])[1]["token_ids"] == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=16,
                                ignore_eos=True)
    assert generate(llm, [prompts[2]], other_seed)[0]["token_ids"] != alone


def hf_greedy_masked(prompt: list[int], banned: int, min_tokens: int, max_tokens: int,
                     model_path: str) -> list[int]:
    """transformers' greedy tokens, `banned` masked for min_tokens tokens, up to its appearance."""
    model, ids, out = _hf_model(model_path), list(prompt), []
    with torch.no_grad():
        while len(out) < max_tokens:
            logits = model(torch.tensor([ids])).logits[0, -1]
            if len(out) < min_tokens:
                logits[banned] = -float("inf")
            out.append(int(logits.argmax()))
            ids.append(out[-1])
            if out[-1] == banned:
                break
    return out


@pytest.mark.parametrize("as_eos", [True, False])
def test_min_tokens_holds_back_eos_and_stop_ids(llm, tiny_model, prompts, hf_reference, eos_is,
                                                as_eos):
    # A prompt whose second greedy token, masked for 5 tokens, is still produced later on.
    prompt, stop, expected = next(
        (prompt, ref[1], masked) for prompt, ref in zip(prompts, hf_reference)
        if (masked := hf_greedy_masked(prompt, ref[1], 5, NUM_NEW_TOKENS, tiny_model))[-1]
        == ref[1])
    if as_eos:
        eos_is(stop)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, min_tokens=5,
                            stop_token_ids=[] if as_eos else [stop])
    (out,) = generate(llm, [prompt], params)
    assert out["token_ids"] == expected and len(expected) > 5
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", None if as_eos else stop)


def test_stop_token_ids_end_generation(llm, prompts, hf_reference):
    ref = hf_reference[3]
    stop = ref[4]
    first = ref.index(stop)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, stop_token_ids=[stop])
    (out,) = generate(llm, [prompts[3]], params)
    assert out["token_ids"] == ref[:first + 1]
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", stop)
    decode = llm.tokenizer.decode
    assert out["text"] == decode(ref[:first], skip_special_tokens=True)  # without the stop id
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, stop_token_ids=[stop],
                            include_stop_str_in_output=True, skip_special_tokens=False)
    assert generate(llm, [prompts[3]], params)[0]["text"] == decode(ref[:first + 1])


def ascii_stop_string(llm, prompt, twice: bool = False) -> tuple[str, str, list[int], int]:
    """A two-character ASCII stop string (two tokens) from the greedy text, of two different
    characters or (`twice`) occurring again later: (it, the text, the tokens, the number of tokens
    up to its first end)."""
    (ref,) = generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    text, tokens = ref["text"], ref["token_ids"]

    def fits(pair: str, i: int) -> bool:
        if twice:
            return text.find(pair, text.find(pair) + 1) != -1
        return text[i] != text[i + 1]

    stop = next((text[i:i + 2] for i in range(4, len(text) - 1)
                 if text[i:i + 2].isascii() and fits(text[i:i + 2], i)), None)
    assert stop is not None, f"no ASCII pair in {text!r}"
    decode = llm.tokenizer.decode
    n = next(n for n in range(len(tokens)) if stop in decode(tokens[:n], skip_special_tokens=True))
    return stop, text, tokens, n


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(llm, prompts, include):
    stop, text, tokens, n = ascii_stop_string(llm, prompts[1])
    at = text.find(stop)
    params = SamplingParams(temperature=0, max_tokens=48, stop=["never-appears", stop],
                            include_stop_str_in_output=include)
    (out,) = generate(llm, [prompts[1]], params)
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", stop)
    assert out["text"] == (text[:at + len(stop)] if include else text[:at])
    assert out["token_ids"] == tokens[:n]  # ended at the token completing the stop string...
    before = llm.tokenizer.decode(tokens[:n - 1], skip_special_tokens=True)
    assert stop[0] in before[at:]  # ...split over two
    engine = llm.llm_engine
    assert engine.scheduler.block_manager.num_free_blocks == engine.num_kvcache_blocks  # freed


def test_stop_string_respects_min_tokens(llm, prompts):
    stop, text, tokens, n = ascii_stop_string(llm, prompts[1], twice=True)
    (out,) = generate(llm, [prompts[1]], SamplingParams(temperature=0, max_tokens=48, stop=stop,
                                                        min_tokens=n))
    # The first occurrence ends within min_tokens tokens: only a later one counts.
    later = text.find(stop, text.find(stop) + 1)
    assert (out["finish_reason"], out["stop_reason"], out["text"]) == ("stop", stop, text[:later])
    assert len(out["token_ids"]) > n and out["token_ids"] == tokens[:len(out["token_ids"])]
    (out,) = generate(llm, [prompts[1]], SamplingParams(temperature=0, max_tokens=48, stop=stop,
                                                        min_tokens=n - 1))
    assert (out["text"], out["token_ids"]) == (text[:text.find(stop)], tokens[:n])  # the first


def test_logprobs_match_transformers(llm, tiny_model, prompts):
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5),
              SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True, logprobs=2, seed=5,
                             top_k=40, repetition_penalty=1.3)]
    outputs = generate(llm, [prompts[2], prompts[3]], params)
    model = _hf_model(tiny_model)
    for prompt, p, out in zip([prompts[2], prompts[3]], params, outputs):
        with torch.no_grad():
            ids = torch.tensor([prompt + out["token_ids"][:-1]])
            logits = model(ids).logits[0, len(prompt) - 1:]
        reference = torch.log_softmax(logits.float(), dim=-1)  # [6, vocab]
        assert len(out["logprobs"]) == 6
        total = 0.0
        for i, (token, logprobs) in enumerate(zip(out["token_ids"], out["logprobs"])):
            top = reference[i].topk(p.logprobs).indices.tolist()
            assert set(logprobs) == set(top) | {token}
            for t, entry in logprobs.items():
                expected = reference[i, t].item()
                assert entry.logprob == pytest.approx(expected, abs=1e-4)
                # The rank among the vocabulary, up to ties within the same tolerance.
                above = int((reference[i] > expected + 1e-4).sum())
                assert above + 1 <= entry.rank <= int((reference[i] > expected - 1e-4).sum()) + 1
                assert entry.decoded_token == llm.tokenizer.decode([t])
            total += logprobs[token].logprob
        assert out["cumulative_logprob"] == pytest.approx(total)
    assert "logprobs" not in generate(llm, [prompts[0]], SamplingParams(max_tokens=2))[0]


def test_chat_applies_the_template(llm, monkeypatch):
    conversations = [[{"role": "user", "content": "héllo"}],
                     [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]]
    expected = [llm.tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"]
                for c in conversations]
    assert expected[0][-1] != llm.tokenizer.encode("héllo")[-1]  # the assistant turn was opened
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    replies = llm.chat(conversations, params, use_tqdm=False)
    generated = generate(llm, expected, params)
    assert [r["token_ids"] for r in replies] == [o["token_ids"] for o in generated]
    one = llm.chat(conversations[1], params, use_tqdm=False)[0]  # one conversation
    assert one.outputs == replies[1].outputs
    seen = []
    monkeypatch.setattr(llm, "generate", lambda prompts, *args: seen.extend(prompts))
    llm.chat(conversations, params)
    assert seen == expected
    with pytest.raises(TypeError, match="conversation 1 must be a non-empty list"):
        llm.chat([conversations[0], [{"role": "user"}]], params)


def test_chat_template_options_as_vllm_takes_them(llm, monkeypatch):
    """continue_final_message leaves the last message open; chat_template_kwargs reach the
    template (the tiny template's Qwen3 enable_thinking switch)."""
    seen = []
    monkeypatch.setattr(llm, "generate", lambda prompts, *args: seen.extend(prompts))
    partial = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    llm.chat(partial, add_generation_prompt=False, continue_final_message=True)
    llm.chat(partial[:1], chat_template_kwargs={"enable_thinking": False})
    assert [llm.tokenizer.decode(ids) for ids in seen] == [
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce upon",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"]
    with pytest.raises(ValueError, match="add_generation_prompt and continue_final_message"):
        llm.chat(partial, continue_final_message=True)
    with pytest.raises(ValueError, match=r"\['tokenize'\] are apply_chat_template's own"):
        llm.chat(partial, chat_template_kwargs={"tokenize": True, "enable_thinking": True})
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        llm.chat(partial, chat_template_kwargs=["enable_thinking"])


def collect(stream) -> dict[int, dict]:
    merged: dict[int, dict] = {}
    for out in stream:
        m = merged.setdefault(out.index, {"text": "", "token_ids": [], "deltas": [], "done": 0})
        assert not m["done"], "output after finished"
        m["text"] += out.text
        m["token_ids"] += out.token_ids
        m["deltas"].append(out.text)
        m["done"] += out.finished
        m["finish_reason"], m["stop_reason"] = out.finish_reason, out.stop_reason
    return merged


def test_stream_concatenates_to_generate(llm, prompts):
    stop = ascii_stop_string(llm, prompts[1])[0]
    batch = [prompts[1], prompts[0], prompts[5], prompts[1]]
    params = [SamplingParams(temperature=0, max_tokens=40, stop=stop),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                             skip_special_tokens=False),
              SamplingParams(temperature=0, max_tokens=40, stop=stop,
                             include_stop_str_in_output=True)]
    expected = generate(llm, batch, params)
    streamed = collect(llm.stream(batch, params))
    for i, out in enumerate(expected):
        got = streamed[i]
        assert (got["text"], got["token_ids"]) == (out["text"], out["token_ids"]), i
        assert (got["finish_reason"], got["stop_reason"], got["done"]) == (
            out["finish_reason"], out["stop_reason"], 1)
    assert expected[0]["stop_reason"] == stop and expected[1]["finish_reason"] == "length"
    assert llm.llm_engine.scheduler.is_finished()


def test_stream_never_splits_a_character(llm, monkeypatch):
    """Force the output to be non-ASCII text (a bias on the scripted token at each step): every
    delta is whole characters, even though é is two tokens and ✓ three."""
    target = "héllo wörld ✓ 日本"
    script = llm.tokenizer.encode(target)
    assert len(script) > len(target) + 5
    model = llm.llm_engine.model_runner.model
    inner = model.compute_logits
    step = iter(range(10**6))

    def scripted(hidden):
        logits = inner(hidden)
        logits[:, script[min(next(step), len(script) - 1)]] += 1e4
        return logits

    monkeypatch.setattr(model, "compute_logits", scripted)
    out = collect(llm.stream(["prompt"], SamplingParams(temperature=0, max_tokens=len(script))))[0]
    assert out["text"] == target and out["token_ids"] == script
    assert all("\ufffd" not in delta for delta in out["deltas"])
    held_back = sum(delta == "" for delta in out["deltas"])
    assert held_back >= len(script) - len(target)


class WithoutRustBackend:
    """The tokenizer's decode alone: the detokenizer falls back to decoding windows of tokens."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def test_both_detokenizers_emit_whole_characters_and_the_full_decode(llm):
    tok = llm.tokenizer
    valid = tok.encode("✓")[-1:] + tok.encode("héllo wörld ✓ 日本") + [258] + tok.encode("ok")
    # A lone lead byte, a cut-short tail.
    broken = tok.encode("é")[:1] + tok.encode("x") + tok.encode("✓")[:2]
    deltas = {}
    for name, tokenizer in [("rust", tok), ("window", WithoutRustBackend(tok))]:
        # The prompt ends inside a character, whose missing byte the output starts with.
        prompt = tok.encode("prompt ✓")[:-1]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
        assert type(detokenizer.decoder) is (StreamDecoder if name == "rust" else WindowDecoder)
        deltas[name] = []
        for i, token_id in enumerate(valid + broken):
            before = detokenizer.text
            detokenizer.update(token_id, finished=i == len(valid + broken) - 1,
                               stop_terminated=False)
            deltas[name].append(detokenizer.text[len(before):])
        assert detokenizer.text == tok.decode(valid + broken, skip_special_tokens=True)
    assert deltas["rust"] == deltas["window"]
    assert "".join(deltas["rust"][:len(valid)]) == "\ufffdhéllo wörld ✓ 日本ok"
    assert deltas["rust"][:2] == ["", "\ufffdh"]  # a stray byte shows once a character follows it
    assert all("\ufffd" not in delta for delta in deltas["rust"][2:len(valid)])
    assert deltas["rust"][len(valid):] == ["", "\ufffdx", "", "\ufffd"]


def test_closing_a_stream_early_frees_its_requests(llm, prompts):
    stream = llm.stream(prompts[:3], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    next(stream)
    stream.close()
    assert llm.llm_engine.scheduler.is_finished()
    engine = llm.llm_engine
    assert engine.scheduler.block_manager.num_free_blocks == engine.num_kvcache_blocks


def test_request_validation_is_atomic(llm, prompts):
    with pytest.raises(ValueError,
                       match=r"sampling_params\[1\].stop_token_ids has 320 outside the vocabulary"):
        llm.stream(prompts[:2], [GREEDY, SamplingParams(stop_token_ids=[5, 320])])
    with pytest.raises(TypeError, match="temperature must be a float"):
        llm.generate(prompts[:2], [GREEDY, SamplingParams(temperature=None)])
    assert llm.llm_engine.scheduler.is_finished()
