"""LLMEngine: tokenizes and validates requests, drives Scheduler and ModelRunner step by step."""

import atexit
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import accumulate
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.checkpoint.tokenizer import eos_token_ids, load_tokenizer
from nanovllm.config import Config
from nanovllm.engine.colocate import ModelConfig, ModelExecutor
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.grammar import Grammars
from nanovllm.engine.outputs import StreamOutput, request_output, stream_outputs
from nanovllm.engine.postprocess import Postprocess
from nanovllm.engine.requests import Request, RequestLimits
from nanovllm.engine.scheduler import CommittedStep, Scheduler, scheduled_step
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.speculative import DraftGate, NgramDrafter
from nanovllm.engine.weight_ops import WeightOps
from nanovllm.runner.model_runner import ModelRunner, PendingOutput, free_port, run_worker
from nanovllm.runner.shm_channel import NO_MAIN_GUARD_EXIT_CODE, ShmChannel, WorkerDiedError

NCCL_ABORT_SECONDS = 5.0  # how long exit waits for NCCL to abort a dead worker's collectives
EXIT_LOCK_SECONDS = 30.0  # how long exit waits for another thread's step to end
NO_MAIN_GUARD = ("tensor_parallel_size > 1 starts worker processes that import your script again: "
                 "put the LLM(...) call under `if __name__ == \"__main__\":`")


def _abort_nccl_group() -> threading.Thread:
    """Abort the NCCL process group on a daemon thread: the abort itself may never return."""
    abort = dist.distributed_c10d._abort_process_group
    aborter = threading.Thread(target=abort, name="nccl-abort", daemon=True)
    aborter.start()
    aborter.join(NCCL_ABORT_SECONDS)
    return aborter


@dataclass
class StepResult:
    """What the step completed by one `LLMEngine.step` call (launched by the call before) did, and
    the seconds that call took."""

    finished: list[Sequence]
    num_prefill_tokens: int
    num_decode_tokens: int
    seconds: float = 0.0


# The engines alive in this process, each exited at interpreter exit (weakly held: an engine
# nobody references is freed).
_live_engines: "weakref.WeakSet[LLMEngine]" = weakref.WeakSet()


@atexit.register
def _exit_live_engines():
    for engine in list(_live_engines):
        engine.exit()


class LLMEngine(WeightOps, Postprocess):
    # While exit's NCCL abort runs, its kernels may still spin: no other LLM may start meanwhile.
    nccl_abort: threading.Thread | None = None
    grammars: Grammars | None = None  # set once the tokenizer is loaded

    def __init__(self, model: str, **options):
        if getattr(mp.current_process(), "_inheriting", False):
            os._exit(NO_MAIN_GUARD_EXIT_CODE)  # a spawned worker re-running an unguarded script
        self._exited = True  # until start-up completes, exit() has nothing of ours to release
        self.config = config = Config.from_options(model, **options)
        if dist.is_initialized():  # rank 0 uses this process's default process group
            if LLMEngine.nccl_abort is not None and LLMEngine.nccl_abort.is_alive():
                raise RuntimeError("an earlier LLM's tensor-parallel worker died and NCCL did not "
                                   "abort the collectives waiting for it, so this process cannot "
                                   "start another LLM; start a new process")
            raise RuntimeError("another LLM is still alive in this process (or torch.distributed "
                               "is in use); call its exit() first")
        self.processes = []
        self.channel = None
        self.model_runner = None
        # The step launched and not yet postprocessed.
        self.inflight: tuple[CommittedStep, PendingOutput | None] | None = None
        # Callers in several threads and open streams share the steps, one at a time.
        self._lock = threading.RLock()
        self._stepping = self._out_of_step = False
        self._aborted: list[Sequence] = []  # closed streams' requests, finished at the next chance
        self.num_prefilled_tokens = 0  # tokens computed by prefill steps, since start-up
        # Speculation, since start-up: drafts verified, their tokens, the tokens accepted.
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        # _drafts_pending: some sequence has a draft, or a verify step is in flight, so the next
        # step first ends the step in flight; _proposed: the last postprocess proposed a draft.
        self._drafts_pending = self._proposed = False
        self.draft_gate = DraftGate()  # whether a step's drafts are expected to pay
        self.sleep_level = 0  # LLM.sleep's level while anything is asleep
        self.asleep: set[str] = set()  # of WAKE_TAGS: what sleep freed and wake_up has not restored
        self.unloaded_weights: set[str] = set()  # discarded by sleep(level=2), not reloaded yet
        self._excepthook = sys.excepthook  # init_process_group wraps it
        _live_engines.add(self)
        self._exited = False
        if config.seed is not None:  # the steps' noise seeds are drawn from torch's generator
            torch.manual_seed(config.seed)
        try:
            port = free_port()
            if config.tensor_parallel_size > 1:
                self._start_workers(port)
            self.model_runner = ModelRunner(config, 0, port, self.channel)
            sys.excepthook = self._excepthook  # the user's process: no "[rank0]: " on tracebacks
            self.tokenizer = load_tokenizer(config)
            self.eos_token_ids = eos_token_ids(self.tokenizer, config)
            self.grammars = Grammars(self.tokenizer, config.hf_config.vocab_size,
                                     self.eos_token_ids)
            self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens,
                                       config.max_model_len, self.model_runner.num_kvcache_blocks,
                                       config.kvcache_block_size, self.eos_token_ids,
                                       config.enable_prefix_caching, config.max_draft_batch)
            self.model_config = ModelConfig.of(config)
            self.model_executor = ModelExecutor(self)
        except WorkerDiedError as error:
            self.exit()
            if error.exitcode == NO_MAIN_GUARD_EXIT_CODE:
                raise RuntimeError(NO_MAIN_GUARD) from None
            raise
        except BaseException:
            self.exit()
            raise

    def _start_workers(self, port: int):
        """Spawn ranks 1.. with SIGINT blocked: Ctrl-C reaches rank 0 only, which stops them."""
        config = self.config
        ctx = mp.get_context("spawn")
        self.channel = ShmChannel(ctx, config.tensor_parallel_size - 1)
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for rank in range(1, config.tensor_parallel_size):
                args = (config, rank, port, self.channel.worker_end(rank))
                process = ctx.Process(target=run_worker, args=args, daemon=True)
                process.start()
                self.processes.append(process)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        self.channel.processes = self.processes

    @property
    def num_kvcache_blocks(self) -> int:
        return self.model_runner.num_kvcache_blocks

    def exit(self):
        """Stop the workers and release the GPU / shared memory. Safe to call more than once."""
        if self._exited:
            return
        locked = self._lock.acquire(timeout=EXIT_LOCK_SECONDS)  # let another thread's step end
        try:
            if not self._exited:
                self._release()
        finally:
            if locked:
                self._lock.release()

    def _release(self):
        self._exited = True
        _live_engines.discard(self)
        self.inflight = None
        # Workers out of step with rank 0 (a step interrupted or failed, a worker dead, start-up
        # cut short) would never answer an orderly exit: they are killed.
        orderly = self.model_runner is not None and (self.channel is None or (
            not self._out_of_step and self.channel.dead_worker_error() is None))
        try:
            if orderly:
                self.model_runner.call("exit")
        except WorkerDiedError:
            orderly = False
        finally:
            if not orderly:
                self.model_runner = None
                for process in self.processes:
                    process.kill()
            if dist.is_initialized():
                if not orderly and self.processes and dist.get_backend() == "nccl":
                    LLMEngine.nccl_abort = _abort_nccl_group()
                else:
                    dist.destroy_process_group()
            for process in self.processes:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
                    process.join()
            if self.channel is not None:
                self.channel.close()
            if self.grammars is not None:
                self.grammars.filler.close()
            if getattr(sys.excepthook, "__name__", "") == "_distributed_excepthook":
                sys.excepthook = self._excepthook

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.exit()

    def __del__(self):  # `del llm` (then gc.collect()) frees the engine, as vLLM users expect
        if not getattr(self, "_exited", True):
            self.exit()

    def check_alive(self, awake: bool = True):
        if self._exited:
            raise RuntimeError("this LLM has exited; create a new one")
        if awake and self.asleep:
            raise RuntimeError(f"this LLM is asleep (sleep(level={self.sleep_level}); "
                               f"{' and '.join(sorted(self.asleep))} not woken): call wake_up() "
                               "first")
        if awake and self.unloaded_weights:
            raise RuntimeError(
                f"{len(self.unloaded_weights)} weights discarded by sleep(level=2) are not loaded "
                f"again (e.g. {min(self.unloaded_weights)!r}): pass them to update_weights() or "
                "update_weights_from_path() first")

    @property
    def limits(self) -> RequestLimits:
        """What a request must fit in this engine."""
        config = self.config
        return RequestLimits(config.hf_config.vocab_size, config.max_model_len,
                             config.kvcache_block_size, self.num_kvcache_blocks,
                             config.max_num_seqs, config.max_logprobs)

    def add(self, requests: list[Request], detokenize: bool = False) -> list[Sequence]:
        """Queue checked requests (make_requests); returns their sequences, each prompt's n
        samples in a row. detokenize: text as tokens come (streams), not only at the end."""
        block_size = self.config.kvcache_block_size
        seqs = []
        for request in requests:
            samples = Sequence(request.token_ids, request.params, block_size, self.eos_token_ids,
                               request.banned_token_ids).make_samples()
            grammar, spec = request.grammar, request.params.structured_outputs
            if isinstance(grammar, str):  # compiled in another process (grammar.serialize)
                grammar = self.grammars.load(spec, grammar)
            elif grammar is None and spec is not None:
                grammar = self.grammars.compile(spec)
            for sample in samples:
                sample.request_id = request.request_id
                if grammar is not None:  # each sample its own matcher
                    sample.grammar = self.grammars.matcher(grammar)
                elif self.config.speculative_config is not None:
                    sample.drafter = NgramDrafter(self.config.speculative_config)
            seqs += samples
        for seq in seqs:
            if detokenize or seq.sampling_params.stop:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.token_ids,
                                                         seq.sampling_params)
        with self._lock:
            self.check_alive()
            self._apply_aborts()
            for seq in seqs:
                if seq.sample_index == 0:  # the others wait in its forks
                    self.scheduler.add(seq)
        return seqs

    def abort(self, seqs: list[Sequence]):
        """Finish these requests ("abort") now, or at the next step if one is running."""
        self._aborted += [seq for seq in seqs if not seq.is_finished]
        # Non-blocking: a closed stream's finalizer may run in the middle of this thread's step.
        if self._lock.acquire(blocking=False):
            try:
                if not self._stepping:
                    self._apply_aborts()
            finally:
                self._lock.release()

    def abort_requests(self, request_ids: list[str]):
        """Finish ("abort") the unfinished samples of these requests, at once or after the step
        that is running; their callers get them with finish_reason "abort"."""
        ids = set(request_ids)
        with self._lock:
            queues = (self.scheduler.running, self.scheduler.waiting)
            self.abort([seq for queue in queues for seq in queue if seq.request_id in ids])

    def _apply_aborts(self):
        while self._aborted:
            seq = self._aborted.pop()
            if not seq.is_finished and not self._exited:
                self.scheduler.finish(seq, "abort")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; running requests are not affected."""
        with self._lock:
            self.scheduler.block_manager.reset_prefix_cache()
        return True

    def is_finished(self) -> bool:
        with self._lock:
            self._apply_aborts()
            return self.scheduler.is_finished()

    def step(self) -> StepResult:
        """Launch a step, then postprocess the previous one while the GPU runs the new one."""
        with self._lock:
            self.check_alive()
            self._apply_aborts()
            if self.inflight is None and self.scheduler.is_finished():
                return StepResult([], 0, 0)
            self._stepping = True
            start = perf_counter()
            try:
                result = self._step()
            finally:
                self._stepping = False
            result.seconds = perf_counter() - start
            return result

    def _step(self) -> StepResult:
        done, finished = None, []
        try:
            if self.inflight is not None and self._drafts_pending:
                # Speculation: the drafts need every token, so the step in flight ends first.
                done, finished = self._postprocess_inflight()
            seqs, is_prefill = self.scheduler.schedule()
            launched = step = None
            if seqs:
                step = scheduled_step(seqs, is_prefill)
                pending = self.model_runner.call("run", step)
                launched = (self.scheduler.commit(seqs, is_prefill), pending)
            elif self.inflight is None and done is None:
                raise RuntimeError("the scheduler could not schedule any request (internal error)")
            self._proposed = False  # drafts proposed before the schedule were taken by it
            if self.inflight is not None:
                done, finished = self._postprocess_inflight()
            self._drafts_pending = self._proposed or (launched is not None
                                                      and self._decides_drafts(launched[0]))
            if step is not None and step.masked:  # the GPU runs the step's forward meanwhile
                launched = (launched[0], self._sample_masked(launched[0], step.sampling))
            self.inflight = launched
        except BaseException as error:
            # The ranks are out of step: release everything, naming a dead worker if there is one.
            self._out_of_step = True
            died = None
            if self.channel is not None and not isinstance(error, KeyboardInterrupt):
                died = self.channel.dead_worker_error(grace_seconds=0.5)
            self.exit()
            if died is not None and died is not error:
                raise died from error
            raise
        if done is None:
            return StepResult(finished, 0, 0)
        prefill = done.num_tokens if done.is_prefill else 0
        self.num_prefilled_tokens += prefill
        return StepResult(finished, prefill, done.num_tokens - prefill)

    def _sample_masked(self, committed: CommittedStep, sampling) -> PendingOutput:
        """Sample a launched step whose grammar rows' masks needed the tokens before it, which
        are known now; a row finished meanwhile is not masked (its token is discarded)."""
        sampled = committed.sampled
        states = [None if sampled[row].is_finished else sampled[row].grammar
                  for row in sampling.grammar_rows]
        bitmask = self.grammars.filler.fill(states, self.config.hf_config.vocab_size)
        return self.model_runner.sample_masked(bitmask)

    def as_completed(self, requests: list[Request],
                     on_step: Callable[[StepResult], None] | None = None,
                     ) -> Iterator[tuple[int, Any]]:
        """Queue `requests` and step until each completes, yielding (its index, its output) as it
        does; other callers' requests share the steps. Closing the iterator early aborts the
        requests not yet completed. on_step sees each step this call ran."""
        seqs = self.add(requests)
        groups: list[list[Sequence]] = []
        prompt_of: dict[int, int] = {}
        for seq in seqs:
            if seq.sample_index == 0:
                groups.append([])
            groups[-1].append(seq)
            prompt_of[seq.seq_id] = len(groups) - 1
        num_completed = 0
        unfinished = seqs
        try:
            while num_completed < len(groups):
                with self._lock:
                    touched = sorted({prompt_of[s.seq_id] for s in unfinished if s.is_finished})
                    unfinished = [s for s in unfinished if not s.is_finished]
                    completed = [(i, request_output(requests[i], groups[i], self.tokenizer))
                                 for i in touched
                                 if all(s.is_finished for s in groups[i])]
                    result = self.step() if unfinished else None
                num_completed += len(completed)
                yield from completed
                if on_step is not None and result is not None:
                    on_step(result)
        finally:
            self.abort(unfinished)

    def stream(self, requests: list[Request]) -> Iterator[StreamOutput]:
        """Queue `requests` and yield what each step adds to them; closing the iterator early
        aborts the unfinished ones."""
        seqs = self.add(requests, detokenize=True)
        pending = dict(enumerate(seqs))  # flat: the samples of a prompt follow one another
        sent = {index: (0, 0) for index in pending}  # tokens and characters already yielded
        prompt_of = list(accumulate(seq.sample_index == 0 for seq in seqs))
        try:
            while pending:
                with self._lock:  # another caller's steps may have advanced these requests
                    outputs = stream_outputs(pending, sent, prompt_of)
                    if not outputs:
                        self.step()
                        outputs = stream_outputs(pending, sent, prompt_of)
                yield from outputs
        finally:
            self.abort(list(pending.values()))
