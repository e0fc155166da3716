"""The engine in its own process: when that process dies, the requests it held fail with the
documented error, /health and new requests answer 503, and the server itself stays up."""

import os
import signal
import threading

from conftest import ENGINE_OPTIONS, MODEL_NAME
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import TIMEOUT, assert_error, post, request, wait_until

from nanovllm.serve.server import ServerThread

COMPLETIONS = "/v1/completions"


def requests_taken(server) -> float:
    _, text = request(server, "/metrics")
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "nanovllm:requests"]
    return next(s.value for s in family.samples if s.name == "nanovllm:requests_total")


def test_a_dead_engine_fails_its_requests_and_the_server_answers_503(tiny_model):
    with ServerThread(tiny_model, MODEL_NAME, ENGINE_OPTIONS) as server:
        pid = server.engine.process.pid
        answers = {}
        body = {"model": MODEL_NAME, "prompt": "wait", "max_tokens": 8}
        callers = [threading.Thread(target=lambda k=k, s=s: answers.__setitem__(
            k, post(server, COMPLETIONS, {**body, "stream": s}))) for k, s in
            (("whole", False), ("streamed", True))]
        os.kill(pid, signal.SIGSTOP)  # frozen: the two requests are taken, never answered
        try:
            for caller in callers:
                caller.start()
            wait_until(lambda: requests_taken(server) == 2, what="both requests' submission")
        finally:
            os.kill(pid, signal.SIGKILL)
        for caller in callers:
            caller.join(TIMEOUT)
        assert_error(*answers["whole"], 503, "the engine failed", "exit code -9")
        status, events = answers["streamed"]
        assert status == 200 and "the engine failed" in events and "service_unavailable" in events
        assert events.endswith("data: [DONE]\n\n")
        assert request(server, "/health")[0] == 503
        assert_error(*post(server, COMPLETIONS, body), 503, "the engine failed")
        assert request(server, "/v1/models")[0] == 503  # the whole /v1 refuses
        assert request(server, "/metrics")[0] == 200  # the server itself answers
