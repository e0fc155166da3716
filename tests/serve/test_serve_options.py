"""The server's own options: --chat-template (a file or the template itself) in place of the
tokenizer's, and CORS for browsers, whose preflight carries no API key."""

import urllib.request

import pytest
from conftest import ENGINE_OPTIONS, MODEL_NAME
from serve_helpers import TIMEOUT, assert_error, post, request

from nanovllm.serve.cli import cors_options, load_chat_template, serve_main, serve_parser
from nanovllm.serve.server import ServerThread

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
KEY = "sesame"
ORIGIN = "http://localhost:3000"


@pytest.fixture(scope="module")
def server(tiny_model):
    cors = cors_options(serve_parser().parse_args(["m"]))  # the command line's defaults
    with ServerThread(tiny_model, MODEL_NAME, engine_options=ENGINE_OPTIONS, api_key=KEY,
                      tokenizer_info=True, chat_template=TEMPLATE, cors=cors) as server:
        yield server


def test_load_chat_template(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE == load_chat_template(TEMPLATE)
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match=r"does not compile: .*endfor.*\(line 1\)"):
        load_chat_template("{% for m in messages %}{{ m }}")
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["m", "--allowed-origins", "http://a"])  # not JSON


def test_a_bad_template_stops_the_command_before_any_engine(capsys):
    with pytest.raises(SystemExit) as exit:
        serve_main(["no-such-model", "--chat-template", "chat.jinja"])
    assert exit.value.code == 2
    assert "--chat-template 'chat.jinja' is neither a file" in capsys.readouterr().err


def test_chats_are_rendered_with_the_given_template(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "user", "content": "Hi"}]
    status, body = post(server, "/tokenize", {"messages": messages})
    assert status == 200, body
    status, text = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert text["prompt"] == "[user] Hi\n[assistant] "
    status, reply = post(server, "/v1/chat/completions",
                         {"messages": messages, "max_tokens": 2}, headers)
    assert status == 200, reply
    assert reply["usage"]["prompt_tokens"] == body["count"]
    status, info = request(server, "/tokenizer_info")
    assert status == 200 and info["chat_template"] == TEMPLATE


def test_a_browsers_preflight_passes_without_the_key(server):
    preflight = urllib.request.Request(
        server.url + "/v1/chat/completions", method="OPTIONS",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"})
    with urllib.request.urlopen(preflight, timeout=TIMEOUT) as response:
        assert response.status == 200
        assert response.headers["access-control-allow-origin"] == "*"
        assert "POST" in response.headers["access-control-allow-methods"]
    # The request itself still needs the key.
    assert_error(*request(server, "/v1/models", headers={"Origin": ORIGIN}), 401, "API key")
