"""One thread owns the engine: it queues what the HTTP handlers submit, aborts what they cancel,
steps, and hands each request's new tokens to its handler's asyncio queue."""

import asyncio
import threading
import time
from dataclasses import dataclass, field, replace
from itertools import accumulate

from nanovllm.engine.outputs import stream_outputs
from nanovllm.engine.requests import Request
from nanovllm.engine.sequence import Sequence

NOTHING = object()  # RequestStream.held: no item held
IDLE_WAIT_SECONDS = 1.0  # an idle loop wakes on a submission, or after this to check for stop


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice (a prompt's sample) produced since its last delta."""

    index: int  # the choice: the prompt's position times n, plus the sample
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # one {token_id: logprob} per token, sampled first
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The first delta of a choice whose request asked for prompt logprobs: the prompt's token ids
    # and, for each but the first, {token_id: logprob} (the prompt token first, then the top k).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, float]] | None = None


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
    return list(merged.values())


class EngineStopped(RuntimeError):
    """The loop stopped (shutdown, or the engine failed) before the request completed."""


@dataclass(eq=False)
class RequestStream:
    """One HTTP request's prompts in the engine; its handler awaits `next_deltas()`."""

    requests: list[Request]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    done: bool = False  # every choice finished (set on the handler's side)
    # The engine thread's bookkeeping.
    seqs: list[Sequence] = field(default_factory=list)
    pending: dict[int, Sequence] = field(default_factory=dict)
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)
    prompt_of: list[int] = field(default_factory=list)
    choice_offsets: list[int] = field(default_factory=list)
    token_times: dict[int, float] = field(default_factory=dict)  # choice -> its last token's
    held: object = NOTHING  # the end (None) or an error, queued behind deltas just merged

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

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

    def _put(self, item):
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody awaits this request any more
            pass


class EngineLoop:
    """The engine's single owner thread. submit() and abort() may be called from any thread."""

    def __init__(self, engine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self._inbox: list[RequestStream] = []
        self._aborts: list[RequestStream] = []
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: list[RequestStream] = []
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, requests: list[Request]) -> RequestStream:
        """Queue checked requests (make_requests) from the event loop; returns their stream."""
        stream = RequestStream(requests, asyncio.get_running_loop())
        with self._inbox_lock:
            if not self.alive:
                raise EngineStopped("the server is shutting down" if self.error is None
                                    else f"the engine failed: {self.error}")
            self._inbox.append(stream)
        self._wake.set()
        return stream

    def abort(self, stream: RequestStream):
        """Finish the stream's unfinished requests at the next step; their blocks return."""
        if not stream.done:
            with self._inbox_lock:
                self._aborts.append(stream)
            self._wake.set()

    def stop(self, timeout: float = 30.0):
        """Abort everything, end the thread, and fail what was never taken in."""
        with self._inbox_lock:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def _run(self):
        try:
            while True:
                stop, changed = self._take_inbox()
                if changed:  # refused, aborted or stopped requests' last deltas
                    self._publish()
                if stop:
                    break
                if not self._streams:
                    self._wake.wait(IDLE_WAIT_SECONDS)
                    self._wake.clear()
                    continue
                self.engine.step()
                self._publish()
                if self.metrics is not None:
                    self.metrics.observe_engine(self.engine)
        except BaseException as error:  # the engine failed: its requests fail with it
            self.error = error
            with self._inbox_lock:
                self._stopping = True
        self._fail_all()

    def _take_inbox(self) -> tuple[bool, bool]:
        """Queue the new streams and abort the cancelled ones: (stop() was called, anything
        was taken)."""
        with self._inbox_lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            stopping = self._stopping
        for stream in new:
            self._add(stream)
        if stopping:
            aborts = list(self._streams)
        ids = [r.request_id for stream in aborts for r in stream.requests]
        if ids:
            self.engine.abort_requests(ids)
        return stopping, bool(new or aborts)

    def _add(self, stream: RequestStream):
        try:
            seqs = self.engine.add(stream.requests, detokenize=True)
        except (ValueError, TypeError, RuntimeError) as e:  # this request's failure, not the loop's
            stream._put(EngineStopped(f"the engine refused the request: {e}"))
            return
        stream.seqs = seqs
        stream.pending = dict(enumerate(seqs))
        stream.sent = {index: (0, 0) for index in stream.pending}
        stream.prompt_of = list(accumulate(seq.sample_index == 0 for seq in seqs))
        stream.choice_offsets = [0, *accumulate(r.params.n for r in stream.requests)]
        self._streams.append(stream)
        if self.metrics is not None:
            self.metrics.observe_request(stream.num_prompt_tokens)

    def _publish(self):
        """Hand each stream what its sequences produced since the last time."""
        now = time.perf_counter()
        for stream in list(self._streams):
            outputs = stream_outputs(stream.pending, stream.sent, stream.prompt_of)
            deltas = []
            for out in outputs:
                choice = stream.choice_offsets[out.index] + out.sample
                seq = stream.seqs[choice]
                logprobs = None
                if seq.sampling_params.logprobs is not None:
                    start = seq.num_output_tokens - len(out.token_ids)
                    logprobs = seq.logprobs[start:start + len(out.token_ids)]
                delta = ChoiceDelta(choice, out.text, out.token_ids, logprobs,
                                    out.finish_reason, out.stop_reason)
                if seq.num_output_tokens == len(out.token_ids):  # the choice's first delta
                    self._add_prompt_logprobs(delta, stream.seqs[stream.choice_offsets[out.index]])
                deltas.append(delta)
                self._time_tokens(stream, choice, len(out.token_ids), now)
            if deltas:
                stream._put(deltas)
            if not stream.pending:
                stream._put(None)
                self._streams.remove(stream)

    @staticmethod
    def _add_prompt_logprobs(delta: ChoiceDelta, first: Sequence):
        """The prompt's logprobs, from its first sample (the one that prefilled the prompt), once
        every prompt token has them (a request aborted in its prefill gets none)."""
        if first.sampling_params.prompt_logprobs is None:
            return
        if len(first.prompt_logprobs) == first.num_prompt_tokens - 1:
            delta.prompt_token_ids = list(first.token_ids[:first.num_prompt_tokens])
            delta.prompt_logprobs = list(first.prompt_logprobs)

    def _time_tokens(self, stream: RequestStream, choice: int, num_tokens: int, now: float):
        if not num_tokens:
            return
        last = stream.token_times.get(choice)
        if self.metrics is not None:
            self.metrics.observe_tokens(num_tokens, now - (last or stream.submitted),
                                        first=last is None)
        stream.token_times[choice] = now

    def _fail_all(self):
        """After the loop: every stream not completed, or never taken in, fails."""
        with self._inbox_lock:
            streams, self._inbox = self._streams + self._inbox, []
        error = EngineStopped("the server shut down before the request completed"
                              if self.error is None else f"the engine failed: {self.error}")
        for stream in streams:
            stream._put(error)
        self._streams = []
