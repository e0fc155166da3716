"""Many clients at once, cancelled requests returning their KV blocks, and /metrics."""

import asyncio
import random

from conftest import MODEL_NAME, async_client
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import completions_of, gauges, request, wait_until

from nanovllm import SamplingParams

NUM_CLIENTS = 64


def kv_cache_usage(server) -> float:
    return gauges(server)["nanovllm:kv_cache_usage_perc"]


def back_to(server, usage: float) -> bool:
    """Nothing runs or waits, and the KV pool is as used as it was before (every block of the
    request has returned)."""
    now = gauges(server)
    return (now["nanovllm:kv_cache_usage_perc"] == usage
            and now["nanovllm:num_requests_running"] == 0
            and now["nanovllm:num_requests_waiting"] == 0)


def test_64_streaming_clients_each_get_their_own_tokens(server, llm):
    rng = random.Random(0)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(3, 24))]
               for _ in range(NUM_CLIENTS)]
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = [completions_of(out)[0] for out in llm.generate(prompts, params, use_tqdm=False)]
    # Streamed text is the incremental detokenizer's, as LLM.stream's: a character whose bytes
    # straddle the prompt's end is the completion's (generate decodes the completion alone).
    streamed = [""] * NUM_CLIENTS
    for out in llm.stream(prompts, params):
        streamed[out.index] += out.text

    async def one(aclient, prompt):
        chunks = await aclient.completions.create(
            model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=16, stream=True,
            extra_body={"return_token_ids": True})
        tokens, text = [], ""
        async for chunk in chunks:
            tokens += chunk.choices[0].token_ids
            text += chunk.choices[0].text
        return tokens, text

    async def all_clients():
        async with async_client(server) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(all_clients())
    assert [tokens for tokens, _ in results] == [e["token_ids"] for e in expected]
    assert [text for _, text in results] == streamed


def test_a_cancelled_stream_frees_its_blocks(server):
    start = kv_cache_usage(server)

    async def cancel_after_two_chunks():
        async with async_client(server) as aclient:
            chunks = await aclient.completions.create(
                model=MODEL_NAME, prompt=[3] * 40, max_tokens=200, stream=True,
                extra_body={"ignore_eos": True})
            seen = 0
            async for _ in chunks:
                seen += 1
                if seen == 2:
                    break
            # The gauges of a step come before its tokens: the request holds blocks now.
            assert await asyncio.to_thread(kv_cache_usage, server) > start
            await chunks.close()

    asyncio.run(cancel_after_two_chunks())
    wait_until(lambda: back_to(server, start), what="the KV pool's return to its use before")


def test_a_client_that_gives_up_aborts_its_request(server):
    start = kv_cache_usage(server)

    async def give_up():
        async with async_client(server) as aclient:
            call = asyncio.ensure_future(aclient.completions.create(
                model=MODEL_NAME, prompt=[5] * 40, max_tokens=200,
                extra_body={"ignore_eos": True}))
            for _ in range(2000):  # at most ~10 s: until the request holds blocks
                if await asyncio.to_thread(kv_cache_usage, server) > start or call.done():
                    break
                await asyncio.sleep(0.005)
            assert not call.done(), "200 tokens came before the request could be cancelled"
            call.cancel()  # the client closes its connection

    asyncio.run(give_up())
    wait_until(lambda: back_to(server, start), what="the KV pool's return to its use before")


def test_metrics_parse_and_count(server, client):
    client.completions.create(model=MODEL_NAME, prompt="count me", max_tokens=5, temperature=0)
    status, text = request(server, "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("nanovllm:num_requests_running", "nanovllm:num_requests_waiting",
                 "nanovllm:kv_cache_usage_perc", "nanovllm:prompt_tokens",
                 "nanovllm:generation_tokens", "nanovllm:time_to_first_token_seconds",
                 "nanovllm:inter_token_latency_seconds"):
        assert name in families, sorted(families)

    def value(family: str, sample: str) -> float:
        return next(s.value for s in families[family].samples if s.name == sample)

    assert value("nanovllm:prompt_tokens", "nanovllm:prompt_tokens_total") > 0
    assert value("nanovllm:generation_tokens", "nanovllm:generation_tokens_total") >= 5
    assert value("nanovllm:time_to_first_token_seconds",
                 "nanovllm:time_to_first_token_seconds_count") >= 1
    assert value("nanovllm:inter_token_latency_seconds",
                 "nanovllm:inter_token_latency_seconds_count") >= 4
    assert value("nanovllm:num_requests_running", "nanovllm:num_requests_running") == 0
