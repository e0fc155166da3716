"""The engine process. It owns the LLMEngine (tensor-parallel workers are its children), takes the
server's commands between steps, steps while any request is unfinished, and sends each step's new
tokens of every stream as one message, with their text only where the engine detokenizes (stop
strings); the server detokenizes the rest. In a process of its own, the step loop does not
share an interpreter lock with the HTTP handlers, so it keeps ahead of the GPU."""

import contextlib
import signal
import socket
import traceback
from dataclasses import dataclass, field

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.outputs import stream_news
from nanovllm.engine.sequence import Sequence
from nanovllm.serve import channel
from nanovllm.serve.messages import (
    AbortRequests,
    AddRequests,
    EngineFailed,
    EngineReady,
    Shutdown,
    StepOutputs,
)


def run_engine_core(model: str, options: dict, sock: socket.socket):
    """The process's entry: start the engine (or send EngineFailed), then serve_engine."""
    # Ctrl-C reaches the whole process group: the server drains, then stops this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = LLMEngine(model, **options)
    except BaseException as error:
        _send_failure(sock, error)
        return
    serve_engine(engine, sock)


def serve_engine(engine: LLMEngine, sock: socket.socket):
    """Answer EngineReady, then serve the server's commands until Shutdown or until the server's
    end of the pipe closes; a failure is sent as EngineFailed. Exits the engine."""
    try:
        channel.send(sock, EngineReady(engine.config, engine.eos_token_ids, engine.limits))
        EngineCore(engine, sock).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the server's process is gone: nobody is left to answer
    except BaseException as error:
        traceback.print_exc()
        _send_failure(sock, error)
    finally:
        engine.exit()
        sock.close()


def _send_failure(sock: socket.socket, error: BaseException):
    with contextlib.suppress(OSError):
        try:
            channel.send(sock, EngineFailed(error))
        except Exception:  # an error that does not pickle: its text
            channel.send(sock, EngineFailed(RuntimeError(f"{type(error).__name__}: {error}")))


@dataclass(eq=False)
class EngineStream:
    """One HTTP request's sequences (flat: a prompt's n samples in a row, so a sequence's position
    is its choice index) and what the server has been sent of each."""

    seqs: list[Sequence]
    pending: dict[int, Sequence] = field(init=False)  # choice -> sequence, until it finishes
    sent: dict[int, tuple[int, int]] = field(init=False)  # choice -> (tokens, characters) sent

    def __post_init__(self):
        self.pending = dict(enumerate(self.seqs))
        self.sent = dict.fromkeys(self.pending, (0, 0))

    @property
    def request_ids(self) -> list[str]:
        return [seq.request_id for seq in self.seqs if seq.sample_index == 0]


class EngineCore:
    """The step loop over one engine and the pipe to the server."""

    def __init__(self, engine: LLMEngine, sock: socket.socket):
        self.engine = engine
        self.sock = sock
        self.streams: dict[int, EngineStream] = {}
        self.refused: list[tuple[int, str]] = []
        self.stopping = False

    def run(self):
        """Step while a stream is unfinished; wait for a command while none is."""
        while True:
            changed = self._take_commands(wait=not self.streams)
            if self.stopping:
                return
            if self.streams:
                self.engine.step()
                self._publish()
            elif changed:  # refusals, and the gauges after aborts, with no step to carry them
                self._publish()

    def _take_commands(self, wait: bool) -> bool:
        """Apply every command that has arrived (waiting for one first if `wait`); True if any
        did. EOFError once the server's end is closed."""
        changed = False
        while channel.readable(self.sock, None if wait and not changed else 0):
            command = channel.receive(self.sock)
            changed = True
            if isinstance(command, AddRequests):
                self._add(command)
            elif isinstance(command, AbortRequests):
                self._abort(command.stream_ids)
            elif isinstance(command, Shutdown):
                self._abort(list(self.streams))
                self.stopping = True
            else:
                raise TypeError(f"unknown command {command!r}")
        return changed

    def _add(self, command: AddRequests):
        try:
            seqs = self.engine.add(command.requests)
        except (ValueError, TypeError, RuntimeError) as e:  # this request's failure, not the loop's
            self.refused.append((command.stream_id, f"the engine refused the request: {e}"))
            return
        self.streams[command.stream_id] = EngineStream(seqs)

    def _abort(self, stream_ids: list[int]):
        """Finish the streams' unfinished requests at once (their blocks return to the pool) and
        forget them: their server has stopped listening."""
        streams = [self.streams.pop(i) for i in stream_ids if i in self.streams]
        ids = [request_id for stream in streams for request_id in stream.request_ids]
        if ids:
            self.engine.abort_requests(ids)

    def _publish(self):
        """Send every stream's news since the last message, and the gauges, as one message."""
        deltas, finished = [], []
        for stream_id, stream in list(self.streams.items()):
            for choice, seq, text, token_ids in stream_news(stream.pending, stream.sent):
                deltas.append(_delta(stream_id, stream, choice, seq, text, token_ids))
            if not stream.pending:
                finished.append(stream_id)
                del self.streams[stream_id]
        scheduler = self.engine.scheduler
        blocks = scheduler.block_manager
        usage = 1 - blocks.num_free_blocks / max(blocks.num_blocks, 1)
        channel.send(self.sock, StepOutputs(deltas, finished, self.refused,
                                            len(scheduler.running), len(scheduler.waiting), usage))
        self.refused = []


def _delta(stream_id: int, stream: EngineStream, choice: int, seq: Sequence, text: str | None,
           token_ids: list[int]) -> tuple:
    """A choice's news as StepOutputs carries it: (stream id, a ChoiceDelta's fields), the fields
    after logprobs left to their defaults unless the choice finished or this is its first delta."""
    num_new, num_output = len(token_ids), seq.num_output_tokens
    logprobs = None
    if seq.sampling_params.logprobs is not None:
        logprobs = seq.logprobs[num_output - num_new:num_output]
    delta = (stream_id, choice, text, token_ids, logprobs)
    first = num_output == num_new
    if not first and not seq.is_finished:
        return delta
    prompt_token_ids = prompt_logprobs = None
    num_cached = 0
    if first:
        prompt_first = stream.seqs[choice - seq.sample_index]
        prompt_token_ids, prompt_logprobs = _prompt_logprobs(prompt_first)
        if seq.sample_index == 0:  # the prompt's n samples share its cache hit: count it once
            num_cached = prompt_first.num_prefix_hit_tokens or 0
    return delta + (seq.finish_reason, seq.stop_reason, prompt_token_ids, prompt_logprobs,
                    num_cached)


def _prompt_logprobs(first: Sequence) -> tuple[list[int] | None, list | None]:
    """The prompt's token ids and logprobs, from its first sample (the one that prefilled the
    prompt), once every prompt token has them (a request aborted in its prefill gets none)."""
    if first.sampling_params.prompt_logprobs is None:
        return None, None
    if len(first.prompt_logprobs) != first.num_prompt_tokens - 1:
        return None, None
    return list(first.token_ids[:first.num_prompt_tokens]), list(first.prompt_logprobs)
