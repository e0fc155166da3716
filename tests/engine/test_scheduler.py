"""Scheduler: exact batches, queues and block tables, driven by a fake model.

The fake model samples `fake_token(seq)`, a function of the prompt's first token and the position,
so a sequence's output does not depend on how it was scheduled (chunked, preempted, re-prefilled).
"""

from dataclasses import dataclass

import pytest

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

EOS = 0
BLOCK_SIZE = 4


def fake_token(seq: Sequence) -> int:
    return 1000 * seq.token_ids[0] + seq.num_tokens


def make_scheduler(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                   max_model_len=256) -> Scheduler:
    return Scheduler(max_num_seqs, max_num_batched_tokens, max_model_len, num_blocks, BLOCK_SIZE,
                     {EOS})


def add(sched: Scheduler, tokens, max_tokens=6, ignore_eos=False) -> Sequence:
    sched.check_fits(len(tokens), max_tokens)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    seq = Sequence(list(tokens), params, BLOCK_SIZE)
    sched.add(seq)
    return seq


def live(sched: Scheduler) -> list[Sequence]:
    return list(sched.waiting) + list(sched.running)


@dataclass
class Step:
    is_prefill: bool
    scheduled: list[tuple[Sequence, int]]  # (sequence, num_scheduled_tokens)
    cached: list[int]  # num_cached_tokens of each scheduled sequence when scheduled
    preempted: list[Sequence]
    finished: list[Sequence]


def step(sched: Scheduler, model=fake_token) -> Step:
    was_running = list(sched.running)
    seqs, is_prefill = sched.schedule()
    scheduled = [(seq, seq.num_scheduled_tokens) for seq in seqs]
    cached = [seq.num_cached_tokens for seq in seqs]
    preempted = [seq for seq in was_running if seq in sched.waiting]
    tokens = [model(seq) for seq in seqs if seq.completes_prefill]
    finished = sched.postprocess(sched.commit(seqs, is_prefill), tokens)
    sched.block_manager.check_integrity(live(sched))
    return Step(is_prefill, scheduled, cached, preempted, finished)


def run_to_end(sched: Scheduler, model=fake_token, max_steps=1000) -> list[Step]:
    steps = []
    while not sched.is_finished():
        assert len(steps) < max_steps, "scheduler made no progress"
        steps.append(step(sched, model))
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return steps


def expected_completion(seq: Sequence, max_tokens: int) -> list[int]:
    first, n = seq.token_ids[0], seq.num_prompt_tokens
    return [1000 * first + n + i for i in range(max_tokens)]


def test_prefill_respects_the_token_budget_and_never_chunks_a_later_sequence():
    sched = make_scheduler(max_num_batched_tokens=16)
    a, b, c = (add(sched, range(10 * i + 1, 10 * i + 7)) for i in range(3))
    s = step(sched)
    assert s.is_prefill and s.scheduled == [(a, 6), (b, 6)]  # c (6 > 4 left) waits whole
    assert list(sched.waiting) == [c] and c.block_table == []
    assert list(sched.running) == [a, b]
    s = step(sched)  # prefill goes first, even with sequences ready to decode
    assert s.is_prefill and s.scheduled == [(c, 6)]
    s = step(sched)
    assert not s.is_prefill and s.scheduled == [(a, 1), (b, 1), (c, 1)]
    for seq in (a, b, c):
        assert seq.completion_token_ids == expected_completion(seq, 2)


def test_prefill_respects_the_sequence_budget():
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = (add(sched, [i, 50, 51], max_tokens=2) for i in (1, 2, 3))
    s = step(sched)
    assert s.is_prefill and s.scheduled == [(a, 3), (b, 3)]
    assert list(sched.waiting) == [c]
    s = step(sched)  # two sequences running: c waits although tokens and blocks are available
    assert not s.is_prefill and s.scheduled == [(a, 1), (b, 1)] and s.finished == [a, b]
    s = step(sched)
    assert s.is_prefill and s.scheduled == [(c, 3)]


def test_a_long_prompt_is_chunked_at_the_head_of_waiting():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = add(sched, range(1, 21))
    b = add(sched, [30, 31, 32])
    s = step(sched)
    assert s.is_prefill and s.scheduled == [(a, 8)]
    assert list(sched.waiting) == [a, b] and not sched.running
    assert a.status == SequenceStatus.WAITING
    assert a.num_tokens == 20 and a.num_cached_tokens == 8  # no token sampled
    assert a.block_table == [0, 1, 2, 3, 4] and b.block_table == []
    assert set(sched.block_manager.hash_to_block_id.values()) == {0, 1}
    s = step(sched)
    assert s.scheduled == [(a, 8)] and a.num_tokens == 20 and list(sched.waiting) == [a, b]
    s = step(sched)  # the last chunk, then b in the remaining budget
    assert s.is_prefill and s.scheduled == [(a, 4), (b, 3)]
    assert a.completion_token_ids == expected_completion(a, 1)
    assert list(sched.running) == [a, b] and not sched.waiting
    s = step(sched)
    assert not s.is_prefill and s.scheduled == [(a, 1), (b, 1)]


def test_a_prompt_with_cached_prefix_computes_only_the_rest():
    sched = make_scheduler(max_num_batched_tokens=8)
    add(sched, range(1, 11), max_tokens=1)
    run_to_end(sched)  # its blocks 0, 1, 2 are free but keep their content
    b = add(sched, list(range(1, 9)) + [40, 41, 42])
    s = step(sched)
    assert s.scheduled == [(b, 3)] and b.num_cached_tokens == 11
    assert b.block_table == [0, 1, 3]


# Pool of 4 blocks, 4 sequences running: decode preempts from the tail of running, the victim is
# re-prefilled later with its generated tokens (minus blocks still cached) and continues. Rows:
# is_prefill, [(name, num_cached_tokens, num_scheduled_tokens)], preempted, waiting, running,
# finished.
PREEMPTION_TRACE = [
    (True, [("a", 0, 4), ("b", 0, 4), ("c", 0, 4), ("d", 0, 2)], "", "", "abcd", ""),
    (False, [("a", 4, 1), ("b", 4, 1)], "cd", "cd", "ab", ""),  # a preempts d, then b preempts c
    (False, [("a", 5, 1), ("b", 5, 1)], "", "cd", "ab", ""),
    (False, [("a", 6, 1), ("b", 6, 1)], "", "cd", "ab", ""),
    (False, [("a", 7, 1), ("b", 7, 1)], "", "cd", "ab", ""),
    (False, [("a", 8, 1)], "b", "bcd", "", "a"),
    (True, [("b", 4, 5)], "", "cd", "", "b"),  # b's first block revived, its second reused
    (True, [("c", 0, 5), ("d", 0, 3)], "", "", "cd", ""),  # prompt + 1 generated; c's block reused
    (False, [("c", 5, 1), ("d", 3, 1)], "", "", "cd", ""),
    (False, [("c", 6, 1), ("d", 4, 1)], "", "", "cd", ""),
    (False, [("c", 7, 1), ("d", 5, 1)], "", "", "cd", ""),
    (False, [("c", 8, 1)], "d", "d", "", "c"),
    (True, [("d", 4, 3)], "", "", "", "d"),
]


def test_preemption_trace():
    sched = make_scheduler(num_blocks=4, max_num_seqs=4)
    seqs = {name: add(sched, range(4 * i + 1, 4 * i + 5)) for i, name in enumerate("abc")}
    seqs["d"] = add(sched, [13, 14])
    names = {id(seq): name for name, seq in seqs.items()}
    spell = lambda queue: "".join(names[id(seq)] for seq in queue)
    for row, expected in enumerate(PREEMPTION_TRACE):
        is_prefill, scheduled, preempted, waiting, running, finished = expected
        s = step(sched)
        got = [(names[id(seq)], cached, n)
               for (seq, n), cached in zip(s.scheduled, s.cached, strict=True)]
        assert (s.is_prefill, got) == (is_prefill, scheduled), row
        assert (spell(s.preempted), spell(sched.waiting), spell(sched.running),
                spell(s.finished)) == (preempted, waiting, running, finished), row
        if row == 1:
            for victim in (seqs["c"], seqs["d"]):
                assert victim.status == SequenceStatus.WAITING
                assert victim.block_table == [] and victim.num_cached_tokens == 0
                assert victim.completion_token_ids == expected_completion(victim, 1)
            assert seqs["a"].block_table == [0, 3] and seqs["b"].block_table == [1, 2]  # freed ones
    assert sched.is_finished()
    for seq in seqs.values():
        assert seq.completion_token_ids == expected_completion(seq, 6)
        assert seq.finish_reason == "length"


def test_preempted_sequences_finish_exactly_as_with_a_big_pool():
    prompts = [list(range(10 * i + 1, 10 * i + 1 + n)) for i, n in enumerate([3, 9, 5, 1, 7, 4])]
    outputs = []
    for num_blocks in (5, 64):
        sched = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=10)
        seqs = [add(sched, p, max_tokens=9) for p in prompts]
        steps = run_to_end(sched)
        assert any(s.preempted for s in steps) == (num_blocks == 5)
        outputs.append([seq.completion_token_ids for seq in seqs])
    assert outputs[0] == outputs[1] == [expected_completion(seq, 9) for seq in seqs]


def test_max_tokens_finishes_with_length_and_frees_blocks():
    sched = make_scheduler(num_blocks=8)
    a = add(sched, range(1, 6), max_tokens=3)
    b = add(sched, range(10, 15), max_tokens=5)
    steps = [step(sched) for _ in range(3)]
    assert [s.finished for s in steps] == [[], [], [a]]
    assert a.status == SequenceStatus.FINISHED and a.block_table == []
    assert list(sched.running) == [b]
    assert sched.block_manager.num_free_blocks == 8 - len(b.block_table)
    steps = run_to_end(sched)
    assert [s.finished for s in steps] == [[], [b]]
    assert a.finish_reason == b.finish_reason == "length"
    assert a.completion_token_ids == expected_completion(a, 3)
    assert a.status == b.status == SequenceStatus.FINISHED and a.block_table == b.block_table == []


def eos_at(position: int):
    return lambda seq: EOS if seq.num_tokens == position else fake_token(seq)


def test_eos_finishes_with_stop_and_frees_blocks():
    sched = make_scheduler(num_blocks=8)
    a = add(sched, range(1, 6), max_tokens=10)
    b = add(sched, range(10, 15), max_tokens=4)
    steps = run_to_end(sched, eos_at(7))  # both sample EOS as their third token
    assert [s.finished for s in steps] == [[], [], [a, b]]
    assert a.finish_reason == b.finish_reason == "stop"
    assert a.completion_token_ids == expected_completion(a, 2) + [EOS]


def test_eos_in_prefill_finishes_at_once():
    sched = make_scheduler(num_blocks=8)
    a = add(sched, range(1, 6))
    steps = run_to_end(sched, eos_at(5))
    assert len(steps) == 1 and steps[0].finished == [a]
    assert a.completion_token_ids == [EOS] and a.finish_reason == "stop"


def test_eos_on_the_last_allowed_token_is_stop():
    sched = make_scheduler(num_blocks=8)
    a = add(sched, range(1, 6), max_tokens=2)
    run_to_end(sched, eos_at(6))
    assert a.completion_token_ids == expected_completion(a, 1) + [EOS] and a.finish_reason == "stop"


def test_ignore_eos_keeps_going_to_max_tokens():
    sched = make_scheduler(num_blocks=8)
    a = add(sched, range(1, 6), max_tokens=4, ignore_eos=True)
    run_to_end(sched, lambda seq: EOS)
    assert a.completion_token_ids == [EOS] * 4 and a.finish_reason == "length"


def test_check_fits_rejects_a_request_beyond_max_model_len():
    sched = make_scheduler(max_model_len=16)
    sched.check_fits(10, 6)
    with pytest.raises(ValueError,
                       match=r"prompt length 10 \+ max_tokens 7 = 17 exceeds max_model_len=16"):
        sched.check_fits(10, 7)


def test_check_fits_rejects_a_request_needing_more_blocks_than_the_pool():
    sched = make_scheduler(num_blocks=4)
    message = r"needs 5 KV blocks of 4 tokens \(prompt 10 \+ max_tokens 8\) but the pool has only 4"
    with pytest.raises(ValueError, match=message):
        sched.check_fits(10, 8)


def test_a_request_using_the_whole_pool_runs_to_completion():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=4)
    a = add(sched, range(1, 11), max_tokens=7, ignore_eos=True)  # 16 tokens with KV: 4 blocks
    run_to_end(sched)
    assert a.completion_token_ids == expected_completion(a, 7)
