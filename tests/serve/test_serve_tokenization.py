"""vLLM's /tokenize, /detokenize and /tokenizer_info; a chat's template options (continue the last
message, chat_template_kwargs) on /v1/chat/completions, /tokenize and LLM.chat alike."""

from types import SimpleNamespace

from conftest import MODEL_NAME
from serve_helpers import assert_error, completions_of, post, request

from nanovllm import SamplingParams
from nanovllm.serve.app import build_app

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
PARTIAL = [{"role": "user", "content": "Tell me a story"},
           {"role": "assistant", "content": "Once upon"}]


def test_tokenize_a_prompt_as_a_completion_reads_it(server, client, llm):
    status, body = post(server, "/tokenize", {"model": MODEL_NAME, "prompt": "Hello world",
                                              "return_token_strs": True})
    assert status == 200, body
    expected = llm.tokenizer.encode("Hello world")
    assert body == {"count": len(expected), "max_model_len": llm.llm_engine.limits.max_model_len,
                    "tokens": expected,
                    "token_strs": llm.tokenizer.convert_ids_to_tokens(expected)}
    response = client.completions.create(model=MODEL_NAME, prompt="Hello world", max_tokens=1)
    assert response.usage.prompt_tokens == body["count"]


def test_tokenize_messages_as_a_chat_completion_renders_them(server, client, llm):
    status, body = post(server, "/tokenize", {"messages": MESSAGES})
    assert status == 200, body
    offline = llm.chat(MESSAGES, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert body["tokens"] == offline.prompt_token_ids and body["token_strs"] is None
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1)
    assert response.usage.prompt_tokens == body["count"]


def rendered(server, **options) -> str:
    """The text /tokenize makes of the messages with these template options, read back."""
    status, body = post(server, "/tokenize", {"messages": options.pop("messages", MESSAGES),
                                              **options})
    assert status == 200, body
    status, text = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200, text
    return text["prompt"]


def test_template_options_reach_the_template(server):
    assert rendered(server) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert rendered(server, chat_template_kwargs={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert rendered(server, messages=PARTIAL, add_generation_prompt=False,
                    continue_final_message=True) == (
        "<|im_start|>user\nTell me a story<|im_end|>\n<|im_start|>assistant\nOnce upon")


def test_chat_completion_takes_the_template_options_as_llm_chat_does(client, llm):
    for options in ({"chat_template_kwargs": {"enable_thinking": False}},
                    {"add_generation_prompt": False, "continue_final_message": True}):
        messages = PARTIAL if "continue_final_message" in options else MESSAGES
        offline = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8),
                           use_tqdm=False, **options)[0]
        response = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                  temperature=0, max_tokens=8,
                                                  extra_body=options)
        assert response.choices[0].message.content == completions_of(offline)[0]["text"]
        assert response.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_bad_template_options_are_400s_naming_them(server):
    assert_error(*post(server, "/tokenize", {"messages": PARTIAL, "continue_final_message": True}),
                 400, "add_generation_prompt", "continue_final_message")
    assert_error(*post(server, "/v1/chat/completions", {
        "messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}), 400, "'tokenize'")
    assert_error(*post(server, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": 3}),
                 400, "chat_template_kwargs")


def test_detokenize_reads_the_ids_back(server, llm):
    ids = llm.tokenizer.encode("<|im_start|>user\nHello world")
    status, body = post(server, "/detokenize", {"model": MODEL_NAME, "tokens": ids})
    assert (status, body) == (200, {"prompt": "<|im_start|>user\nHello world"})
    vocab = llm.llm_engine.limits.vocab_size
    assert_error(*post(server, "/detokenize", {"tokens": [1, vocab]}), 400, str(vocab),
                 f"[0, {vocab})")
    assert_error(*post(server, "/detokenize", {"tokens": "abc"}), 400, "tokens")
    assert_error(*post(server, "/tokenize", {"model": "other", "prompt": "x"}), 404, "'other'")
    assert_error(*post(server, "/tokenize", b"{"), 400, "not valid JSON")


def test_tokenizer_info_has_what_a_remote_tokenizer_reads(server, llm):
    status, info = request(server, "/tokenizer_info")
    assert status == 200, info
    tokenizer = llm.tokenizer
    assert info["eos_token"] == "<|im_end|>" == tokenizer.eos_token
    assert info["pad_token"] == "<|endoftext|>"
    assert info["chat_template"] == tokenizer.chat_template
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert "vocab_file" not in info


def test_tokenizer_info_only_when_asked(tiny_model, llm):
    """As vLLM, /tokenizer_info (it shows the chat template) is served only when enabled."""
    engine = SimpleNamespace(tokenizer=llm.tokenizer, limits=llm.llm_engine.limits)
    for enabled in (False, True):
        paths = {route.path for route in build_app(engine, "m", tokenizer_info=enabled).routes}
        assert {"/tokenize", "/detokenize"} <= paths
        assert ("/tokenizer_info" in paths) == enabled


def test_logit_bias_moves_the_logits_as_offline(client, llm):
    token_id = 100
    offline = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=6,
                                                     logit_bias={token_id: 100.0}),
                           use_tqdm=False)[0]
    response = client.completions.create(model=MODEL_NAME, prompt="Hello", temperature=0,
                                         max_tokens=6, logit_bias={str(token_id): 100},
                                         extra_body={"return_token_ids": True})
    assert response.choices[0].token_ids == list(offline.outputs[0].token_ids)
    # The tiny model's logits are a few units at most: +100 makes the token the argmax.
    assert response.choices[0].token_ids == [token_id] * 6


def test_bad_logit_bias_is_a_400_naming_it(server):
    completions = "/v1/completions"
    assert_error(*post(server, completions, {"prompt": "x", "logit_bias": {"abc": 1}}), 400,
                 "logit_bias", "'abc'")
    assert_error(*post(server, completions, {"prompt": "x", "logit_bias": {"1": 101}}), 400,
                 "logit_bias", "101")
    assert_error(*post(server, completions, {"prompt": "x", "logit_bias": {"100000": 1}}), 400,
                 "100000")
