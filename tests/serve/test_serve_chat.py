"""/v1/chat/completions: the chat template's prompt, streamed role and content deltas, logprobs."""

import asyncio

from conftest import MODEL_NAME, async_client
from serve_helpers import completions_of

from nanovllm import SamplingParams

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def test_greedy_reply_equals_offline_chat(client, llm):
    expected = completions_of(llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=10),
                                       use_tqdm=False)[0])[0]
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                              temperature=0, max_tokens=10)
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected["text"]
    assert response.usage.completion_tokens == len(expected["token_ids"])
    prompt = llm.tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                               add_generation_prompt=True)
    assert response.usage.prompt_tokens == len(llm.tokenizer.encode(prompt,
                                                                     add_special_tokens=False))


def test_text_parts_read_as_their_text(client):
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "},
                                            {"type": "text", "text": "brief."}]},
             MESSAGES[1]]
    plain, split = (client.chat.completions.create(model=MODEL_NAME, messages=m, temperature=0,
                                                   max_tokens=6) for m in (MESSAGES, parts))
    assert split.choices[0].message.content == plain.choices[0].message.content


def test_stream_sends_the_role_then_the_content(client, server):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0,
                                           max_tokens=10, n=2)

    async def stream():
        async with async_client(server) as aclient:
            chunks = await aclient.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=10, n=2,
                stream=True, stream_options={"include_usage": True})
            return [chunk async for chunk in chunks]

    chunks = asyncio.run(stream())
    assert [(c.index, c.delta.role) for c in chunks[0].choices] == [(0, "assistant"),
                                                                     (1, "assistant")]
    for i in range(2):
        deltas = [c.choices[0] for c in chunks[1:-1] if c.choices[0].index == i]
        assert all(d.delta.role is None for d in deltas)
        assert "".join(d.delta.content for d in deltas) == whole.choices[i].message.content
        assert deltas[-1].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_logprobs_and_top_logprobs(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0,
                                              max_tokens=5, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.bytes == list(token.token.encode())
        best = [t.logprob for t in token.top_logprobs]
        assert best == sorted(best, reverse=True)
        assert token.logprob <= best[0] + 1e-6  # greedy over the raw logits: the best one
        assert abs(token.logprob - best[0]) < 1e-5
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0,
                                           max_tokens=5, logprobs=True)
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)
