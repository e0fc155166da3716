"""uvicorn around the app: in the foreground with a clean exit on SIGTERM/SIGINT (stop accepting,
let running requests finish up to a timeout, abort the rest, end the engine process), or on a
thread (tests, benchmarks)."""

import contextlib
import signal
import socket
import threading
import time

import uvicorn

from nanovllm.serve.app import build_app
from nanovllm.serve.engine_client import EngineClient

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Server(uvicorn.Server):
    """uvicorn's server, told which app state to mark as draining when a signal comes; it exits
    by returning (the app's end has stopped the engine) rather than by re-raising the signal."""

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame):
        self.state.draining = True  # new /v1 requests get 503 from now on
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def make_server(engine: EngineClient, model_name: str, host: str, port: int,
                api_key: str | None = None, shutdown_timeout: float = 30.0,
                log_level: str = "info", tokenizer_info: bool = False,
                tool_parser: str | None = None, reasoning_parser: str | None = None,
                chat_template: str | None = None, cors: dict | None = None) -> Server:
    app = build_app(engine, model_name, api_key, tokenizer_info, tool_parser, reasoning_parser,
                    chat_template, cors)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on")
    return Server(config, app.state.server)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """The server on a thread of this process, on 127.0.0.1 and a free port, over an engine
    process started from `LLM(model, **engine_options)`'s arguments: `url` once started; stop()
    shuts both down as a signal would."""

    def __init__(self, model: str, model_name: str = "model", engine_options: dict | None = None,
                 start_timeout: float = 60.0, **options):
        options.setdefault("log_level", "warning")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine = EngineClient(model, engine_options or {})
        try:
            self.server = make_server(self.engine, model_name, "127.0.0.1", self.port, **options)
        except BaseException:
            self.engine.stop()
            raise
        self.state = self.server.state
        self.thread = threading.Thread(target=self.server.run, name="nanovllm-server",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start within {start_timeout} s")
            time.sleep(0.01)

    def stop(self, timeout: float = 60.0):
        self.state.draining = True
        self.server.should_exit = True
        self.thread.join(timeout)
        self.engine.stop()  # already stopped by the app's end, unless it never started

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
