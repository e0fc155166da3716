"""Sequence's pickling for workers: only counts, the block table and this step's tokens."""

import pickle

from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


def round_trip(seq: Sequence) -> Sequence:
    return pickle.loads(pickle.dumps(seq))


def test_prefill_chunk_after_a_cached_prefix():
    params = SamplingParams(temperature=0.5, max_tokens=7, stop=["x"])
    seq = Sequence(list(range(100, 140)), params, 16)
    seq.block_table = [5, 2, 9]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 16, 20  # tokens 16..35 this step
    worker = round_trip(seq)
    assert (worker.seq_id, worker.num_tokens, worker.num_prompt_tokens,
            worker.block_size) == (seq.seq_id, 40, 40, 16)
    assert (worker.num_cached_tokens, worker.num_scheduled_tokens,
            worker.block_table) == (16, 20, [5, 2, 9])
    assert worker.scheduled_token_ids() == seq.scheduled_token_ids() == list(range(116, 136))
    assert worker.token_ids == list(range(116, 136))  # nothing else of the prompt travels
    assert not hasattr(worker, "sampling_params")


def test_decode_sends_only_the_last_token():
    seq = Sequence(list(range(1000)), SamplingParams(), 256)
    for token in (7, 8, 9):
        seq.append_token(token)
    seq.block_table = [3, 1, 4, 0]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 1002, 1
    worker = round_trip(seq)
    assert worker.scheduled_token_ids() == [9] and worker.token_ids == [9]
    assert (len(worker), worker.num_completion_tokens,
            worker.block_table) == (1003, 3, [3, 1, 4, 0])
    assert len(pickle.dumps(seq)) < 200  # independent of the 1,003 tokens held on rank 0


def test_re_prefill_after_preemption_sends_prompt_and_generated_tokens():
    seq = Sequence([1, 2, 3, 4, 5], SamplingParams(), 4)
    for token in (6, 7):
        seq.append_token(token)
    seq.block_table = [8, 6]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 0, 7  # preempted: everything is recomputed
    worker = round_trip(seq)
    assert worker.scheduled_token_ids() == [1, 2, 3, 4, 5, 6, 7]
    assert worker.num_prompt_tokens == 5 and len(worker) == 7
