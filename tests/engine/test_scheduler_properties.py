"""Random workloads through Scheduler + BlockManager, with invariants checked after every step.

The fake model's token depends on (request, position) alone, and its KV slots hold the prefix they
encode, so reading a stale, foreign or missing slot fails. Workloads run synchronously and pipelined
(step N + 1 committed before step N is postprocessed)."""

import random
from collections import deque
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm.engine.block_manager import NO_HASH, block_hash
from nanovllm.engine.scheduler import CommittedStep, Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

EOS = 0


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    arrival: int  # added before this step (0: before the first)


@dataclass
class Workload:
    requests: list[Request]
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    vocab: int
    eos_rate: float
    seed: int

    def token(self, request: int, position: int) -> int:
        rng = random.Random(f"{self.seed}/{request}/{position}")
        return EOS if rng.random() < self.eos_rate else rng.randint(1, self.vocab)

    def expected_output(self, request: int) -> tuple[list[int], str]:
        req = self.requests[request]
        out = []
        while len(out) < req.max_tokens:
            out.append(self.token(request, len(req.prompt) + len(out)))
            if out[-1] == EOS and not req.ignore_eos:
                return out, "stop"
        return out, "length"


def blocks_needed(req: Request, block_size: int) -> int:
    """Blocks for every token whose KV is ever computed: all but the last sampled one."""
    return (len(req.prompt) + req.max_tokens - 1 + block_size - 1) // block_size


@st.composite
def workloads(draw) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    vocab = draw(st.integers(1, 40))  # small vocabularies make equal blocks (cache hits) common
    tokens = st.lists(st.integers(0, vocab), max_size=60)
    prefixes = draw(st.lists(st.lists(st.integers(0, vocab), min_size=1, max_size=40), max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        prompt = (draw(st.sampled_from([[], *prefixes])) + draw(tokens))[:60] or [1]
        requests.append(Request(prompt, max_tokens=draw(st.integers(1, 20)),
                                ignore_eos=draw(st.booleans()), arrival=draw(st.integers(0, 12))))
    max_model_len = draw(st.one_of(st.just(4096), st.integers(2, 80)))
    fitting = [req for req in requests if len(req.prompt) + req.max_tokens <= max_model_len]
    min_blocks = max((blocks_needed(req, block_size) for req in fitting), default=1)
    spare_blocks = draw(st.one_of(st.integers(0, 2), st.integers(0, 3 * min_blocks + 8)))
    return Workload(requests, block_size, num_blocks=min_blocks + spare_blocks,
                    max_num_seqs=draw(st.integers(1, 8)),
                    max_num_batched_tokens=draw(st.integers(1, 64)),
                    max_model_len=max_model_len, vocab=vocab,
                    eos_rate=draw(st.sampled_from([0.0, 0.1, 0.3])),
                    seed=draw(st.integers(0, 2**16)))


class FakeModel:
    def __init__(self, workload: Workload, scheduler: Scheduler):
        self.workload = workload
        self.bm = scheduler.block_manager
        self.request_of: dict[int, int] = {}  # seq_id -> request index
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (block id, offset) -> prefix
        self.prefixes: dict[int, list[tuple[int, ...]]] = {}  # seq_id -> token_ids[:p + 1]

    def true_token(self, seq: Sequence, position: int) -> int:
        request = self.request_of[seq.seq_id]
        prompt = self.workload.requests[request].prompt
        if position < len(prompt):
            return prompt[position]
        return self.workload.token(request, position)

    def prefix(self, seq: Sequence, position: int) -> tuple[int, ...]:
        prefixes = self.prefixes.setdefault(seq.seq_id, [])
        while len(prefixes) <= position:
            previous = prefixes[-1] if prefixes else ()
            prefixes.append((*previous, self.true_token(seq, len(prefixes))))
        return prefixes[position]

    def slot(self, seq: Sequence, position: int) -> tuple[int, int]:
        return seq.block_table[position // self.bm.block_size], position % self.bm.block_size

    def run(self, seqs: list[Sequence]) -> list[int]:
        """Write the KV of each scheduled chunk, check every slot the attention reads, sample."""
        for seq in seqs:
            end = seq.num_cached_tokens + seq.num_scheduled_tokens
            assert 0 < seq.num_scheduled_tokens and end <= seq.num_tokens
            assert len(seq.block_table) * self.bm.block_size >= end
            for position in range(seq.num_cached_tokens, end):
                block = self.bm.blocks[self.slot(seq, position)[0]]
                assert block.ref_count == 1 and block.hash == NO_HASH, "writing a shared block"
                self.slots[self.slot(seq, position)] = self.prefix(seq, position)
            read = [self.slots.get(self.slot(seq, position)) for position in range(end)]
            expected = [self.prefix(seq, position) for position in range(end)]
            assert read == expected, "attention reads stale KV"
        return [self.workload.token(self.request_of[seq.seq_id], seq.num_tokens)
                for seq in seqs if seq.completes_prefill]


class HashChains:
    """The chained hash of every full block of every sequence, recomputed from its tokens."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.chains: dict[int, list[int]] = {}  # seq_id -> hash of block i
        self.tokens_of: dict[int, list[int]] = {}  # hash -> the block's tokens

    def update(self, seq: Sequence) -> list[int]:
        chain = self.chains.setdefault(seq.seq_id, [])
        while (len(chain) + 1) * self.block_size <= seq.num_tokens - seq.num_inflight:
            tokens = seq.block_tokens(len(chain))
            chain.append(block_hash(tokens, chain[-1] if chain else NO_HASH))
            self.tokens_of[chain[-1]] = tokens
        return chain


def check_pool(scheduler: Scheduler, seqs: list[Sequence], chains: HashChains,
               launched: CommittedStep | None):
    """`launched`: a committed step not yet postprocessed, whose blocks need not be hashed yet."""
    bm = scheduler.block_manager
    in_flight = {}
    if launched:
        in_flight = dict(zip(map(id, launched.seqs), launched.num_cached_before))
    live = list(scheduler.waiting) + list(scheduler.running)
    bm.check_integrity(live)
    assert bm.num_free_blocks + sum(block.ref_count > 0 for block in bm.blocks) == bm.num_blocks
    for seq in seqs:
        chain = chains.update(seq)
        computed = min(in_flight.get(id(seq), seq.num_cached_tokens), seq.num_cached_tokens)
        for i in range(computed // bm.block_size):  # every full computed block is hashed
            block = bm.blocks[seq.block_table[i]]
            assert block.hash == chain[i], (seq.seq_id, i)
            assert block.token_ids == seq.block_tokens(i), (seq.seq_id, i)
    for h, block_id in bm.hash_to_block_id.items():
        assert bm.blocks[block_id].token_ids == chains.tokens_of[h], block_id


def check_step(scheduler: Scheduler, seqs: list[Sequence], is_prefill: bool, waiting: list,
               running: list):
    """`waiting` and `running` as they were before `schedule`."""
    assert len(seqs) <= scheduler.max_num_seqs and len(scheduler.running) <= scheduler.max_num_seqs
    if is_prefill:  # the head of waiting, in order; those that complete their prefill join running
        assert seqs == waiting[:len(seqs)]
        assert sum(seq.num_scheduled_tokens for seq in seqs) <= scheduler.max_num_batched_tokens
        done = [seq for seq in seqs if seq.completes_prefill]
        assert list(scheduler.running) == running + done
        assert list(scheduler.waiting) == waiting[len(done):]
        if len(done) < len(seqs):  # chunked: only a lone first sequence, cut at the budget
            assert len(seqs) == 1
            assert seqs[0].num_scheduled_tokens == scheduler.max_num_batched_tokens
    else:  # the head of running decodes, skipping finished ones; victims go to waiting's head
        assert len(seqs) <= min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
        assert all(seq.num_scheduled_tokens == 1 and seq.completes_prefill for seq in seqs)
        done = [seq.num_completion_tokens >= seq.max_tokens for seq in running]
        visited = next((i + 1 for i, seq in enumerate(running) if seqs and seq is seqs[-1]), 0)
        assert seqs == [seq for seq, d in zip(running[:visited], done[:visited]) if not d]
        rest = list(scheduler.running)[visited:]
        assert list(scheduler.running) == running[:visited + len(rest)]
        if rest and not all(done[visited:visited + len(rest)]):  # stopped by a budget
            assert len(seqs) == min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
        victims = running[visited + len(rest):]
        assert list(scheduler.waiting) == victims + waiting
        assert all(seq.status == SequenceStatus.WAITING and not seq.block_table for seq in victims)


def submit(workload: Workload, index: int, scheduler: Scheduler, model: FakeModel,
           accepted: dict[int, Sequence]):
    req = workload.requests[index]
    fits = len(req.prompt) + req.max_tokens <= workload.max_model_len
    try:
        scheduler.check_fits(len(req.prompt), req.max_tokens)
    except ValueError:
        assert not fits
        return
    assert fits
    params = SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=req.ignore_eos)
    seq = Sequence(req.prompt, params, workload.block_size)
    model.request_of[seq.seq_id] = index
    accepted[index] = seq
    scheduler.add(seq)


def run_workload(workload: Workload, pipelined: bool):
    scheduler = Scheduler(workload.max_num_seqs, workload.max_num_batched_tokens,
                          workload.max_model_len, workload.num_blocks, workload.block_size, {EOS})
    model = FakeModel(workload, scheduler)
    chains = HashChains(workload.block_size)
    accepted: dict[int, Sequence] = {}  # request index -> sequence
    arrivals = [req.arrival for req in workload.requests]
    pending = deque(sorted(range(len(workload.requests)), key=lambda i: arrivals[i]))
    max_steps = 50 * sum(len(req.prompt) + req.max_tokens for req in workload.requests)
    step = 0
    inflight = None  # (committed step, its tokens) not yet postprocessed
    while pending or not scheduler.is_finished() or inflight is not None:
        while pending and (workload.requests[pending[0]].arrival <= step or
                           (scheduler.is_finished() and inflight is None)):
            submit(workload, pending.popleft(), scheduler, model, accepted)
        if scheduler.is_finished() and inflight is None:
            continue
        assert step < max_steps, "a request starves"
        waiting, running = list(scheduler.waiting), list(scheduler.running)
        seqs, is_prefill = scheduler.schedule()
        assert seqs or inflight is not None, "nothing scheduled while requests are pending"
        launched = None
        if seqs:
            check_step(scheduler, seqs, is_prefill, waiting, running)
            tokens = model.run(seqs)
            launched = (scheduler.commit(seqs, is_prefill), tokens)
        if not pipelined:
            inflight, launched = launched, None
        if inflight is not None:
            for seq in scheduler.postprocess(*inflight):
                assert seq.status == SequenceStatus.FINISHED
                assert not seq.block_table and not seq.num_inflight
                assert seq not in scheduler.running
            check_pool(scheduler, list(accepted.values()), chains, launched and launched[0])
        inflight = launched
        step += 1

    for index, seq in accepted.items():
        got = (seq.completion_token_ids, seq.finish_reason)
        assert got == workload.expected_output(index), index
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(block.ref_count == 0 for block in bm.blocks)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.booleans())
def test_random_workloads_keep_the_pool_consistent_and_produce_the_model_tokens(workload,
                                                                                pipelined):
    run_workload(workload, pipelined)
