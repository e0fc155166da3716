"""The host side of a step's results: tokens handed to their sequences (a verify step's one by
one), logprobs, prompt logprobs, stop strings, and the drafts that follow (speculation)."""

from nanovllm.config import Config
from nanovllm.engine.scheduler import CommittedStep, Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.speculative import DraftGate, accepted_length
from nanovllm.step import StepOutput


class Postprocess:
    """LLMEngine's postprocess: the step in flight, once its tokens are on the host."""

    config: Config
    scheduler: Scheduler
    inflight: tuple | None
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    draft_gate: DraftGate
    _proposed: bool

    def _postprocess_inflight(self) -> tuple[CommittedStep, list[Sequence]]:
        """Hand the in-flight step's tokens to its sequences; returns it and those it finished."""
        step, pending = self.inflight
        self.inflight = None
        output = pending.result() if pending is not None else None
        if output is not None and any(step.drafts):
            finished = self._take_verified(step, output)
        else:
            token_ids = output.token_ids.tolist() if output is not None else []
            alive = [not seq.is_finished for seq in step.sampled]
            finished = self.scheduler.postprocess(step, token_ids)
            if output is not None and output.logprobs is not None:
                self._add_logprobs([(seq, row) for row, (seq, live)
                                    in enumerate(zip(step.sampled, alive)) if live], output)
            sampled = zip(step.sampled, alive, token_ids)
            finished += self._detokenize([(seq, token) for seq, live, token in sampled if live])
        if output is not None and output.prompt_logprobs:
            self._add_prompt_logprobs(step.seqs, output)
        if self.config.speculative_config is not None:
            self._propose(step.sampled)
        return step, finished

    def _take_verified(self, step: CommittedStep, output: StepOutput) -> list[Sequence]:
        """A step with drafts: each sequence keeps its rows' tokens up to the first one the
        target sampled differently from the draft (included), taken one by one, as single
        decode steps would, until one finishes it."""
        token_ids = output.token_ids.tolist()
        finished, first = [], 0
        for seq, draft in zip(step.sampled, step.drafts, strict=True):
            rows = range(first, first + 1 + len(draft))
            first = rows.stop
            if seq.is_finished:
                continue
            accepted = accepted_length(draft, token_ids[rows.start:rows.stop])
            if draft:
                self.num_drafts += 1
                self.num_draft_tokens += len(draft)
                self.num_accepted_tokens += accepted
                seq.drafter.record(len(draft), accepted)
                self.scheduler.reject_draft(seq, len(draft) - accepted)
            for row in rows[:accepted + 1]:
                if self.scheduler.take_token(seq, token_ids[row]):
                    finished.append(seq)
                if output.logprobs is not None:
                    self._add_logprobs([(seq, row)], output)
                finished += self._detokenize([(seq, token_ids[row])])
                if seq.is_finished:
                    break
        self.scheduler.register_blocks(step)
        return finished

    def _decides_drafts(self, step: CommittedStep) -> bool:
        """The tokens of `step` decide the next step's drafts, so it waits for them: a verify
        step, or a prefill that samples for sequences that may draft (from their prompts)."""
        if step.is_prefill:
            return (len(self.scheduler.running) <= self.scheduler.max_draft_batch
                    and any(seq.drafter is not None for seq in step.sampled))
        return any(step.drafts)

    def _propose(self, seqs: list[Sequence]):
        """Each live sequence's draft for its known tokens; a draft makes the next step wait for
        the step in flight (its tokens come before the draft's)."""
        num_running = len(self.scheduler.running)
        if num_running > self.scheduler.max_draft_batch:
            return  # the next decode step verifies no draft: it keeps the overlap
        drafting = []
        for seq in seqs:
            if seq.drafter is not None and not seq.is_finished:
                seq.draft = seq.drafter.propose(seq.token_ids, seq.num_tokens - seq.num_inflight)
                if seq.draft:
                    drafting.append(seq)
        if not drafting:
            return
        if not self.draft_gate.admits([seq.drafter for seq in drafting], num_running):
            for seq in drafting:  # too little expected: the next step overlaps instead
                seq.draft = []
            return
        self._proposed = True

    @staticmethod
    def _add_logprobs(rows: list[tuple[Sequence, int]], output: StepOutput):
        """Each (sequence, row) of the step's output: the sampled token's logprob entry, then the
        top N of the largest N."""
        index = [row for _, row in rows]
        values = zip(rows, output.logprob_token_ids[index].tolist(),
                     output.logprobs[index].tolist(), output.logprob_ranks[index].tolist())
        for (seq, _), ids, logprobs, rank in values:
            n = seq.sampling_params.logprobs
            if n is not None:
                top = dict(zip(ids[1:n + 1], logprobs[1:n + 1]))
                seq.logprobs.append({ids[0]: logprobs[0], **top})
                seq.logprob_ranks.append(rank)
                seq.cumulative_logprob += logprobs[0]

    @staticmethod
    def _add_prompt_logprobs(seqs: list[Sequence], output: StepOutput):
        """Each prefill row's prompt logprobs, for the prompt positions that follow those it has
        (the chunks of a prompt are postprocessed in order)."""
        for row, (chosen, ranks, top_ids, top_logprobs) in output.prompt_logprobs.items():
            seq = seqs[row]
            first = len(seq.prompt_logprobs) + 1  # the first target's position
            targets = seq.token_ids[first:first + len(chosen)]
            for target, logprob, ids, values in zip(targets, chosen.tolist(), top_ids.tolist(),
                                                    top_logprobs.tolist()):
                seq.prompt_logprobs.append({target: logprob, **dict(zip(ids, values))})
            seq.prompt_logprob_ranks += ranks.tolist()

    def _detokenize(self, sampled: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Detokenize each new token; finish and return the sequences whose stop string appeared."""
        finished = []
        for seq, token_id in sampled:
            if seq.detokenizer is None:
                continue
            stop = seq.detokenizer.update(token_id, seq.is_finished,
                                          stop_terminated=seq.finish_reason == "stop")
            if stop is None:
                continue
            if seq.is_finished:  # by length or a stop id in the same token: the stop string wins
                seq.finish_reason, seq.stop_reason = "stop", stop
            else:
                self.scheduler.finish(seq, "stop", stop_reason=stop)
                finished.append(seq)
        return finished
