"""Several callers (threads, open streams) share one engine's steps, each getting its own outputs;
the progress bar's rates."""

import itertools
import re
import threading

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine import llm_engine
from nanovllm.llm import throughput_postfix
from tests.conftest import NUM_NEW_TOKENS

pytestmark = pytest.mark.cpu_suite  # exact against transformers on the CPU (see conftest)

GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
BOUND_SECONDS = 120  # no test may hang: each body runs on a thread joined with this bound


def bounded(body, *args):
    """Run body(*args) on a daemon thread; re-raise its error, fail if it does not end."""
    result, errors = [], []

    def target():
        try:
            result.append(body(*args))
        except BaseException as error:  # noqa: BLE001 (re-raised in the test's thread)
            errors.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(BOUND_SECONDS)
    assert not thread.is_alive(), f"{body.__name__} did not finish"
    if errors:
        raise errors[0]
    return result[0]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=96, max_model_len=256) as engine:
        yield engine


def tokens(outputs) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def collect(stream) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    for out in stream:
        got.setdefault(out.index, []).extend(out.token_ids)
    return got


def assert_serves_and_is_idle(llm, prompts, hf_reference):
    assert tokens(llm.generate([prompts[0]], GREEDY, use_tqdm=False)) == hf_reference[:1]
    assert llm.is_finished()
    engine = llm.llm_engine
    assert engine.scheduler.block_manager.num_free_blocks == engine.num_kvcache_blocks


def test_two_threads_generate_what_each_gets_alone(llm, prompts, hf_reference):
    def two_threads():
        start = threading.Barrier(2)
        outputs = {}

        def caller(name, batch):
            start.wait()
            outputs[name] = llm.generate(batch, GREEDY, use_tqdm=False)

        threads = [threading.Thread(target=caller, args=("a", prompts[:5])),
                   threading.Thread(target=caller, args=("b", prompts[5:]))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return outputs

    outputs = bounded(two_threads)
    assert tokens(outputs["a"]) == hf_reference[:5]
    assert tokens(outputs["b"]) == hf_reference[5:]
    assert_serves_and_is_idle(llm, prompts, hf_reference)


def test_stream_left_open_while_generate_runs(llm, prompts, hf_reference):
    def open_stream_then_generate():
        stream = llm.stream(prompts[:3], GREEDY)
        head = [next(stream), next(stream)]
        generated = llm.generate(prompts[3:6], GREEDY, use_tqdm=False)
        return head, generated, stream

    head, generated, stream = bounded(open_stream_then_generate)
    assert tokens(generated) == hf_reference[3:6]
    # The stream's requests finished while generate stepped; what is left comes without a step.
    streamed = bounded(collect, iter(head + list(bounded(list, stream))))
    assert [streamed[i] for i in range(3)] == hf_reference[:3]
    assert_serves_and_is_idle(llm, prompts, hf_reference)


def test_two_interleaved_streams(llm, prompts, hf_reference):
    short = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def interleave():
        first, second = llm.stream(prompts[:3], GREEDY), llm.stream(prompts[3:6], short)
        got = [{}, {}]
        live = [first, second]
        while live:
            for i, stream in enumerate([first, second]):
                if stream not in live:
                    continue
                out = next(stream, None)
                if out is None:
                    live.remove(stream)
                else:
                    got[i].setdefault(out.index, []).extend(out.token_ids)
        return got

    got = bounded(interleave)
    assert [got[0][i] for i in range(3)] == hf_reference[:3]
    assert [got[1][i] for i in range(3)] == [ref[:10] for ref in hf_reference[3:6]]
    assert_serves_and_is_idle(llm, prompts, hf_reference)


def test_closing_a_stream_while_another_caller_runs(llm, prompts, hf_reference):
    def close_mid_generate():
        stream = llm.stream(prompts[:3], GREEDY)
        next(stream)
        llm.add_request(prompts[3], GREEDY)  # a low-level caller's request, stepped by generate
        generated = llm.generate(prompts[4:6], GREEDY, use_tqdm=False)
        stream.close()
        while not llm.is_finished():
            llm.step()
        return generated

    assert tokens(bounded(close_mid_generate)) == hf_reference[4:6]
    assert_serves_and_is_idle(llm, prompts, hf_reference)


def test_step_with_nothing_queued_returns_nothing_and_keeps_serving(llm, prompts, hf_reference):
    result = bounded(llm.step)
    assert (result.finished, result.num_prefill_tokens, result.num_decode_tokens) == ([], 0, 0)
    assert_serves_and_is_idle(llm, prompts, hf_reference)


def rates(prefill: int, decode: int) -> dict[str, str]:
    return {"prefill": f"{prefill} tok/s", "decode": f"{decode} tok/s"}


def test_throughput_postfix_is_tokens_over_the_seconds_of_their_steps():
    assert throughput_postfix(1000, 5.0, 250, 2.5) == rates(200, 100)
    assert throughput_postfix(0, 0.0, 0, 0.0) == rates(0, 0)


def test_progress_bar_rates_count_each_kind_of_step_alone(llm, monkeypatch, capsys):
    # The engine's clock advances 0.5 s a reading: every step takes 0.5 s.
    readings = itertools.count(0.0, 0.5)
    monkeypatch.setattr(llm_engine, "perf_counter", lambda: next(readings))
    llm.reset_prefix_cache()
    prompts = [[(3 * i) % 200 + 1 for i in range(30)], [(5 * i) % 200 + 1 for i in range(50)]]
    params = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)
    bounded(lambda: llm.generate(prompts, params, use_tqdm=True))
    last = capsys.readouterr().err.strip().split("\r")[-1]
    # 80 prompt tokens in one prefill step (0.5 s); 20 decode steps of 2 rows (the first token
    # comes from the prefill) in 10 s.
    postfix = ", ".join(f"{kind}={rate}" for kind, rate in rates(160, 4).items())
    assert re.search(" 2/2 .*" + postfix, last), last


def test_as_completed_yields_each_prompt_as_it_finishes(llm, prompts, hf_reference):
    """Shorter requests first, each with its index; n > 1 as the list of its samples."""
    lengths = [NUM_NEW_TOKENS, 3, 7]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    params[2] = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, n=2)
    got = bounded(lambda: list(llm.as_completed(prompts[:3], params)))
    assert [i for i, _ in got] == [1, 2, 0]
    outputs = dict(got)
    assert outputs[0]["token_ids"] == hf_reference[0]
    assert outputs[1]["token_ids"] == hf_reference[1][:3]
    assert [o.token_ids for o in outputs[2].outputs] == [hf_reference[2][:7]] * 2
    assert_serves_and_is_idle(llm, prompts, hf_reference)


def test_closing_as_completed_early_aborts_the_rest(llm, prompts, hf_reference):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 200)]
    completed = llm.as_completed(prompts[:2], params)
    index, output = bounded(next, completed)
    assert (index, output["token_ids"]) == (0, hf_reference[0][:2])
    completed.close()
    assert llm.is_finished()
    assert_serves_and_is_idle(llm, prompts, hf_reference)


def test_a_failing_progress_bar_queues_nothing(llm, prompts, hf_reference):
    def broken_bar(**kwargs):
        raise RuntimeError("no terminal")

    with pytest.raises(RuntimeError, match="no terminal"):
        llm.generate(prompts[:2], GREEDY, use_tqdm=broken_bar)
    assert llm.is_finished()
    llm.sleep()  # refused if requests were left queued
    llm.wake_up()
    assert_serves_and_is_idle(llm, prompts, hf_reference)
