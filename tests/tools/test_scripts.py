"""The root scripts as a newcomer meets them: Ctrl-C, and where bench.py writes its checkpoint."""

import os
import pathlib
import signal
import subprocess
import sys

import pytest

import bench

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["example", "bench"])
def test_ctrl_c_prints_one_line_and_exits_130(script):
    code = f"import {script}; raise KeyboardInterrupt"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert done.returncode in (130, -signal.SIGINT)  # the shell's and subprocess' spelling
    assert done.stderr == "Interrupted.\n"


def test_bench_writes_its_checkpoint_under_xdg_cache_home(tmp_path, monkeypatch, capsys):
    written = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(bench, "write_benchmark_checkpoint",
                        lambda path, shape, dtype: written.append(path) or os.makedirs(path))
    path = bench.resolve_model(None, "smollm2-135m")
    assert path == str(tmp_path / "nanovllm" / "random-smollm2-135m") and written == [path]
    err = capsys.readouterr().err
    assert err.startswith(f"No checkpoint given: writing a random-weight smollm2-135m checkpoint "
                          f"to {path} (once")
    assert "\nWrote 0.00 GB in " in err
