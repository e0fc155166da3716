"""The step a worker receives: only counts, block tables and this step's tokens, no settings."""

import pickle

from nanovllm.engine.scheduler import scheduled_step
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from nanovllm.step import PLACEHOLDER, ScheduledStep


def round_trip(step: ScheduledStep) -> ScheduledStep:
    return pickle.loads(pickle.dumps(step))


def test_prefill_chunk_after_a_cached_prefix():
    params = SamplingParams(temperature=0.5, max_tokens=7, stop=["x"])
    seq = Sequence(list(range(100, 140)), params, 16)
    seq.block_table = [5, 2, 9]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 16, 20  # tokens 16..35 this step
    step = scheduled_step([seq], is_prefill=True)
    assert step.sampling is not None and step.sampling.requests == []  # the chunk samples nothing
    worker = round_trip(step)
    assert (worker.is_prefill, worker.seq_ids, worker.num_computed_tokens,
            worker.num_scheduled_tokens, worker.block_tables) == (True, [seq.seq_id], [16], [20],
                                                                  [[5, 2, 9]])
    assert worker.token_ids == seq.scheduled_token_ids() == list(range(116, 136))
    assert worker.samples == [False] and worker.forks == {}
    assert worker.sampling is None


def test_decode_sends_only_the_last_token():
    seq = Sequence(list(range(1000)), SamplingParams(), 256)
    for token in (7, 8, 9):
        seq.append_token(token)
    seq.append_placeholder()
    seq.block_table = [3, 1, 4, 0]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 1003, 1
    step = scheduled_step([seq], is_prefill=False)
    assert step.sampling.positions == [1004]
    worker = round_trip(step)
    assert worker.token_ids == [PLACEHOLDER] and worker.num_computed_tokens == [1003]
    assert worker.block_tables == [[3, 1, 4, 0]] and worker.sampling is None
    assert len(pickle.dumps(step)) < 200  # independent of the 1,004 tokens held on rank 0


def test_re_prefill_after_preemption_sends_prompt_and_generated_tokens():
    seq = Sequence([1, 2, 3, 4, 5], SamplingParams(), 4)
    for token in (6, 7):
        seq.append_token(token)
    seq.block_table = [8, 6]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 0, 7  # preempted: everything is recomputed
    worker = round_trip(scheduled_step([seq], is_prefill=True))
    assert worker.token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert worker.num_scheduled_tokens == [7] and worker.samples == [True]


def test_forks_name_the_row_of_their_prompt():
    """Each fork of an n-sample prompt samples from, and copies the last block of, its prompt's
    row; the sampling rows are the prompts and their forks, in row order."""
    params = SamplingParams(n=3, seed=5, min_tokens=1, stop_token_ids=[9])
    a, b = Sequence([1, 2, 3], SamplingParams(), 4), Sequence([4, 5, 6, 7, 8], params, 4, {0})
    seqs = [a, *b.make_samples()]
    for seq, table in zip(seqs, ([1], [2, 3], [2, 4], [2, 5])):
        seq.block_table = table
    a.num_scheduled_tokens = 3
    b.num_scheduled_tokens = 5
    for fork in seqs[2:]:
        fork.num_cached_tokens = fork.num_tokens
    step = scheduled_step(seqs, is_prefill=True)
    assert step.forks == {2: 1, 3: 1} and step.samples == [True] * 4
    assert step.sampled_seq_ids == [seq.seq_id for seq in seqs]
    assert [r.params.seed for r in step.sampling.requests] == [None, 5, 6, 7]
    assert step.sampling.positions == [3, 5, 5, 5]
    assert step.sampling.suppressed == {1: (0, 9), 2: (0, 9), 3: (0, 9)}  # EOS and the stop id
