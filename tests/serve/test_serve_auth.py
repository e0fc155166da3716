"""The bearer key and the shutting-down state, each on a server of its own."""

import openai
import pytest
from conftest import ENGINE_OPTIONS, MODEL_NAME
from serve_helpers import assert_error, client_for, post, request

from nanovllm.serve.server import ServerThread

COMPLETIONS = "/v1/completions"


def test_the_api_key_is_required_when_set(tiny_model):
    with ServerThread(tiny_model, MODEL_NAME, ENGINE_OPTIONS, api_key="sesame") as server:
        with pytest.raises(openai.AuthenticationError):
            client_for(server, "wrong").models.list()
        status, body = post(server, COMPLETIONS, {"prompt": "x"})
        assert_error(status, body, 401, "API key")
        keyed = client_for(server, "sesame")
        assert keyed.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2).choices
        assert request(server, "/health")[0] == 200  # health and metrics need no key
        assert request(server, "/metrics")[0] == 200


def test_shutting_down_answers_503(tiny_model):
    with ServerThread(tiny_model, MODEL_NAME, ENGINE_OPTIONS) as server:
        server.state.draining = True
        assert_error(*post(server, COMPLETIONS, {"prompt": "x"}), 503, "shutting down")
        assert request(server, "/health")[0] == 503
