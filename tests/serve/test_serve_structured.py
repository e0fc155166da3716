"""response_format on the server: json_schema and json_object constrain the answer (the tiny
checkpoint's text is noise, so only the mask makes it JSON); a bad schema is a 400."""

import json

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
