"""uvicorn around the app: in the foreground with a clean exit on SIGTERM/SIGINT (stop accepting,
let running requests finish up to a timeout, abort the rest), or on a thread (tests, benchmarks)."""

import contextlib
import signal
import socket
import threading
import time

import uvicorn

from nanovllm.serve.app import build_app

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Server(uvicorn.Server):
    """uvicorn's server, told which app state to mark as draining when a signal comes; it exits
    by returning (the caller then exits the engine) rather than by re-raising the signal."""

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


def make_server(llm, model_name: str, host: str, port: int, api_key: str | None = None,
                shutdown_timeout: float = 30.0, log_level: str = "info") -> Server:
    app = build_app(llm, model_name, api_key)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on")
    return Server(config, app.state.server)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """The server on a thread of this process, on 127.0.0.1 and a free port: `url` once
    started; stop() shuts it down as a signal would."""

    def __init__(self, llm, model_name: str = "model", start_timeout: float = 60.0, **options):
        options.setdefault("log_level", "warning")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(llm, model_name, "127.0.0.1", self.port, **options)
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
