"""BlockManager: exact block ids, reference counts, free order and prefix reuse.

Sequences go through the scheduler's workflow: `cached_prefix` -> `can_allocate` -> `allocate`, then
after a step computed tokens, `num_cached_tokens += n` and `register_computed_blocks`.
"""

import pytest

from nanovllm.engine import block_manager as bm_module
from nanovllm.engine.block_manager import NO_HASH, BlockManager, block_hash
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_seq(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams(temperature=0, max_tokens=16), BLOCK_SIZE)


def check(bm: BlockManager, live: list[Sequence]):
    bm.check_integrity(live)
    used = sum(block.ref_count > 0 for block in bm.blocks)
    assert bm.num_free_blocks + used == bm.num_blocks


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    cached = bm.cached_prefix(seq)
    assert bm.can_allocate(seq, cached)
    bm.allocate(seq, cached)
    return cached


def compute(bm: BlockManager, seq: Sequence, num_tokens: int | None = None):
    """Mark `num_tokens` more tokens (default: all the rest) as computed, as postprocess does."""
    before = seq.num_cached_tokens
    seq.num_cached_tokens += seq.num_tokens - before if num_tokens is None else num_tokens
    bm.register_computed_blocks(seq, before)


def pool_with_computed(num_blocks: int, tokens) -> tuple[BlockManager, Sequence]:
    """A pool of num_blocks holding one admitted sequence of `tokens`, all of them computed."""
    bm = BlockManager(num_blocks, BLOCK_SIZE)
    seq = make_seq(tokens)
    admit(bm, seq)
    compute(bm, seq)
    return bm, seq


def ref_counts(bm: BlockManager) -> list[int]:
    return [block.ref_count for block in bm.blocks]


def test_allocate_takes_lowest_ids_and_deallocate_frees_last_block_first():
    bm = BlockManager(6, BLOCK_SIZE)
    seq = make_seq(range(1, 10))
    assert admit(bm, seq) == []
    assert seq.block_table == [0, 1, 2]
    assert seq.num_cached_tokens == 0
    assert ref_counts(bm) == [1, 1, 1, 0, 0, 0]
    assert list(bm.free_block_ids) == [3, 4, 5]
    check(bm, [seq])

    compute(bm, seq)
    bm.deallocate(seq)
    assert seq.block_table == [] and seq.num_cached_tokens == 0
    assert list(bm.free_block_ids) == [3, 4, 5, 2, 1, 0]
    assert ref_counts(bm) == [0] * 6
    check(bm, [])


def test_freed_blocks_keep_their_hash_until_reused():
    bm, seq = pool_with_computed(4, range(1, 10))
    full_hashes = {bm.blocks[0].hash: 0, bm.blocks[1].hash: 1}
    assert bm.hash_to_block_id == full_hashes  # the partial third block is never hashed
    bm.deallocate(seq)
    assert bm.hash_to_block_id == full_hashes
    assert bm.blocks[0].token_ids == [1, 2, 3, 4] and bm.blocks[1].token_ids == [5, 6, 7, 8]
    check(bm, [])


def test_decode_appends_a_block_exactly_when_the_last_token_starts_one():
    bm, seq = pool_with_computed(4, range(1, 5))
    assert seq.block_table == [0]
    for token in range(100, 109):  # decode: sample a token, then the next step computes it
        seq.append_token(token)
        had = len(seq.block_table)
        assert bm.can_append(seq)
        bm.may_append(seq)
        assert len(seq.block_table) - had == (seq.num_tokens % BLOCK_SIZE == 1)
        compute(bm, seq, 1)
        check(bm, [seq])
    assert seq.num_tokens == 13 and seq.block_table == [0, 1, 2, 3]
    assert [bm.blocks[i].hash != NO_HASH for i in range(4)] == [True, True, True, False]


def test_can_append_needs_a_free_block_only_when_a_block_starts():
    bm, seq = pool_with_computed(1, range(1, 4))
    seq.append_token(9)  # 4 tokens: still fits in block 0
    assert bm.can_append(seq)
    bm.may_append(seq)
    compute(bm, seq, 1)
    seq.append_token(10)  # 5 tokens: needs a second block, the pool has none
    assert not bm.can_append(seq)


def test_prefix_hit_revives_blocks_of_a_finished_request():
    bm, first = pool_with_computed(8, range(1, 11))
    bm.deallocate(first)
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7, 2, 1, 0]

    second = make_seq(list(range(1, 9)) + [99, 98, 97])
    assert admit(bm, second) == [0, 1]
    assert second.block_table == [0, 1, 3]
    assert second.num_cached_tokens == 8
    assert ref_counts(bm)[:4] == [1, 1, 0, 1]
    assert list(bm.free_block_ids) == [4, 5, 6, 7, 2]
    check(bm, [second])


def test_prefix_hit_shares_blocks_of_a_live_request():
    bm, first = pool_with_computed(8, range(1, 11))
    second = make_seq(list(range(1, 9)) + [99])
    assert admit(bm, second) == [0, 1]
    assert second.block_table == [0, 1, 3]
    assert ref_counts(bm)[:4] == [2, 2, 1, 1]
    check(bm, [first, second])

    bm.deallocate(first)
    assert ref_counts(bm)[:4] == [1, 1, 0, 1]
    assert list(bm.free_block_ids) == [4, 5, 6, 7, 2]
    check(bm, [second])
    bm.deallocate(second)
    assert list(bm.free_block_ids) == [4, 5, 6, 7, 2, 3, 1, 0]
    check(bm, [])


@pytest.mark.parametrize("num_tokens, expected_hits", [(4, []), (8, [0]), (12, [0, 1])])
def test_a_fully_cached_prompt_still_computes_its_last_block(num_tokens, expected_hits):
    bm, first = pool_with_computed(8, range(1, num_tokens + 1))
    assert len(bm.hash_to_block_id) == num_tokens // BLOCK_SIZE
    second = make_seq(range(1, num_tokens + 1))
    assert admit(bm, second) == expected_hits
    assert second.num_cached_tokens == num_tokens - BLOCK_SIZE
    assert len(second.block_table) == second.num_blocks
    check(bm, [first, second])


def test_blocks_enter_the_hash_table_only_once_computed():
    bm = BlockManager(8, BLOCK_SIZE)
    prompt = list(range(1, 10))
    first, second = make_seq(prompt), make_seq(prompt)
    admit(bm, first)
    assert bm.hash_to_block_id == {}
    assert admit(bm, second) == []  # first's KV is not written yet
    assert second.block_table == [3, 4, 5]
    check(bm, [first, second])

    compute(bm, first, 5)  # a chunk: only block 0 is full and computed
    assert bm.hash_to_block_id == {bm.blocks[0].hash: 0}
    assert bm.cached_prefix(make_seq(prompt)) == [0]
    compute(bm, first)
    assert bm.cached_prefix(make_seq(prompt)) == [0, 1]
    check(bm, [first, second])


def test_chained_hash_depends_on_the_prefix():
    bm, first = pool_with_computed(8, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.blocks[1].hash == block_hash([5, 6, 7, 8], block_hash([1, 2, 3, 4]))
    assert bm.cached_prefix(make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9])) == []  # other prefix


def test_a_reused_block_no_longer_answers_its_old_hash():
    bm, first = pool_with_computed(3, range(1, 10))
    old_hash = bm.blocks[1].hash
    bm.deallocate(first)
    assert list(bm.free_block_ids) == [2, 1, 0]

    other = make_seq(range(50, 58))
    admit(bm, other)
    assert other.block_table == [2, 1]
    assert old_hash not in bm.hash_to_block_id
    assert bm.blocks[1].hash == NO_HASH and bm.blocks[1].token_ids == []
    check(bm, [other])
    compute(bm, other)
    assert bm.cached_prefix(make_seq(range(1, 10))) == [0]  # block 1 now holds other's tokens
    check(bm, [other])


@pytest.fixture
def colliding_bm(monkeypatch) -> BlockManager:
    """A pool in which every block hashes to 42: any two blocks collide."""
    monkeypatch.setattr(bm_module, "block_hash", lambda token_ids, prev_hash=NO_HASH: 42)
    return BlockManager(8, BLOCK_SIZE)


def test_hash_collision_with_different_tokens_is_refused(colliding_bm):
    bm = colliding_bm
    first = make_seq([1, 2, 3, 4, 5])
    admit(bm, first)
    compute(bm, first)
    assert bm.hash_to_block_id == {42: 0}
    assert bm.cached_prefix(make_seq([9, 9, 9, 9, 5])) == []
    assert bm.cached_prefix(make_seq([1, 2, 3, 4, 6])) == [0]
    check(bm, [first])


def test_hash_collision_with_equal_tokens_after_another_prefix_is_refused(colliding_bm):
    # With every hash equal, block 0 ([1, 1, 1, 1] at the start) must not also answer for the second
    # block of [1]*8: same tokens, but after a different prefix.
    bm = colliding_bm
    first = make_seq([1, 1, 1, 1, 5])
    admit(bm, first)
    compute(bm, first)
    probe = make_seq([1] * 8 + [2])
    assert bm.cached_prefix(probe) == [0]
    admit(bm, probe)
    assert probe.block_table[0] == 0 and bm.blocks[0].ref_count == 2
    check(bm, [first, probe])


def test_planted_hash_entry_with_other_tokens_is_refused():
    bm, first = pool_with_computed(8, [1, 2, 3, 4, 5])
    bm.hash_to_block_id[block_hash([7, 7, 7, 7])] = 0  # block 0 holds [1, 2, 3, 4]
    assert bm.cached_prefix(make_seq([7, 7, 7, 7, 5])) == []


def test_can_allocate_counts_hits_on_blocks_in_use_as_free():
    bm, first = pool_with_computed(4, range(1, 10))
    assert bm.num_free_blocks == 1
    sharing = make_seq(list(range(1, 9)) + [99])  # 3 blocks, 2 of them hits in use
    assert bm.can_allocate(sharing, bm.cached_prefix(sharing))
    unrelated = make_seq(range(50, 59))
    assert not bm.can_allocate(unrelated, bm.cached_prefix(unrelated))
    admit(bm, sharing)
    assert sharing.block_table == [0, 1, 3] and bm.num_free_blocks == 0
    check(bm, [first, sharing])


def test_can_allocate_counts_hits_on_free_blocks_as_used():
    bm, first = pool_with_computed(4, range(1, 10))
    bm.deallocate(first)
    filler = make_seq([50])
    admit(bm, filler)  # takes block 3
    reviving = make_seq(list(range(1, 9)) + [99])  # hits free blocks 0 and 1, needs one more
    assert bm.can_allocate(reviving, bm.cached_prefix(reviving))
    other_filler = make_seq([60])
    admit(bm, other_filler)  # takes block 2: two free blocks left, three needed
    assert list(bm.free_block_ids) == [1, 0]
    assert bm.cached_prefix(reviving) == [0, 1]
    assert not bm.can_allocate(reviving, [0, 1])
    check(bm, [filler, other_filler])


def corrupt_ref_count(bm, seq):
    bm.blocks[seq.block_table[0]].ref_count += 1


def corrupt_free_a_held_block(bm, seq):
    bm.free_block_ids[seq.block_table[0]] = None


def corrupt_leak_a_free_block(bm, seq):
    del bm.free_block_ids[next(iter(bm.free_block_ids))]


def corrupt_hash_entry(bm, seq):
    bm.hash_to_block_id[12345] = seq.block_table[0]


def corrupt_hash_of_partial_block(bm, seq):
    block = bm.blocks[seq.block_table[-1]]
    block.hash = block_hash(block.token_ids)
    bm.hash_to_block_id[block.hash] = block.block_id


@pytest.mark.parametrize("corrupt", [corrupt_ref_count, corrupt_free_a_held_block,
                                     corrupt_leak_a_free_block, corrupt_hash_entry,
                                     corrupt_hash_of_partial_block])
def test_check_integrity_detects_corruption(corrupt):
    bm, seq = pool_with_computed(6, range(1, 10))
    check(bm, [seq])
    corrupt(bm, seq)
    with pytest.raises(AssertionError):
        bm.check_integrity([seq])


def test_check_integrity_detects_a_missing_holder():
    bm = BlockManager(6, BLOCK_SIZE)
    seqs = [make_seq(range(1, 10)), make_seq([1])]
    for seq in seqs:
        admit(bm, seq)
    check(bm, seqs)
    with pytest.raises(AssertionError):
        bm.check_integrity(seqs[:1])


def test_reset_prefix_cache_forgets_free_and_live_blocks():
    bm, live = pool_with_computed(8, range(1, 10))  # blocks 0, 1 full and hashed, 2 partial
    finished = make_seq(range(20, 29))
    admit(bm, finished)
    compute(bm, finished)
    bm.deallocate(finished)  # blocks 3, 4 hashed and free
    assert len(bm.hash_to_block_id) == 4
    bm.reset_prefix_cache()
    assert bm.hash_to_block_id == {}
    assert [bm.blocks[i].hash == NO_HASH for i in range(5)] == [False, False, True, True, True]
    assert bm.blocks[3].token_ids == [] and bm.blocks[1].token_ids == [5, 6, 7, 8]  # live: kept
    assert bm.cached_prefix(make_seq(range(1, 10))) == []
    assert bm.cached_prefix(make_seq(range(20, 29))) == []
    check(bm, [live])
    # A live block computed again is not re-registered: freed and reused, it leaves no stale entry.
    compute(bm, live, 0)
    assert bm.hash_to_block_id == {}
    bm.deallocate(live)
    again = make_seq(range(1, 10))
    assert admit(bm, again) == []
    compute(bm, again)
    assert sorted(bm.hash_to_block_id.values()) == sorted(again.block_table[:2])
    check(bm, [again])
