"""bench.py and its profiling helpers: the arithmetic and output that need no GPU."""

import time
import types

from bench import HOST_PARTS, MEDIAN, bench_streams, host_time_by_part
from benchmarks.profiling import by_place_in_layer, time_added
from nanovllm import LLM
from nanovllm.engine.scheduler import Scheduler
from nanovllm.runner.model_runner import PendingOutput


def test_time_added_counts_overlapped_kernels_once():
    # a: 0-10; b launched early (PDL) at 2, ends 14: adds 4; c inside b: adds 0; idle 14-20
    kernels = [("b", 2.0, 14.0), ("a", 0.0, 10.0), ("c", 5.0, 12.0), ("d", 20.0, 25.0),
               ("a", 30.0, 31.0)]
    span, idle, added, calls, waits = time_added(kernels)
    # the gaps before d (14-20) and the second a (25-30)
    assert span == 31.0 and idle == {"d": 6.0, "a": 5.0}
    assert added == {"a": 11.0, "b": 4.0, "c": 0.0, "d": 5.0}
    assert calls == {"a": 2, "b": 1, "c": 1, "d": 1}
    assert waits == {"d": 1, "a": 1}  # a ran twice and ended one gap
    assert sum(added.values()) + sum(idle.values()) == span


def test_time_added_of_nothing():
    assert time_added([]) == (0.0, {}, {}, {}, {})


def test_kernels_run_several_times_a_layer_are_named_by_their_place():
    # two layers: gemm twice a layer, norm once a layer and once more, head once
    kernels = [("gemm", 0, 1), ("norm", 1, 2), ("gemm", 2, 3), ("gemm", 3, 4), ("norm", 4, 5),
               ("gemm", 5, 6), ("norm", 6, 7), ("head", 7, 8)]
    assert [name for name, _, _ in by_place_in_layer(kernels[::-1], calls_a_layer=2)] == [
        "gemm #1 of 2", "norm", "gemm #2 of 2", "gemm #1 of 2", "norm", "gemm #2 of 2", "norm",
        "head"]


def test_bench_streams_times_every_run(tiny_model, capsys):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        rates = bench_streams(llm, prompt_len=8, new_tokens=4, num_streams=2,
                              every_control=False, runs=3)
    lines = capsys.readouterr().out.splitlines()
    assert len(rates) == 3 and all(rate > 0 for rate in rates)
    # a CPU run speaks of no GPU: the host computes its steps itself
    assert sum(line.startswith("2 stream(s): prompt 8, ") and "GPU" not in line
               for line in lines) == 3
    breakdowns = [line for line in lines if line.startswith("  host µs a decode step: ")]
    assert len(breakdowns) == 3
    parts = breakdowns[0].split(": ", 1)[1].split(", ")
    assert [item.rsplit(" ", 1)[0] for item in parts] == [*HOST_PARTS, "other"]
    assert lines[-1] == MEDIAN.format(runs=3, rate=sorted(rates)[1])
    assert lines[-1].startswith(f"median of 3 runs: decode {sorted(rates)[1]:,.0f} ")


def test_host_time_by_part_sums_each_part_and_restores_the_methods(monkeypatch):
    originals = {part: getattr(cls, name) for part, (cls, name) in HOST_PARTS.items()}
    monkeypatch.setattr(time, "perf_counter", iter([1.0, 1.25, 2.0, 2.5, 3.0, 3.125]).__next__)
    monkeypatch.setattr(Scheduler, "postprocess", lambda self, step, tokens: tokens)
    step = types.SimpleNamespace(event=None, channel=None, output="tokens")
    with host_time_by_part() as spent:
        assert PendingOutput.result(step) == "tokens"
        assert PendingOutput.result(step) == "tokens"
        assert Scheduler.postprocess(None, None, [7]) == [7]
    assert spent == {**dict.fromkeys(HOST_PARTS, 0.0), "waiting": 0.75, "postprocess": 0.125}
    assert PendingOutput.result is originals["waiting"]
    assert all(getattr(cls, name) is originals[part] for part, (cls, name) in HOST_PARTS.items()
               if part != "postprocess")
