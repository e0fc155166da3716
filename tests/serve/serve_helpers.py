"""Helpers of the server tests: offline outputs in one shape, raw HTTP, bounded waits."""

import json
import time
import urllib.error
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

from nanovllm.serve.server import ServerThread

TIMEOUT = 120.0


def completions_of(output) -> list[dict]:
    """One prompt's offline output (a dict, a list of n dicts, or a RequestOutput) as a list of
    {"text", "token_ids"} dicts, one per sample."""
    if hasattr(output, "outputs"):
        return [{"text": c.text, "token_ids": list(c.token_ids)} for c in output.outputs]
    outputs = [output] if isinstance(output, dict) else output
    return [{"text": o["text"], "token_ids": list(o["token_ids"])} for o in outputs]


def post(server: ServerThread, path: str, body: bytes | dict, headers: dict | None = None):
    """(status, parsed JSON body) of a POST, errors included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request(server, path, data, {"Content-Type": "application/json", **(headers or {})})


def request(server: ServerThread, path: str, data: bytes | None = None,
            headers: dict | None = None):
    req = urllib.request.Request(server.url + path, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode()


def wait_until(condition, timeout: float = 30.0, what: str = "the condition"):
    """Poll `condition` until it holds, for at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(0.02)


def assert_error(status: int, body, expected_status: int, *words: str):
    """OpenAI's error body, with the expected status and words in its message."""
    assert status == expected_status, body
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    for word in words:
        assert word in body["error"]["message"], body


def client_for(server: ServerThread, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0,
                         timeout=TIMEOUT)


def gauges(server: ServerThread) -> dict[str, float]:
    """/metrics' gauges by name: the engine's queues and its KV pool's use after its last step."""
    status, text = request(server, "/metrics")
    assert status == 200, text
    return {s.name: s.value for family in text_string_to_metric_families(text)
            if family.type == "gauge" for s in family.samples}
