"""The engine process's loop, run on a thread of this process over a pipe, with the test as its
server: one message a step, refusals, aborts, a failing step, and the end of the pipe."""

import socket
import threading
from itertools import count

import pytest
from conftest import ENGINE_OPTIONS

from nanovllm import SamplingParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.requests import Request, make_requests
from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.serve import channel
from nanovllm.serve.engine_client import RequestStream
from nanovllm.serve.engine_core import serve_engine
from nanovllm.serve.messages import (
    AbortRequests,
    AddRequests,
    ChoiceDelta,
    EngineFailed,
    EngineReady,
    Shutdown,
    StepOutputs,
)

TIMEOUT = 60.0
REQUEST_IDS = count()  # one counter: request ids are unique across the tests
PROMPTS = [[5, 17, 33, 90], [200, 201, 7], [64] * 20]


class EngineOnThread:
    """serve_engine(engine) on a thread; `sock` is the server's end of the pipe."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.sock, engine_end = socket.socketpair()
        self.thread = threading.Thread(target=serve_engine, args=(engine, engine_end))
        self.thread.start()
        ready = self.receive()
        assert isinstance(ready, EngineReady) and ready.limits == engine.limits

    def send(self, command):
        channel.send(self.sock, command)

    def receive(self):
        assert channel.readable(self.sock, TIMEOUT), "no message from the engine"
        return channel.receive(self.sock)

    def until_finished(self, stream_ids: set[int]) -> list[StepOutputs]:
        """The messages up to the one that finishes the last of `stream_ids`."""
        messages, unfinished = [], set(stream_ids)
        while unfinished:
            message = self.receive()
            assert isinstance(message, StepOutputs), message
            messages.append(message)
            unfinished -= set(message.finished)
        return messages

    def stop(self):
        self.sock.close()  # the server's end closes: the loop ends and exits the engine
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive()
        assert self.engine._exited


@pytest.fixture
def engine(tiny_model):
    engine = LLMEngine(tiny_model, **ENGINE_OPTIONS)
    yield engine
    engine.exit()


def requests(engine: LLMEngine, prompts, params) -> list[Request]:
    return make_requests(prompts, params, engine.tokenizer, engine.limits, REQUEST_IDS,
                         grammars=engine.grammars)


def test_each_step_is_one_message_with_every_streams_news(engine):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [out.outputs[0].token_ids
                for _, out in sorted(engine.as_completed(requests(engine, PROMPTS, params)))]
    steps = []
    step = engine.step
    engine.step = lambda: steps.append(None) or step()
    core = EngineOnThread(engine)
    core.send(AddRequests(7, requests(engine, PROMPTS[:2], params)))
    core.send(AddRequests(8, requests(engine, PROMPTS[2:], params)))
    messages = core.until_finished({7, 8})
    assert len(messages) == len(steps)
    tokens = {}
    for message in messages:
        choices = [(stream_id, fields[0]) for stream_id, *fields in message.deltas]
        assert len(choices) == len(set(choices))  # a choice's news of a step in one delta
        for stream_id, *fields in message.deltas:
            delta = ChoiceDelta(*fields)
            tokens.setdefault((stream_id, delta.index), []).extend(delta.token_ids)
    assert tokens == {(7, 0): expected[0], (7, 1): expected[1], (8, 0): expected[2]}
    last = messages[-1]
    assert sorted(f for m in messages for f in m.finished) == [7, 8]
    assert last.num_running == last.num_waiting == 0 and last.kv_cache_usage == 0
    core.stop()


def test_the_engine_sends_text_only_where_its_stop_strings_need_it(engine):
    """A choice with stop strings gets the engine's text; one without gets token ids alone, and
    the server's detokenizer makes the same text of them as LLMEngine.stream's, a finishing stop
    id's text left out. Two samples of a prompt keep their own detokenizers."""
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (tokens,) = [out.outputs[0].token_ids
                 for _, out in engine.as_completed(requests(engine, PROMPTS[:1], plain))]
    cut = next(i for i in range(3, 12) if tokens[i] not in tokens[:i])
    by_stop_id = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tokens[cut]])
    by_stop_string = SamplingParams(temperature=0, max_tokens=12, stop=["never in the text"])
    seeded = SamplingParams(n=2, seed=3, temperature=1.0, max_tokens=12, ignore_eos=True)
    cases = {1: by_stop_id, 2: by_stop_string, 3: seeded}
    streamed = {stream_id: [""] * params.n for stream_id, params in cases.items()}
    for stream_id, params in cases.items():
        for out in engine.stream(requests(engine, PROMPTS[:1], params)):
            streamed[stream_id][out.sample] += out.text
    sent = {stream_id: requests(engine, PROMPTS[:1], params) for stream_id, params in cases.items()}
    server_streams = {stream_id: RequestStream(reqs, stream_id, detokenizers=[
        IncrementalDetokenizer(engine.tokenizer, r.token_ids, r.params)
        for r in reqs for _ in range(r.params.n)]) for stream_id, reqs in sent.items()}
    core = EngineOnThread(engine)
    for stream_id, reqs in sent.items():
        core.send(AddRequests(stream_id, reqs))
    texts = {stream_id: [""] * params.n for stream_id, params in cases.items()}
    for message in core.until_finished(set(cases)):
        for stream_id, *fields in message.deltas:
            delta = ChoiceDelta(*fields)
            assert (delta.text is not None) == (stream_id == 2)
            if delta.text is None:
                server_streams[stream_id].detokenize(delta)
            texts[stream_id][delta.index] += delta.text
    core.stop()
    assert texts == streamed
    assert streamed[1][0] == engine.tokenizer.decode(tokens[:cut])
    assert streamed[3][0] != streamed[3][1]


def test_a_refused_request_fails_alone(engine):
    pytest.importorskip("xgrammar")
    core = EngineOnThread(engine)
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        json={"type": "objec"}))  # not checked by make_requests: the engine compiles it
    core.send(AddRequests(1, [Request("bad", [5, 6, 7], bad)]))
    core.send(AddRequests(2, requests(engine, PROMPTS[:1], SamplingParams(max_tokens=3))))
    messages = core.until_finished({2})
    (refused,) = [r for m in messages for r in m.refused]
    assert refused[0] == 1 and "the engine refused the request" in refused[1]
    assert all(stream_id == 2 for m in messages for stream_id, *_ in m.deltas)
    core.stop()


def test_an_abort_frees_the_blocks_and_ends_the_news(engine):
    core = EngineOnThread(engine)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    core.send(AddRequests(3, requests(engine, [[9] * 40], params)))
    message = core.receive()
    assert message.kv_cache_usage > 0
    core.send(AbortRequests([3]))
    while message.num_running:  # the messages of steps taken before the abort arrived
        message = core.receive()
    assert message.kv_cache_usage == 0 and message.finished == []
    assert not channel.readable(core.sock, 0.2)  # nothing more: no stream left, the loop waits
    core.send(Shutdown())
    with pytest.raises(EOFError):
        core.receive()
    core.stop()


def test_a_failing_step_is_sent_as_the_error(engine):
    core = EngineOnThread(engine)

    def fail():
        raise RuntimeError("the device fell over")

    engine.step = fail
    core.send(AddRequests(0, requests(engine, PROMPTS[:1], SamplingParams(max_tokens=3))))
    failed = core.receive()
    assert isinstance(failed, EngineFailed)
    assert isinstance(failed.error, RuntimeError) and str(failed.error) == "the device fell over"
    with pytest.raises(EOFError):
        core.receive()
    core.stop()
