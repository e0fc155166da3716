"""response_format on the server: json_schema and json_object constrain the answer (the tiny
checkpoint's text is noise, so only the mask makes it JSON); a bad schema is a 400."""

import json
import re
import threading

import pytest
from conftest import MODEL_NAME
from serve_helpers import assert_error, post

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

CHAT = "/v1/chat/completions"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0}},
          "required": ["ok", "n"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "answer in JSON"}]


def test_json_schema_answers_validate(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=60, n=4, temperature=1.0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": SCHEMA}})
    stopped = [c for c in response.choices if c.finish_reason == "stop"]
    assert stopped
    for choice in stopped:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_answers_parse(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=80, n=4, seed=1,
        response_format={"type": "json_object"})
    for choice in response.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("response_format, words", [
    ({"type": "json_schema", "json_schema": {"name": "x"}}, ["json_schema.schema"]),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}},
     ["json", "objec"]),
    ({"type": "xml"}, ["response_format", "json_schema"]),
])
def test_a_bad_response_format_is_a_400(server, response_format, words):
    status, body = post(server, CHAT, {"model": MODEL_NAME, "messages": MESSAGES,
                                       "response_format": response_format})
    assert_error(status, body, 400, *words)


def test_vllms_structured_outputs_field(client, server):
    """vLLM's extra request field, on completions and chat alike."""
    response = client.completions.create(
        model=MODEL_NAME, prompt="Pick:", max_tokens=20, temperature=1.0, n=3, seed=2,
        extra_body={"structured_outputs": {"regex": "(yes|no)-[0-9]{2}"}})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        assert re.fullmatch("(yes|no)-[0-9]{2}", choice.text), choice.text
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert chat.choices[0].message.content in ("red", "green")
    assert_error(*post(server, "/v1/completions", {"prompt": "x", "structured_outputs": {
        "regexp": "a"}}), 400, "structured_outputs", "'regexp'")
    assert_error(*post(server, CHAT, {"messages": MESSAGES, "structured_outputs": {"regex": "a"},
                                      "response_format": {"type": "json_object"}}), 400,
                 "structured_outputs and response_format")


def test_requests_are_checked_off_the_event_loop(server, client, monkeypatch):
    """make_requests (where a new grammar compiles, with the interpreter's lock released) runs on
    a worker thread, so the event loop goes on streaming meanwhile."""
    threads = []
    make_requests = server.engine.make_requests

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return make_requests(*args, **kwargs)

    monkeypatch.setattr(server.engine, "make_requests", recording)
    client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                   response_format={"type": "json_object"})
    client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    assert len(threads) == 2 and server.thread.name not in threads, threads
