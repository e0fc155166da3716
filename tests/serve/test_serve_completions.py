"""/v1/completions and /v1/models through the official client: the same tokens as offline."""

import asyncio
import math

from conftest import MODEL_NAME, async_client
from serve_helpers import completions_of

from nanovllm import SamplingParams

GREEDY = dict(temperature=0, max_tokens=12)
TOKEN_PROMPTS = [[5, 17, 33, 90], [200, 201, 7], [64] * 20]


def test_models_lists_the_served_model(client, llm):
    (card,) = client.models.list().data
    assert card.id == MODEL_NAME
    assert card.max_model_len == llm.llm_engine.limits.max_model_len


def test_greedy_text_equals_offline_generate(client, llm):
    expected = completions_of(llm.generate(["Hello, world"], SamplingParams(**GREEDY),
                                           use_tqdm=False)[0])[0]
    response = client.completions.create(model=MODEL_NAME, prompt="Hello, world", **GREEDY,
                                         extra_body={"return_token_ids": True})
    (choice,) = response.choices
    assert choice.text == expected["text"]
    assert choice.token_ids == expected["token_ids"]
    assert choice.finish_reason == "length"
    num_prompt = len(llm.tokenizer.encode("Hello, world"))
    assert response.usage.prompt_tokens == num_prompt
    assert response.usage.completion_tokens == GREEDY["max_tokens"]
    assert response.usage.total_tokens == num_prompt + GREEDY["max_tokens"]


def test_a_batch_of_token_prompts_with_n_samples(client, llm):
    params = SamplingParams(n=2, seed=7, temperature=0.8, max_tokens=8)
    expected = [s for out in llm.generate(TOKEN_PROMPTS, params, use_tqdm=False)
                for s in completions_of(out)]
    response = client.completions.create(model=MODEL_NAME, prompt=TOKEN_PROMPTS, n=2, seed=7,
                                         temperature=0.8, max_tokens=8,
                                         extra_body={"return_token_ids": True})
    assert [c.index for c in response.choices] == list(range(6))
    assert [c.token_ids for c in response.choices] == [e["token_ids"] for e in expected]
    assert response.usage.prompt_tokens == sum(map(len, TOKEN_PROMPTS))
    assert response.usage.completion_tokens == 6 * 8


def test_streamed_text_equals_the_whole_answer(client, server):
    whole = client.completions.create(model=MODEL_NAME, prompt="Stream me", **GREEDY)

    async def stream():
        async with async_client(server) as aclient:
            chunks = await aclient.completions.create(
                model=MODEL_NAME, prompt="Stream me", stream=True,
                stream_options={"include_usage": True}, **GREEDY)
            return [chunk async for chunk in chunks]

    chunks = asyncio.run(stream())
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_logprobs_are_the_engines(client, llm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    expected = llm.generate([TOKEN_PROMPTS[0]], params, use_tqdm=False)[0]
    expected_logprobs = (expected.outputs[0].logprobs if hasattr(expected, "outputs")
                         else expected["logprobs"])
    response = client.completions.create(model=MODEL_NAME, prompt=TOKEN_PROMPTS[0],
                                         temperature=0, max_tokens=6, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == 6
    rows = zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, expected_logprobs)
    for token, got, top, want in rows:
        sampled = next(iter(want.values()))
        sampled = getattr(sampled, "logprob", sampled)
        assert math.isclose(got, sampled, rel_tol=1e-5, abs_tol=1e-6)
        # The top 3 and the sampled token, keyed by text: byte tokens that are no character
        # alone all read "\ufffd", so keys may merge.
        assert token in top and 1 <= len(top) <= 4
    offsets = logprobs.text_offset
    assert offsets[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs.tokens))


def test_echo_puts_the_prompt_first(client):
    plain = client.completions.create(model=MODEL_NAME, prompt="Echo", **GREEDY)
    echoed = client.completions.create(model=MODEL_NAME, prompt="Echo", echo=True, **GREEDY)
    assert echoed.choices[0].text == "Echo" + plain.choices[0].text


def test_echo_with_logprobs_puts_the_prompts_logprobs_first(client, llm):
    """As vLLM: the prompt's tokens, the first with null logprobs, then the generated ones; the
    engine's prompt logprobs, the prompt token and the top 2 at each position."""
    prompt = TOKEN_PROMPTS[0]
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2)
    expected = llm.generate([prompt], params, use_tqdm=False)[0]
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, echo=True,
                                         temperature=0, max_tokens=3, logprobs=2)
    logprobs = response.choices[0].logprobs
    generated = expected.outputs[0]
    token_ids = prompt + generated.token_ids
    assert logprobs.tokens == [llm.tokenizer.decode([t]) for t in token_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    wanted = expected.prompt_logprobs[1:] + generated.logprobs
    for token_id, got, top, want in zip(token_ids[1:], logprobs.token_logprobs[1:],
                                        logprobs.top_logprobs[1:], wanted):
        assert math.isclose(got, want[token_id].logprob, rel_tol=1e-5, abs_tol=1e-6)
        assert 1 <= len(top) <= 3  # the token and the top 2, keyed by text (which may merge)
    offsets = logprobs.text_offset
    assert offsets[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs.tokens))
    assert response.choices[0].text == llm.tokenizer.decode(prompt) + generated.text


def test_echo_with_logprobs_streamed_and_for_n_samples(client):
    """Every choice of n, streamed or not, starts with the prompt's logprobs."""
    options = dict(model=MODEL_NAME, prompt=TOKEN_PROMPTS[1], echo=True, temperature=0,
                   max_tokens=2, logprobs=0, n=2)
    whole = client.completions.create(**options)
    chunks = list(client.completions.create(**options, stream=True))
    for index in range(2):
        choice = whole.choices[index].logprobs
        assert len(choice.tokens) == len(TOKEN_PROMPTS[1]) + 2
        streamed = [c.choices[0].logprobs for c in chunks
                    if c.choices and c.choices[0].index == index]
        assert sum((s.token_logprobs for s in streamed), []) == choice.token_logprobs
        assert sum((s.text_offset for s in streamed), []) == choice.text_offset
    assert whole.choices[0].logprobs.token_logprobs == whole.choices[1].logprobs.token_logprobs


def test_a_stop_string_ends_the_choice(client):
    text = client.completions.create(model=MODEL_NAME, prompt="Stop", **GREEDY).choices[0].text
    stop = text[3:5]
    (choice,) = client.completions.create(model=MODEL_NAME, prompt="Stop", stop=[stop],
                                          **GREEDY).choices
    assert choice.finish_reason == "stop"
    assert choice.stop_reason == stop
    assert choice.text == text[:text.index(stop)]


def test_usage_counts_the_prefix_cache_hit(client):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: the full 16-token blocks found in the
    prefix cache, the last token always computed again; a prompt's n samples count it once."""
    prompt = [(7 * i + 3) % 200 for i in range(40)]  # 40 tokens no other test sends
    kwargs = dict(model=MODEL_NAME, max_tokens=2, temperature=0)
    first = client.completions.create(prompt=prompt, **kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(prompt=[prompt, prompt[:35]], n=2, **kwargs)
    assert again.usage.prompt_tokens_details.cached_tokens == 32 + 32
    chunks = list(client.completions.create(prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
