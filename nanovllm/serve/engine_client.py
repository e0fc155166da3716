"""The server's end of the engine process: it starts the process, checks requests as LLM does (the
same make_requests, with the engine's limits and the model's tokenizer) before sending them, and
hands each step's message to the streams' asyncio queues, all on the server's event loop. It
detokenizes the choices without stop strings, which the engine sends as token ids alone: that
work stays off the engine's step loop."""

import asyncio
import atexit
import contextlib
import multiprocessing
import socket
import time
from dataclasses import dataclass, field, replace
from itertools import count

from nanovllm.checkpoint.tokenizer import load_tokenizer
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.grammar import Grammars, serialize, spec_key
from nanovllm.engine.requests import Request, RequestLimits, make_requests
from nanovllm.serve import channel
from nanovllm.serve.channel import MessageProtocol
from nanovllm.serve.engine_core import run_engine_core
from nanovllm.serve.messages import (
    AbortRequests,
    AddRequests,
    ChoiceDelta,
    EngineFailed,
    EngineReady,
    Shutdown,
    StepOutputs,
)

NOTHING = object()  # RequestStream.held: no item held
STOP_SECONDS = 30.0  # how long stop() waits for the engine process to exit before killing it


def merge_deltas(deltas: list[ChoiceDelta]) -> list[ChoiceDelta]:
    """Each choice's deltas (in order) as one: texts, token ids and logprobs joined; the last
    one's finish; the first one's prompt logprobs. Choices in order of their first delta."""
    if len({delta.index for delta in deltas}) == len(deltas):
        return deltas  # a delta a choice: nothing to merge
    merged: dict[int, ChoiceDelta] = {}
    for delta in deltas:
        into = merged.get(delta.index)
        if into is None:
            merged[delta.index] = replace(delta, token_ids=list(delta.token_ids), logprobs=(
                None if delta.logprobs is None else list(delta.logprobs)))
            continue
        into.text += delta.text
        into.token_ids += delta.token_ids
        if delta.logprobs is not None:
            into.logprobs = (into.logprobs or []) + delta.logprobs
        into.finish_reason, into.stop_reason = delta.finish_reason, delta.stop_reason
        into.num_cached_tokens += delta.num_cached_tokens
    return list(merged.values())


class EngineStopped(RuntimeError):
    """The engine stopped (shutdown, or it failed) before the request completed."""


@dataclass(eq=False)
class RequestStream:
    """One HTTP request's prompts in the engine; its handler awaits `next_deltas()`."""

    requests: list[Request]
    stream_id: int = 0
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    done: bool = False  # every choice finished, or the stream failed
    held: object = NOTHING  # the end (None) or an error, queued behind deltas just merged
    token_times: dict[int, float] = field(default_factory=dict)  # choice -> its last token's
    # choice -> its text's detokenizer here, or None where the engine's (stop strings) sends text
    detokenizers: list[IncrementalDetokenizer | None] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    def detokenize(self, delta: ChoiceDelta):
        """Set the text of a delta the engine sent without (the choice has no stop strings): its
        tokens', as the engine's detokenizer would have made it (a finishing EOS or stop id
        shows no text)."""
        detokenizer = self.detokenizers[delta.index]
        before, last = len(detokenizer.text), len(delta.token_ids) - 1
        reason = delta.finish_reason
        for i, token_id in enumerate(delta.token_ids):
            ends = reason is not None and i == last
            detokenizer.update(token_id, ends, stop_terminated=ends and reason == "stop")
        delta.text = detokenizer.text[before:]

    async def next_deltas(self) -> list[ChoiceDelta]:
        """The choices' next deltas, all that queued up merged by choice (a handler that falls
        behind the steps sends fewer, larger chunks); [] once all finished; raises EngineStopped
        if cut off."""
        if self.done:
            return []
        item = self.held if self.held is not NOTHING else await self.queue.get()
        self.held = NOTHING
        if isinstance(item, BaseException) or item is None:
            self.done = True
            if item is None:
                return []
            raise item
        deltas = list(item)
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, BaseException) or item is None:
                self.held = item  # after the deltas before it
                break
            deltas += item
        return merge_deltas(deltas)


class EngineClient:
    """Starts the engine process from `LLM(model, **options)`'s arguments and waits until it is
    ready (its start-up error is raised here). attach() then takes the pipe onto the event loop:
    submit() and abort() are called there, each step's message is dispatched as it arrives, and
    shutdown() ends the process. stop() ends it from anywhere else."""

    def __init__(self, model: str, options: dict):
        if options.get("skip_tokenizer_init"):
            raise ValueError("the server needs the model's tokenizer (text, chat templates, "
                             "streamed text): start it without skip_tokenizer_init")
        self._sock, engine_end = socket.socketpair()
        context = multiprocessing.get_context("spawn")
        # Not a daemon: the engine's tensor-parallel workers are its children.
        self.process = context.Process(target=run_engine_core, args=(model, options, engine_end),
                                       name="nanovllm-engine")
        self.process.start()
        engine_end.close()  # ours closed: the engine's exit reads as the pipe's end here
        self._streams: dict[int, RequestStream] = {}
        self._stream_ids = count()
        self._request_ids = count()
        self._grammars_sent: set[tuple] = set()  # specs whose grammar the engine has been sent
        self._protocol: MessageProtocol | None = None
        self._closed: asyncio.Future | None = None  # done once the engine's end has closed
        self._metrics = None
        self._stopping = self._stopped = False
        self.error: str | None = None  # why the engine is gone, once it failed
        atexit.register(self.stop)  # before multiprocessing's exit hook joins the process
        try:
            ready = self._wait_ready()
            # The engine's own config, so that this process never touches the GPU.
            self.tokenizer = load_tokenizer(ready.config)
            self.grammars = Grammars(self.tokenizer, ready.limits.vocab_size, ready.eos_token_ids)
            self.limits: RequestLimits = ready.limits
        except BaseException:
            self.process.kill()  # not serving yet: nothing to drain
            self.stop()
            raise

    def _wait_ready(self) -> EngineReady:
        try:
            message = channel.receive(self._sock)
        except EOFError:
            self.process.join()
            raise RuntimeError(
                f"the engine process exited during start-up (exit code {self.process.exitcode}); "
                "its error is on stderr. The process is spawned and imports the main script: a "
                "script that starts a server at import time must do it under "
                "`if __name__ == '__main__':`") from None
        if isinstance(message, EngineFailed):
            raise message.error
        assert isinstance(message, EngineReady), message
        return message

    @property
    def alive(self) -> bool:
        """Attached, and neither stopping nor failed: new requests are taken."""
        return self._protocol is not None and not self._stopping and self.error is None

    def make_requests(self, prompts, sampling_params) -> list[Request]:
        """A batch tokenized and checked as LLM.generate checks it (ValueError or TypeError
        naming the value and the limit), not sent."""
        return make_requests(prompts, sampling_params, self.tokenizer, self.limits,
                             self._request_ids, stream=True, grammars=self.grammars)

    async def attach(self, metrics=None):
        """Take the pipe onto the running event loop: from now on each step's message goes to
        the streams' queues as it arrives, and the gauges, token counts and latencies to
        `metrics` (a ServerMetrics)."""
        loop = asyncio.get_running_loop()
        self._metrics = metrics
        self._closed = loop.create_future()
        _, self._protocol = await loop.create_unix_connection(
            lambda: MessageProtocol(self._on_message, self._on_close), sock=self._sock)

    def submit(self, requests: list[Request]) -> RequestStream:
        """Send checked requests (make_requests) to the engine; returns their stream. Raises
        EngineStopped if the engine takes none now."""
        if not self.alive:
            raise EngineStopped(self.error or "the server is shutting down")
        # The engine detokenizes only what its stop strings need; this process, the rest.
        detokenizers = [None if r.params.stop else
                        IncrementalDetokenizer(self.tokenizer, r.token_ids, r.params)
                        for r in requests for _ in range(r.params.n)]
        stream = RequestStream(requests, next(self._stream_ids), detokenizers=detokenizers)
        self._streams[stream.stream_id] = stream
        if self._metrics is not None:
            self._metrics.observe_request(stream.num_prompt_tokens)
        self._protocol.send(AddRequests(stream.stream_id, [self._portable(r) for r in requests]))
        return stream

    def _portable(self, request: Request) -> Request:
        """The request as it crosses the pipe. A compiled grammar does not pickle: it goes as JSON
        the first time its spec does, which the engine caches, so that the engine never compiles
        (a compile would stall its steps); later requests of the spec carry none."""
        if request.grammar is None:
            return request
        key = spec_key(request.params.structured_outputs)
        if key in self._grammars_sent:
            return replace(request, grammar=None)
        self._grammars_sent.add(key)
        return replace(request, grammar=serialize(request.grammar))

    def abort(self, stream: RequestStream):
        """Finish the stream's unfinished requests (their blocks return to the pool) and stop
        listening to it."""
        if self._streams.pop(stream.stream_id, None) is not None and not self._closed.done():
            self._protocol.send(AbortRequests([stream.stream_id]))

    async def shutdown(self, timeout: float = STOP_SECONDS):
        """On the event loop, at the app's end: abort everything and end the engine process
        (killed after `timeout` seconds), reading its last messages meanwhile; the streams still
        open fail."""
        if self._stopped:
            return
        self._stopping = True
        if self.error is None:
            self._protocol.send(Shutdown())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._closed), timeout)
        self._protocol.transport.close()
        self.stop(timeout)

    def stop(self, timeout: float = STOP_SECONDS):
        """End the engine process from outside the event loop (a failed start, an app that never
        ran, exit hooks): asked to stop if no event loop has taken the pipe, killed if one took
        it and is gone; killed too if it has not exited after `timeout` seconds. Idempotent."""
        if self._stopped:
            return
        self._stopped = self._stopping = True
        atexit.unregister(self.stop)
        if self._protocol is None:
            with contextlib.suppress(OSError):
                channel.send(self._sock, Shutdown())
        elif not self._closed.done():
            self.process.kill()  # nobody reads its messages any more
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if self._protocol is None:
            self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def _on_message(self, message):
        if isinstance(message, EngineFailed):
            self.error = f"the engine failed: {message.error}"
        else:
            self._dispatch(message)

    def _on_close(self):
        """The engine's end has closed: it exited, failed or died. Every open stream fails."""
        if self.error is None and not self._stopping:
            self.process.join(STOP_SECONDS)  # it closes the pipe as it exits
            self.error = ("the engine failed: its process exited (exit code "
                          f"{self.process.exitcode})")
        error = EngineStopped(self.error or "the server shut down before the request completed")
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        self._streams.clear()
        self._closed.set_result(None)

    def _dispatch(self, message: StepOutputs):
        """One step's message to the streams' queues."""
        metrics = self._metrics
        if metrics is not None:
            metrics.observe_engine(message.num_running, message.num_waiting,
                                   message.kv_cache_usage)
        now = time.perf_counter()
        news: dict[int, list[ChoiceDelta]] = {}
        for stream_id, *fields in message.deltas:
            stream = self._streams.get(stream_id)
            if stream is None:
                continue  # aborted meanwhile
            delta = ChoiceDelta(*fields)
            if delta.text is None:
                stream.detokenize(delta)
            news.setdefault(stream_id, []).append(delta)
            if metrics is not None and delta.token_ids:
                last = stream.token_times.get(delta.index)
                metrics.observe_tokens(len(delta.token_ids), now - (last or stream.submitted),
                                       first=last is None)
                stream.token_times[delta.index] = now
        for stream_id, deltas in news.items():
            self._streams[stream_id].queue.put_nowait(deltas)
        for stream_id, why in message.refused:
            if (stream := self._streams.pop(stream_id, None)) is not None:
                stream.queue.put_nowait(EngineStopped(why))
        for stream_id in message.finished:
            if (stream := self._streams.pop(stream_id, None)) is not None:
                stream.queue.put_nowait(None)
