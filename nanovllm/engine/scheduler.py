"""Decides which sequences run in each step: all prefill, or all decode. Plain Python over ints.
`schedule` picks a step, `commit` records its launch, `postprocess` takes its tokens."""

from collections import deque
from dataclasses import dataclass

import numpy as np

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.step import PromptLogprobRows, ScheduledStep, StepSampling


@dataclass
class CommittedStep:
    seqs: list[Sequence]
    is_prefill: bool
    sampled: list[Sequence]  # the sequences that get a token from this step, in row order
    num_cached_before: list[int]
    num_tokens: int
    # Per sampled sequence, the draft its rows verify ([]: one row); rows follow in this order.
    drafts: list[list[int]]


def scheduled_step(seqs: list[Sequence], is_prefill: bool) -> ScheduledStep:
    """The step the runner is handed for `seqs` as scheduled (before `commit`), by rows."""
    if not is_prefill:
        return decode_step(seqs)
    step = ScheduledStep(True)
    prompt_row = -1
    for row, seq in enumerate(seqs):
        step.seq_ids.append(seq.seq_id)
        step.token_ids += seq.scheduled_token_ids()
        step.num_scheduled_tokens.append(seq.num_scheduled_tokens)
        step.num_computed_tokens.append(seq.num_cached_tokens)
        step.block_tables.append(seq.block_table)
        step.samples.append(seq.completes_prefill)
        if seq.num_scheduled_tokens:
            prompt_row = row
            if seq.sampling_params.prompt_logprobs is not None:
                rows = prompt_logprob_rows(seq)
                if rows is not None:
                    step.prompt_logprobs[row] = rows
        else:  # _fork puts a prompt's forks right after it
            step.forks[row] = prompt_row
    step.sampling = step_sampling([seq for seq in seqs if seq.completes_prefill])
    step.masked = bool(step.sampling.grammar_rows)
    return step


def decode_step(seqs: list[Sequence]) -> ScheduledStep:
    """A decode row computes a sequence's last token (maybe in flight) and samples the next. A
    sequence with a draft of d tokens has 1 + d rows, all in the decode graphs' shape: row i
    computes the token at position num_cached_tokens + i (the last token, then the draft's) over
    the KV before it, written by rows < i of the same layer, and samples what follows."""
    if not any(seq.draft for seq in seqs):  # a row a sequence, by comprehensions: the hot path
        n = len(seqs)
        sampling = step_sampling(seqs)
        return ScheduledStep(False, [seq.seq_id for seq in seqs],
                             [seq.token_ids[-1] for seq in seqs], [1] * n,
                             [seq.num_cached_tokens for seq in seqs],
                             [seq.block_table for seq in seqs], [True] * n, {}, sampling,
                             masked=bool(sampling.grammar_rows))
    step = ScheduledStep(False, verify=True)
    for seq in seqs:
        table = seq.block_table
        step.token_ids.append(seq.token_ids[-1])
        step.token_ids += seq.draft
        for i in range(1 + len(seq.draft)):
            step.seq_ids.append(seq.seq_id)
            step.num_computed_tokens.append(seq.num_cached_tokens + i)
            step.block_tables.append(table)
    rows = len(step.seq_ids)
    step.num_scheduled_tokens, step.samples = [1] * rows, [True] * rows
    step.sampling = step_sampling(seqs, [seq.draft for seq in seqs])
    step.masked = bool(step.sampling.grammar_rows)
    return step


def prompt_logprob_rows(seq: Sequence) -> PromptLogprobRows | None:
    """The prompt logprobs the scheduled chunk of `seq` computes: position p predicts prompt token
    p + 1, for the positions it has none for yet (a re-prefill after preemption repeats none)."""
    start = seq.num_cached_tokens
    first = max(start, len(seq.prompt_logprobs))
    last = min(start + seq.num_scheduled_tokens, seq.num_prompt_tokens - 1)
    if last <= first:
        return None
    return PromptLogprobRows(first - start, seq.token_ids[first + 1:last + 1],
                             seq.sampling_params.prompt_logprobs)


def step_sampling(sampled: list[Sequence], drafts: list[list[int]] | None = None) -> StepSampling:
    """The sampling settings of the sequences that get a token, a row each (1 + d rows with a
    draft of d tokens: row i samples after the draft's first i), in row order; updates their
    token histories (penalties). The rows with a grammar are listed; their masks wait for the
    tokens in flight (LLMEngine fills them)."""
    if drafts is None or not any(drafts):  # a row a sequence, by comprehensions: the hot path
        return StepSampling(
            [seq.sampling for seq in sampled], [seq.num_tokens for seq in sampled],
            {row: ids for row, seq in enumerate(sampled)
             if seq.sampling.stop_ids and (ids := seq.suppressed_stop_ids)},
            {row: seq.token_array() for row, seq in enumerate(sampled)
             if seq.sampling.uses_penalties},
            [row for row, seq in enumerate(sampled) if seq.grammar is not None])
    sampling = StepSampling([], [])
    for seq, draft in zip(sampled, drafts, strict=True):
        history = seq.token_array() if seq.sampling.uses_penalties else None
        for i in range(1 + len(draft)):
            row = len(sampling.requests)
            sampling.requests.append(seq.sampling)
            sampling.positions.append(seq.num_tokens + i)
            if seq.sampling.stop_ids and (ids := seq.suppressed_stop_ids_after(i)):
                sampling.suppressed[row] = ids
            if history is not None:
                sampling.histories[row] = np.concatenate([history, draft[:i]]).astype(np.int64)
            if seq.grammar is not None:  # a sequence with a grammar never drafts
                sampling.grammar_rows.append(row)
    return sampling


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int, block_size: int,
               num_blocks: int, n: int = 1):
    """Raise ValueError if a request of this size (n samples) could never be scheduled."""
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise ValueError(f"prompt length {num_prompt_tokens} + max_tokens {max_tokens} = "
                         f"{total} exceeds max_model_len={max_model_len}")
    # The last sampled token is never fed back, so its KV never needs a slot.
    blocks = (total - 1 + block_size - 1) // block_size
    if blocks > num_blocks:
        raise ValueError(f"request needs {blocks} KV blocks of {block_size} tokens (prompt "
                         f"{num_prompt_tokens} + max_tokens {max_tokens}) but the pool has "
                         f"only {num_blocks}")
    # Forking copies a partial last prompt block for each sample but the first.
    prompt_blocks = (num_prompt_tokens + block_size - 1) // block_size
    copies = n - 1 if num_prompt_tokens % block_size else 0
    if prompt_blocks + copies > num_blocks:
        raise ValueError(f"n={n} samples of a {num_prompt_tokens}-token prompt need "
                         f"{prompt_blocks + copies} KV blocks to fork but the pool has only "
                         f"{num_blocks}")


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 num_blocks: int, block_size: int, eos_token_ids: set[int],
                 enable_prefix_caching: bool = True, max_draft_batch: int | None = None):
        self.max_num_seqs = max_num_seqs
        # A decode step of more sequences verifies no draft (SpeculativeConfig).
        self.max_draft_batch = max_num_seqs if max_draft_batch is None else max_draft_batch
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int = 1):
        """Raise ValueError if a request of this size could never be scheduled."""
        if n > self.max_num_seqs:
            raise ValueError(f"n={n} samples exceed max_num_seqs={self.max_num_seqs}")
        bm = self.block_manager
        check_fits(num_prompt_tokens, max_tokens, self.max_model_len, bm.block_size, bm.num_blocks,
                   n)

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        seqs = self._schedule_prefill()
        if seqs:
            return seqs, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) + 1 + len(seq.forks) > self.max_num_seqs:  # a seat per sample
                break
            if not seq.block_table:
                # Prompt logprobs need every prompt position's logits: no cached prefix.
                wants_all = seq.sampling_params.prompt_logprobs is not None
                cached = [] if wants_all else bm.cached_prefix(seq)
                uncached = seq.num_tokens - len(cached) * bm.block_size
                # Only the first may be chunked: one partly prefilled sequence, at waiting's head.
                if scheduled and uncached > budget:
                    break
                if not bm.can_allocate(seq, cached):
                    break
                bm.allocate(seq, cached)
            chunk = min(seq.num_tokens - seq.num_cached_tokens, budget)
            seq.num_scheduled_tokens = chunk
            budget -= chunk
            scheduled.append(seq)
            if not seq.completes_prefill:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled += self._fork(seq)
        return scheduled

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Start `parent`'s pending samples in this step, sampling from its prompt's last row."""
        forks, parent.forks = parent.forks, []
        for child in forks:
            child.parent = None
            self.block_manager.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        return forks

    def _schedule_decode(self) -> list[Sequence]:
        # A chunked prefill always runs next, so preempted sequences may go to waiting's head.
        assert not (self.waiting and self.waiting[0].block_table)
        scheduled: list[Sequence] = []
        visited: list[Sequence] = []
        bm = self.block_manager
        while self.running and len(scheduled) < min(self.max_num_seqs, self.max_num_batched_tokens):
            seq = self.running.popleft()
            if seq.num_completion_tokens >= seq.max_tokens:  # ends once its in-flight tokens return
                visited.append(seq)
                continue
            while not bm.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                bm.may_append(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
                visited.append(seq)
        self.running.extendleft(reversed(visited))
        self._take_drafts(scheduled)
        return scheduled

    def _take_drafts(self, scheduled: list[Sequence]):
        """Give the scheduled sequences their drafts (speculation; none in a step of more than
        max_draft_batch sequences), each cut to the rows left under the step's limit, the
        sequence's max_tokens and max_model_len, and the free blocks (a draft never preempts);
        a sequence with a token in flight drafts nothing (its draft was proposed before it)."""
        rows_left = min(self.max_num_seqs, self.max_num_batched_tokens) - len(scheduled)
        bm = self.block_manager
        drafting = len(scheduled) <= self.max_draft_batch
        for seq in scheduled:
            draft = seq.draft if drafting and not seq.num_inflight else []
            limit = min(rows_left, seq.max_tokens - seq.num_completion_tokens - 1,
                        self.max_model_len - seq.num_tokens)
            draft = draft[:max(limit, 0)]
            while draft and not bm.can_reserve(seq, len(draft)):
                draft = draft[:-1]
            if draft:
                bm.reserve(seq, len(draft))
                rows_left -= len(draft)
                seq.num_scheduled_tokens += len(draft)
            seq.draft = draft

    def _preempt(self, seq: Sequence):
        """Recompute preemption: free the blocks, re-prefill (prompt + generated tokens) later."""
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def commit(self, seqs: list[Sequence], is_prefill: bool) -> CommittedStep:
        sampled = [seq for seq in seqs if seq.completes_prefill] if is_prefill else seqs
        drafts = [[] if is_prefill else seq.draft for seq in sampled]
        step = CommittedStep(seqs, is_prefill, sampled, [seq.num_cached_tokens for seq in seqs],
                             sum(seq.num_scheduled_tokens for seq in seqs), drafts)
        for seq in seqs:
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            seq.draft = []
        for seq, draft in zip(sampled, drafts):
            for _ in range(1 + len(draft)):  # a placeholder per row: the verified ones stay
                seq.append_placeholder()
        return step

    def postprocess(self, step: CommittedStep, token_ids: list[int]) -> list[Sequence]:
        """Resolve a step's placeholders with its tokens (a step without drafts), hash its full
        blocks; returns the sequences it finished."""
        finished = [seq for seq, token_id in zip(step.sampled, token_ids, strict=True)
                    if not seq.is_finished and self.take_token(seq, token_id)]
        self.register_blocks(step)
        return finished

    def reject_draft(self, seq: Sequence, num_rejected: int):
        """Drop the placeholders and KV positions of a draft's last `num_rejected` tokens (and
        the row after them) that the target did not sample, and the blocks they alone needed."""
        seq.drop_inflight(num_rejected)
        seq.num_cached_tokens -= num_rejected
        self.block_manager.trim(seq)

    def take_token(self, seq: Sequence, token_id: int) -> bool:
        """Resolve `seq`'s oldest placeholder with `token_id` and apply the stop rules; returns
        whether that finished it."""
        seq.resolve_token(token_id)
        num_generated = seq.num_output_tokens
        may_stop = num_generated > seq.min_tokens
        accepted = seq.grammar is None or seq.grammar.accept(token_id)
        if not accepted:  # the mask left no token (e.g. allowed_token_ids outside it)
            self.finish(seq, "abort")
        elif may_stop and not seq.ignore_eos and token_id in self.eos_token_ids:
            self.finish(seq, "stop")
        elif seq.grammar is not None and seq.grammar.is_terminated:
            self.finish(seq, "stop")
        elif may_stop and token_id in seq.stop_token_ids:
            self.finish(seq, "stop", stop_reason=token_id)
        elif num_generated >= seq.max_tokens:
            self.finish(seq, "length")
        else:
            return False
        return True

    def register_blocks(self, step: CommittedStep):
        """Hash the blocks the step filled: only now is every token below num_cached_tokens
        known (the next step's blocks included)."""
        for seq, before in zip(step.seqs, step.num_cached_before):
            if seq.block_table and not seq.is_finished:
                self.block_manager.register_computed_blocks(seq, before)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None):
        """End `seq` (running, waiting or unforked) and the samples waiting to fork from it."""
        queue = self.running if seq.status == SequenceStatus.RUNNING else self.waiting
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.parent is not None:  # a sample not forked yet: it holds nothing
            seq.parent.forks.remove(seq)
            seq.parent = None
            return
        seq.drop_inflight()
        self.block_manager.deallocate(seq)
        queue.remove(seq)
        for child in list(seq.forks):
            self.finish(child, reason, stop_reason)
