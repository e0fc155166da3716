"""Process lifecycle with tensor parallelism (CPU, gloo, in subprocesses): Ctrl-C, a killed
parent, a script without a main guard, tracebacks without torch's rank prefix."""

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from nanovllm.engine.llm_engine import NO_MAIN_GUARD

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
pytestmark = pytest.mark.cpu_suite
BOUND_SECONDS = 120  # no subprocess may hang the suite
ENV = {**os.environ, "PYTHONPATH": ROOT}  # the scripts import this tree's nanovllm


def start(tmp_path, body: str) -> subprocess.Popen:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=ENV,
                            start_new_session=True)


def generating_forever(tiny_model: str) -> str:
    """A TP=2 script that prints its worker's pid and shm segment, then generates until stopped."""
    return f"""
        from nanovllm import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({tiny_model!r}, tensor_parallel_size=2, kvcache_block_size=16,
                      num_kvcache_blocks=64)
            params = SamplingParams(max_tokens=40, ignore_eos=True)
            llm.generate([[1, 2, 3]], params, use_tqdm=False)
            print(llm.llm_engine.processes[0].pid, llm.llm_engine.channel.base_name, flush=True)
            while True:
                llm.generate([[1, 2, 3]], params, use_tqdm=False)
    """


def wait_gone(pid: str, seconds: float = 10.0) -> bool:
    """Whether process `pid` ends (or is a zombie) within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def kill_if_alive(pid: str):
    try:
        os.kill(int(pid), signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.parametrize("to_group", [False, True], ids=["main-process", "terminal-ctrl-c"])
def test_sigint_mid_generate_exits_with_keyboard_interrupt(tiny_model, tmp_path, to_group):
    proc = start(tmp_path, generating_forever(tiny_model))
    worker_pid, segment = proc.stdout.readline().split()
    try:
        time.sleep(0.5)
        if to_group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        # Bounded below the 10 s that exit once waited for the workers to join.
        _, err = proc.communicate(timeout=9)
        assert proc.returncode == -signal.SIGINT
        assert err.rstrip().endswith("KeyboardInterrupt"), err
        assert "leaked" not in err and "[rank" not in err, err
        assert err.count("Traceback") == 1, err  # rank 0's only: the workers never see SIGINT
        assert wait_gone(worker_pid)
        assert not glob.glob(f"/dev/shm/{segment}*")
    finally:
        proc.kill()
        kill_if_alive(worker_pid)


def test_killed_parent_leaves_no_worker(tiny_model, tmp_path):
    proc = start(tmp_path, generating_forever(tiny_model))
    worker_pid, _ = proc.stdout.readline().split()
    try:
        time.sleep(0.5)
        proc.kill()
        proc.communicate(timeout=BOUND_SECONDS)
        assert wait_gone(worker_pid)
    finally:
        kill_if_alive(worker_pid)


def test_tensor_parallel_without_main_guard_is_one_clear_error(tiny_model, tmp_path):
    proc = start(tmp_path, f"""
        from nanovllm import LLM
        llm = LLM({tiny_model!r}, tensor_parallel_size=2, kvcache_block_size=16,
                  num_kvcache_blocks=64)
    """)
    _, err = proc.communicate(timeout=BOUND_SECONDS)
    assert proc.returncode == 1
    assert err.rstrip().endswith(f"RuntimeError: {NO_MAIN_GUARD}"), err
    assert err.count("Traceback") == 1 and "WorkerDiedError" not in err, err


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_tracebacks_carry_no_rank_prefix(tiny_model, tmp_path, tensor_parallel_size):
    proc = start(tmp_path, f"""
        from nanovllm import LLM
        if __name__ == "__main__":
            llm = LLM({tiny_model!r}, tensor_parallel_size={tensor_parallel_size},
                      kvcache_block_size=16, num_kvcache_blocks=64)
            raise ValueError("raised while the engine is alive")
    """)
    _, err = proc.communicate(timeout=BOUND_SECONDS)
    assert err.rstrip().endswith("ValueError: raised while the engine is alive"), err
    assert "[rank" not in err and err.count("Traceback") == 1, err
