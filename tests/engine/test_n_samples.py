"""SamplingParams.n: the prompt is prefilled once, its n samples share its KV blocks (a partial last
block copied on write), each draws from its own random stream."""

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from tests.conftest import hf_greedy
from tests.engine.test_generate import PreemptionCounter

pytestmark = pytest.mark.cpu_suite

NUM_TOKENS = 10
GREEDY = SamplingParams(n=4, temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def fork_prompts(prompts) -> list[list[int]]:
    # 17 tokens: a partial last block of 16 (copied on fork); 32: two full blocks (shared).
    return [prompts[2], prompts[0] + prompts[1], prompts[5][:32]]


@pytest.fixture(scope="module")
def hf_fork_reference(tiny_model, fork_prompts) -> list[list[int]]:
    return [hf_greedy(tiny_model, p, NUM_TOKENS) for p in fork_prompts]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256) as llm:
        yield llm


def pool_is_empty(llm) -> bool:
    bm = llm.llm_engine.scheduler.block_manager
    bm.check_integrity([])
    return bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 7}, {"max_num_seqs": 5}])
def test_greedy_samples_match_transformers_prefilled_once(tiny_model, fork_prompts,
                                                          hf_fork_reference, options):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256,
             **options) as llm:
        outputs = llm.generate(fork_prompts, GREEDY, use_tqdm=False)
        assert llm.llm_engine.num_prefilled_tokens == sum(len(p) for p in fork_prompts)
        assert pool_is_empty(llm)
    assert [[o.token_ids for o in samples.outputs] for samples in outputs] == [
        [expected] * 4 for expected in hf_fork_reference]


def test_n_samples_under_preemption(tiny_model, fork_prompts, hf_fork_reference):
    # 3 prompts x 3 samples of up to 4 blocks each cannot all fit in 9 blocks.
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=9, max_model_len=256) as llm:
        counter = PreemptionCounter(llm.llm_engine.scheduler)
        params = SamplingParams(n=3, temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outputs = llm.generate(fork_prompts, params, use_tqdm=False)
        assert pool_is_empty(llm)
        with pytest.raises(ValueError, match="need 10 KV blocks to fork but the pool has only 9"):
            llm.generate(fork_prompts[0], SamplingParams(n=9, max_tokens=2), use_tqdm=False)
    assert counter.count > 0
    assert [[o.token_ids for o in samples.outputs] for samples in outputs] == [
        [expected] * 3 for expected in hf_fork_reference]


def test_seeded_sample_i_is_the_request_with_seed_plus_i_in_any_batch(llm, fork_prompts):
    params = SamplingParams(n=4, temperature=1.0, seed=77, max_tokens=8, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(fork_prompts[0], params, use_tqdm=False)[0].outputs]
    other = SamplingParams(n=2, temperature=0.7, max_tokens=5)
    mixed = llm.generate(fork_prompts, [other, params, params], use_tqdm=False)
    # Prompt 1 is another prompt: the same seeds draw other tokens there.
    assert [o.token_ids for o in mixed[1].outputs] != alone
    reordered = llm.generate([fork_prompts[1], fork_prompts[0]], [other, params], use_tqdm=False)
    assert [o.token_ids for o in reordered[1].outputs] == alone
    singles = [SamplingParams(temperature=1.0, seed=77 + i, max_tokens=8, ignore_eos=True)
               for i in range(4)]
    one_each = llm.generate([fork_prompts[0]] * 4, singles, use_tqdm=False)
    assert [o["token_ids"] for o in one_each] == alone
    assert len({tuple(tokens) for tokens in alone}) > 1  # four streams, not one
    assert pool_is_empty(llm)


def test_output_shape(llm, fork_prompts):
    one = SamplingParams(temperature=0, max_tokens=3)
    two = SamplingParams(n=2, temperature=0, max_tokens=3)
    outputs = llm.generate(fork_prompts[:2], [one, two], use_tqdm=False)
    assert [len(o.outputs) for o in outputs] == [1, 2]
    assert [c.index for c in outputs[1].outputs] == [0, 1]
    assert [c.token_ids for c in outputs[1].outputs] == [outputs[1]["token_ids"]] * 2
    streamed = {}
    for out in llm.stream(fork_prompts[:2], [one, two]):
        streamed.setdefault((out.index, out.sample), []).extend(out.token_ids)
    assert sorted(streamed) == [(0, 0), (1, 0), (1, 1)]
    assert streamed[(1, 1)] == outputs[1].outputs[1].token_ids


def test_abort_before_and_after_the_fork(llm, fork_prompts):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=20, ignore_eos=True)
    seqs = llm.llm_engine.add(llm.make_requests([fork_prompts[0]], params))
    llm.llm_engine.abort(seqs[:1])  # before any step: its pending samples end with it
    assert [s.finish_reason for s in seqs] == ["abort"] * 3 and llm.is_finished()
    stream = llm.stream(fork_prompts, params)
    for _ in range(4):
        next(stream)
    assert any(len(seq.block_table) for seq in llm.llm_engine.scheduler.running)
    stream.close()  # forked samples in flight, and pending ones, all end
    assert llm.is_finished() and pool_is_empty(llm)
    seqs = llm.llm_engine.add(llm.make_requests([fork_prompts[0]], params))
    llm.llm_engine.abort(seqs[2:])  # a pending sample alone: the others run on
    outputs = llm.generate(fork_prompts[1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert outputs[0]["finish_reason"] == "length"
    while not all(seq.is_finished for seq in seqs[:2]):
        llm.step()
    assert [seq.num_output_tokens for seq in seqs] == [20, 20, 0] and pool_is_empty(llm)


def test_fork_blocks_exactly():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = Sequence(list(range(10)), SamplingParams(n=3), 4)
    first, second = parent.make_samples()[1:]
    assert bm.can_allocate(parent, []) and bm.fork_cost(parent) == 2
    bm.allocate(parent, [])
    assert parent.block_table == [0, 1, 2]
    assert bm.fork(parent, first) and bm.fork(parent, second)
    assert first.block_table == [0, 1, 3] and second.block_table == [0, 1, 4]
    assert [bm.blocks[i].ref_count for i in range(5)] == [3, 3, 1, 1, 1]
    assert first.num_cached_tokens == 10
    bm.check_integrity([parent, first, second])
    full = Sequence(list(range(8)), SamplingParams(n=2), 4)
    (child,) = full.make_samples()[1:]
    assert bm.fork_cost(full) == 0
    bm.allocate(full, [])
    assert not bm.fork(full, child) and child.block_table == full.block_table == [5, 6]
    for seq in (parent, first, second, full, child):
        bm.deallocate(seq)
    bm.check_integrity([])
    assert bm.num_free_blocks == 8


def test_n_is_validated(llm, fork_prompts):
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        SamplingParams(n=0)
    with pytest.raises(TypeError, match="n must be an int"):
        SamplingParams(n=2.0)
    with pytest.raises(ValueError, match="prompt 0: n=600 samples exceed max_num_seqs=512"):
        llm.generate(fork_prompts[0], SamplingParams(n=600), use_tqdm=False)
