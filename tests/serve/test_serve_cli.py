"""The command line: engine flags built from Config, and a real process stopped by SIGTERM."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
from conftest import ENGINE_OPTIONS
from serve_helpers import TIMEOUT, wait_until

from nanovllm.config import Config, option_names
from nanovllm.serve.cli import engine_options, serve_main, serve_parser
from nanovllm.serve.server import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_engine_option_is_a_flag_of_its_type():
    parser = serve_parser()
    flags = {a.dest: a for a in parser._actions}
    fields = {f.name: f for f in dataclasses.fields(Config)}
    for name in option_names():
        assert name in flags, name
        assert flags[name].option_strings == (
            ["--" + name.replace("_", "-")] if fields[name].type is not bool
            else ["--" + name.replace("_", "-"), "--no-" + name.replace("_", "-")])


def test_only_the_given_flags_reach_the_engine():
    args = serve_parser().parse_args(["m", "--max-model-len", "128", "--enforce-eager",
                                      "--no-skip-tokenizer-init", "--gguf-file", "x.gguf"])
    assert engine_options(args) == {"max_model_len": 128, "enforce_eager": True,
                                    "skip_tokenizer_init": False, "gguf_file": "x.gguf"}
    assert engine_options(serve_parser().parse_args(["m"])) == {}
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["m", "--max-model-len", "long"])
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["m", "--no-such-option", "1"])


def test_a_dict_option_takes_json():
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    args = serve_parser().parse_args(["m", "--speculative-config", spec])
    assert engine_options(args) == {"speculative_config": {"method": "ngram",
                                                           "num_speculative_tokens": 3}}
    for bad in ("ngram", "[1, 2]"):
        with pytest.raises(SystemExit):
            serve_parser().parse_args(["m", "--speculative-config", bad])


def test_auto_tool_choice_needs_a_parser(capsys):
    """Refused before any engine starts, as vLLM refuses it."""
    with pytest.raises(SystemExit) as exit:
        serve_main(["m", "--enable-auto-tool-choice"])
    assert exit.value.code == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["m", "--tool-call-parser", "xml"])
    args = serve_parser().parse_args(["m", "--enable-auto-tool-choice",
                                      "--tool-call-parser", "hermes"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "hermes")
    assert engine_options(args) == {}


def test_the_server_needs_a_tokenizer(tiny_model):
    from nanovllm.serve.engine_client import EngineClient

    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        EngineClient(tiny_model, dict(skip_tokenizer_init=True, **ENGINE_OPTIONS))


def test_an_engine_that_cannot_start_raises_its_error(tiny_model, tmp_path):
    """A checkpoint whose config and tokenizer read well but whose weights are missing: the
    server's checks pass, the engine process fails to load, and its error is raised here."""
    from nanovllm.serve.engine_client import EngineClient

    for name in os.listdir(tiny_model):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_model, name), tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        EngineClient(str(tmp_path), ENGINE_OPTIONS)


def test_a_script_without_a_main_guard_is_told_why_its_engine_exited(tiny_model, tmp_path):
    """The engine's process is spawned and imports the main script: one that starts a server
    at import time makes that process start another and exit; the error says what to do."""
    script = tmp_path / "unguarded.py"
    script.write_text("from nanovllm.serve.server import ServerThread\n"
                      f"ServerThread({tiny_model!r}, engine_options={ENGINE_OPTIONS!r})\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=TIMEOUT, env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 1
    assert "the engine process exited during start-up" in result.stderr
    assert "if __name__ == '__main__':" in result.stderr


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def spawned_children(pid: int) -> set[int]:
    """The child processes of `pid` that multiprocessing spawned (the engine's, not the resource
    tracker that spawning starts, which outlives its parent by a moment), from Linux's /proc."""
    found = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found.update(map(int, f.read().split()))
    spawned = set()
    for child in found:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                spawned.add(child)
    return spawned


def has_ended(pid: int) -> bool:
    """No such process, or only its exit status is left (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_sigterm_finishes_the_running_stream_and_exits_cleanly(tiny_model):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "nanovllm.serve", tiny_model, "--port", str(port),
               "--served-model-name", "tiny", "--num-kvcache-blocks", "64",
               "--kvcache-block-size", "16", "--max-model-len", "256", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _healthy(url) or process.poll() is not None, timeout=TIMEOUT,
                   what="the server's start")
        assert process.poll() is None, process.stdout.read().decode()
        engine = spawned_children(process.pid)
        assert len(engine) == 1, engine
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
            assert json.load(response)["data"][0]["id"] == "tiny"
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        chunks = client.completions.create(model="tiny", prompt="bye", max_tokens=100,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        first = next(iter(chunks))
        process.send_signal(signal.SIGTERM)
        time.sleep(0.2)  # the server now drains: the stream still completes
        rest = list(chunks)
        assert first.choices[0].finish_reason is None
        assert rest[-1].choices[0].finish_reason == "length"
        assert process.wait(timeout=TIMEOUT) == 0
        assert has_ended(engine.pop())  # the server ended its engine: no orphan left behind
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        process.stdout.close()
