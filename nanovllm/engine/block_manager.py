"""The paged KV-cache pool: block allocation, reference counts and prefix reuse.

A full block's hash chains the previous block's (xxhash64), so equal hashes mean equal prefixes;
a block enters the hash table once its KV is computed, never at allocation.
"""

from collections import OrderedDict

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence

NO_HASH = -1


def block_hash(token_ids: list[int], prev_hash: int = NO_HASH) -> int:
    h = xxhash.xxh64()
    if prev_hash != NO_HASH:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "prev_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.prev_hash = NO_HASH
        self.token_ids: list[int] = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching  # False: no block is ever reused
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # Handed out from the front, freed to the back: a block just freed is reused last.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of `seq`, short of its last token."""
        hits = []
        if not self.enable_prefix_caching:
            return hits
        prev = NO_HASH
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block_tokens(i)
            h = block_hash(tokens, prev)
            block_id = self.hash_to_block_id.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.prev_hash != prev:  # a hash collision
                break
            hits.append(block_id)
            prev = h
        return hits

    def can_allocate(self, seq: Sequence, cached: list[int]) -> bool:
        """Room for `seq`'s blocks and for the copied last blocks of its pending forks."""
        # A hit on a free block (ref count 0) is revived out of the free list: it costs one.
        hits_in_use = sum(1 for b in cached if self.blocks[b].ref_count > 0)
        return seq.num_blocks - hits_in_use + self.fork_cost(seq) <= self.num_free_blocks

    def fork_cost(self, seq: Sequence) -> int:
        """Free blocks that forking `seq`'s pending samples takes: one per partial last block."""
        return len(seq.forks) if seq.num_tokens % self.block_size else 0

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """`child` shares `parent`'s blocks (ref counts + 1), all computed by the step scheduled
        now, but a partly filled last block, which the child is given a copy of (copy-on-write:
        the runner copies its KV after that step's forward). Returns whether it was copied."""
        assert not child.block_table and parent.num_tokens == child.num_tokens
        copied = parent.num_tokens % self.block_size != 0
        shared = parent.block_table[:-1] if copied else parent.block_table
        for block_id in shared:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(shared)
        if copied:
            child.block_table.append(self._take_free_block())
        child.num_cached_tokens = child.num_tokens
        return copied

    def allocate(self, seq: Sequence, cached: list[int]):
        """Give `seq` blocks for all its tokens, reusing the `cached` prefix blocks."""
        assert not seq.block_table
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = list(cached)
        seq.num_cached_tokens = len(cached) * self.block_size
        if seq.num_prefix_hit_tokens is None:  # not a preempted sequence's return
            seq.num_prefix_hit_tokens = seq.num_cached_tokens
        for _ in range(seq.num_blocks - len(cached)):
            seq.block_table.append(self._take_free_block())

    def deallocate(self, seq: Sequence):
        """Release `seq`'s blocks, last first; they keep their hash until handed out again."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_cached_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        return len(seq.block_table) >= seq.num_blocks or self.num_free_blocks > 0

    def may_append(self, seq: Sequence):
        if len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free_block())

    def can_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Room for `num_tokens` more KV slots past the decode step's (a draft's)."""
        needed = (seq.num_tokens + num_tokens + self.block_size - 1) // self.block_size
        return needed - len(seq.block_table) <= self.num_free_blocks

    def reserve(self, seq: Sequence, num_tokens: int):
        """Blocks for `num_tokens` more KV slots past the decode step's (after may_append)."""
        needed = (seq.num_tokens + num_tokens + self.block_size - 1) // self.block_size
        while len(seq.block_table) < needed:
            seq.block_table.append(self._take_free_block())

    def trim(self, seq: Sequence):
        """Free the blocks past what `seq`'s tokens need (a rejected draft's): never shared,
        never hashed."""
        while len(seq.block_table) > seq.num_blocks:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.hash == NO_HASH, block.block_id
            block.ref_count = 0
            self.free_block_ids[block.block_id] = None

    def register_computed_blocks(self, seq: Sequence, num_cached_before: int):
        """Hash the blocks of `seq` that became full and computed since `num_cached_before`."""
        if not self.enable_prefix_caching:
            return
        first = num_cached_before // self.block_size
        last = seq.num_cached_tokens // self.block_size
        for i in range(first, last):
            block = self.blocks[seq.block_table[i]]
            if block.hash != NO_HASH:  # a cache hit
                continue
            block.prev_hash = self.blocks[seq.block_table[i - 1]].hash if i > 0 else NO_HASH
            block.token_ids = seq.block_tokens(i)
            block.hash = block_hash(block.token_ids, block.prev_hash)
            self.hash_to_block_id[block.hash] = block.block_id

    def reset_prefix_cache(self):
        self.hash_to_block_id.clear()
        for block_id in self.free_block_ids:
            block = self.blocks[block_id]
            block.hash = block.prev_hash = NO_HASH
            block.token_ids = []

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash != NO_HASH and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.hash = block.prev_hash = NO_HASH
        block.token_ids = []
        block.ref_count = 1
        return block_id

    def check_integrity(self, live_seqs: list[Sequence]):
        """Assert the pool's invariants (ref counts, free list, hashes) against `live_seqs`."""
        holders = [0] * self.num_blocks
        for seq in live_seqs:
            for block_id in seq.block_table:
                holders[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == holders[block.block_id], (block.block_id, block.ref_count)
            assert (block.ref_count == 0) == (block.block_id in self.free_block_ids), block.block_id
        for h, block_id in self.hash_to_block_id.items():
            block = self.blocks[block_id]
            assert block.hash == h and len(block.token_ids) == self.block_size, block_id
