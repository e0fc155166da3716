"""Data parallelism on Ray: replicas give one engine's tokens in input order, survive a killed
replica, and the Ray Data helper equals generate. One local Ray (CPU actors) for the module."""

import sys
import threading

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.ray.data_parallel import balance, uses_ray

pytestmark = pytest.mark.cpu_suite  # CPU actors, exact against one CPU engine

OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
CALL_SECONDS = 120  # a call that takes longer hangs


def seeded(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.9, top_k=50, seed=100 + i, max_tokens=8 + i % 5,
                           ignore_eos=True) for i in range(n)]


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    # Logical CPUs: the replicas and Ray Data's actors and tasks must all be schedulable at once.
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def dp_llm(local_ray, tiny_model):
    llm = LLM(tiny_model, data_parallel_size=2, **OPTIONS)
    yield llm
    llm.exit()


@pytest.fixture(scope="module")
def uneven_prompts(prompts) -> list[list[int]]:
    return prompts + [[(5 * i) % 250 + 3 for i in range(n)] for n in (90, 2, 45)]


@pytest.fixture(scope="module")
def one_engine(tiny_model, uneven_prompts):
    """One in-process engine's greedy and seeded outputs for uneven_prompts."""
    with LLM(tiny_model, **OPTIONS) as llm:
        greedy = llm.generate(uneven_prompts, GREEDY, use_tqdm=False)
        sampled = llm.generate(uneven_prompts, seeded(len(uneven_prompts)), use_tqdm=False)
    return greedy, sampled


def completions(outputs: list) -> list:
    """The outputs' samples: what must agree between engines (request ids are each engine's)."""
    return [o.outputs for o in outputs]


def run_bounded(call):
    """call() on a thread: its result or its exception, or a failure if it does not return within
    CALL_SECONDS."""
    result = {}

    def target():
        try:
            result["value"] = call()
        except BaseException as error:
            result["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(CALL_SECONDS)
    assert not thread.is_alive(), f"the call did not return within {CALL_SECONDS} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_uses_ray_only_for_replicas_or_when_asked():
    assert not uses_ray({})
    assert not uses_ray({"data_parallel_size": 1, "data_parallel_backend": "auto"})
    assert uses_ray({"data_parallel_size": 2})
    assert uses_ray({"data_parallel_backend": "ray"})


def test_balance_gives_the_costliest_to_the_lightest_shard():
    # 5 -> a; 4 -> b; 3 -> b (4 < 5); 2 -> a (5 < 7); 1 -> a (7 = 7, lower shard first)
    assert balance([5, 1, 4, 2, 3], 2) == [[0, 1, 3], [2, 4]]
    assert balance([1, 1], 3) == [[0], [1], []]


def test_greedy_and_seeded_equal_one_engine_in_input_order(dp_llm, uneven_prompts, one_engine):
    greedy, sampled = one_engine
    assert dp_llm.llm_engine.data_parallel_size == 2
    outputs = dp_llm.generate(uneven_prompts, GREEDY)
    assert completions(outputs) == completions(greedy)
    seeded_outputs = dp_llm.generate(uneven_prompts, seeded(len(uneven_prompts)), use_tqdm=False)
    assert completions(seeded_outputs) == completions(sampled)


def test_text_prompts_and_chat_equal_one_engine(dp_llm, tiny_model):
    conversations = [[{"role": "user", "content": "hi " * n}] for n in (1, 7, 3)]
    with LLM(tiny_model, data_parallel_size=1, **OPTIONS) as llm:  # one in-process engine
        assert isinstance(llm, LLM)
        texts = llm.generate(["Hello", "a longer prompt"], GREEDY, use_tqdm=False)
        chats = llm.chat(conversations, GREEDY, use_tqdm=False)
    dp_texts = dp_llm.generate(["Hello", "a longer prompt"], GREEDY, use_tqdm=False)
    assert completions(dp_texts) == completions(texts)
    assert completions(dp_llm.chat(conversations, GREEDY, use_tqdm=False)) == completions(chats)


def test_bad_requests_raise_before_any_is_sent(dp_llm, tiny_model):
    """The same checks, errors and messages as one engine, before anything reaches a replica."""
    too_long = SamplingParams(max_tokens=300)
    too_many = SamplingParams(n=5, max_tokens=4)
    with LLM(tiny_model, max_num_seqs=4, **OPTIONS) as llm:
        with pytest.raises(ValueError, match=r"prompt 0: n=5 samples exceed max_num_seqs=4"):
            llm.generate([[1, 2]], too_many)
    with LLM(tiny_model, data_parallel_size=2, max_num_seqs=4, **OPTIONS) as dp:
        with pytest.raises(ValueError, match=r"prompt 0: n=5 samples exceed max_num_seqs=4"):
            dp.generate([[1, 2]], too_many)
        assert dp.llm_engine._broadcast("is_finished") == [True, True]
    with pytest.raises(ValueError, match=r"prompt 1: .* exceeds max_model_len=256"):
        dp_llm.generate([[1, 2], [3]], [GREEDY, too_long])
    with pytest.raises(ValueError, match=r"prompt 0 has token id 999 outside the vocabulary"):
        dp_llm.generate([[999]], GREEDY)


def test_broadcast_reaches_every_replica(dp_llm):
    assert dp_llm.llm_engine._broadcast("is_finished") == [True, True]
    dp_llm.reset_prefix_cache()
    with pytest.raises(AttributeError, match="the engine has no method 'no_such_method'"):
        dp_llm.llm_engine._broadcast("no_such_method")
    with pytest.raises(NotImplementedError, match="LLM.stream runs on one engine"):
        dp_llm.stream([[1]], GREEDY)
    with pytest.raises(NotImplementedError, match="LLM.step steps one engine"):
        dp_llm.step()


def test_a_refused_operation_leaves_every_replica_unchanged(dp_llm, tiny_model, uneven_prompts,
                                                            one_engine):
    """update_weights while a call still runs is refused before any replica acts; a bad tensor is
    refused by every replica's check before any copies it."""
    import torch

    greedy, _ = one_engine
    zeros = {"model.norm.weight": torch.zeros(64)}
    running = dp_llm.as_completed(uneven_prompts, GREEDY)
    next(running)
    with pytest.raises(RuntimeError, match=r"update_weights\(\) refused: 1 generate calls"):
        dp_llm.update_weights(zeros)
    running.close()
    with pytest.raises(ValueError, match="model.norm.weight"):
        dp_llm.update_weights({"model.norm.weight": torch.zeros(3)})
    assert completions(dp_llm.generate(uneven_prompts, GREEDY, use_tqdm=False)) == \
        completions(greedy)


def test_started_off_the_main_thread_without_ray_is_refused(local_ray, tiny_model, monkeypatch):
    monkeypatch.setattr(local_ray, "is_initialized", lambda: False)
    result = {}

    def start():
        try:
            LLM(tiny_model, data_parallel_size=2, **OPTIONS)
        except RuntimeError as error:
            result["error"] = str(error)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(CALL_SECONDS)
    assert "call ray.init() in the main thread" in result["error"]


def shard_of_first_replica(prompts: list, params: list) -> set[int]:
    """The prompts the driver sends to the first replica (balance by expected tokens)."""
    costs = [len(p) + sp.max_tokens for p, sp in zip(prompts, params)]
    return set(balance(costs, 2)[0])


def test_a_replica_killed_mid_batch(dp_llm, local_ray, uneven_prompts, tiny_model):
    """Killed once one of its requests has come back, its others re-run on the other replica;
    every output equals one engine's."""
    params = [SamplingParams(temperature=0, max_tokens=10 + 20 * (i % 4), ignore_eos=True)
              for i in range(len(uneven_prompts))]
    prompts = [p[:40] for p in uneven_prompts]
    with LLM(tiny_model, **OPTIONS) as llm:
        expected = llm.generate(prompts, params, use_tqdm=False)
    victim = dp_llm.llm_engine.replicas[0].actor
    victims = shard_of_first_replica(prompts, params)

    def run():
        outputs, returned = {}, None
        for index, output in dp_llm.as_completed(prompts, params):
            outputs[index] = output
            if index in victims and returned is None:
                local_ray.kill(victim)
                returned = len(victims & set(outputs))
        return outputs, returned

    outputs, returned = run_bounded(run)
    assert 0 < dp_llm.llm_engine.num_rerun_requests <= len(victims) - returned
    assert dp_llm.llm_engine.data_parallel_size == 1
    assert completions([outputs[i] for i in range(len(prompts))]) == completions(expected)


def test_a_dead_replica_keeps_its_returned_outputs(local_ray, tiny_model, prompts):
    """A replica killed after its short requests returned: only its long ones run again."""
    short = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=230, ignore_eos=True)
    batch = [p[:20] for p in prompts[:8]] * 2
    params = [short] * 8 + [long] * 8
    with LLM(tiny_model, **OPTIONS) as llm:
        expected = llm.generate(batch, params, use_tqdm=False)
    victims = shard_of_first_replica(batch, params)
    short_victims = {i for i in victims if i < 8}
    assert len(short_victims) == 4 and len(victims) == 8  # 4 short and 4 long requests
    with LLM(tiny_model, data_parallel_size=2, **OPTIONS) as dp:
        victim = dp.llm_engine.replicas[0].actor

        def run():
            outputs, killed = {}, False
            for index, output in dp.as_completed(batch, params):
                outputs[index] = output
                if short_victims <= set(outputs) and not killed:
                    local_ray.kill(victim)  # the short ones finish first
                    killed = True
            return outputs

        outputs = run_bounded(run)
        assert dp.llm_engine.num_rerun_requests == 4
        assert completions([outputs[i] for i in range(len(batch))]) == completions(expected)


def test_every_replica_dead_is_a_clear_error(dp_llm, local_ray):
    for replica in list(dp_llm.llm_engine.replicas):
        local_ray.kill(replica.actor)
    with pytest.raises(RuntimeError, match="every data-parallel replica has died"):
        run_bounded(lambda: dp_llm.generate([[1, 2, 3]], GREEDY))


def test_ray_data_helper_equals_generate(local_ray, tiny_model):
    from nanovllm.ray_data import generate_dataset

    rows = [{"id": i, "prompt": [(7 * i + j) % 250 + 1 for j in range(1 + i % 13)]}
            for i in range(200)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(tiny_model, **OPTIONS) as llm:
        expected = llm.generate([row["prompt"] for row in rows], params, use_tqdm=False)
    dataset = local_ray.data.from_items(rows)
    out = generate_dataset(dataset, tiny_model, params, num_replicas=2, batch_size=50, **OPTIONS)
    out = sorted(out.take_all(), key=lambda row: row["id"])
    assert [row["id"] for row in out] == list(range(200))
    assert [list(row["generated_token_ids"]) for row in out] == [o["token_ids"] for o in expected]
    assert [row["generated_text"] for row in out] == [o["text"] for o in expected]
    assert {row["finish_reason"] for row in out} == {"length"}


@pytest.mark.parametrize("size,error,message", [
    (0, ValueError, "data_parallel_size must be >= 1, got 0"),
    (-2, ValueError, "data_parallel_size must be >= 1, got -2"),
    (2.0, TypeError, "data_parallel_size must be an int, got 2.0"),
    ("2", TypeError, "data_parallel_size must be an int, got '2'"),
    (True, TypeError, "data_parallel_size must be an int, got True"),
])
def test_bad_data_parallel_size(tiny_model, size, error, message):
    with pytest.raises(error, match=message):
        LLM(tiny_model, data_parallel_size=size)


def test_bad_backend_and_unknown_option(tiny_model):
    with pytest.raises(ValueError, match=r"data_parallel_backend='mp' is not one of \('auto', "):
        LLM(tiny_model, data_parallel_backend="mp")
    with pytest.raises(TypeError, match="unknown option 'max_num_seq'"):
        LLM(tiny_model, data_parallel_size=2, max_num_seq=4)


def test_ray_missing_names_the_extra(tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"data_parallel_size=2 needs Ray.*nanovllm\[ray\]"):
        LLM(tiny_model, data_parallel_size=2)
    with pytest.raises(ImportError, match=r"needs Ray.*nanovllm\[ray\]"):
        LLM(tiny_model, data_parallel_backend="ray")


def test_import_nanovllm_does_not_import_ray():
    import subprocess

    code = "import sys, nanovllm; from nanovllm import LLM; print('ray' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"
