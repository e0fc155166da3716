"""LLMEngine: tokenizes and validates requests, drives Scheduler and ModelRunner step by step."""

import atexit
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.requests import as_batch, check_request, eos_token_ids, request_output
from nanovllm.engine.scheduler import CommittedStep, Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.runner.model_runner import ModelRunner, PendingOutput, free_port, run_worker
from nanovllm.runner.shm_channel import ShmChannel, WorkerDiedError
from nanovllm.sampling_params import SamplingParams

NCCL_ABORT_SECONDS = 5.0  # how long exit waits for NCCL to abort a dead worker's collectives


def _abort_nccl_group() -> threading.Thread:
    """Abort the NCCL process group, whose kernels wait for a dead rank, on a daemon thread: the
    abort itself may never return either."""
    abort = dist.distributed_c10d._abort_process_group
    aborter = threading.Thread(target=abort, name="nccl-abort", daemon=True)
    aborter.start()
    aborter.join(NCCL_ABORT_SECONDS)
    return aborter


@dataclass
class StepResult:
    """What the step completed by one `LLMEngine.step` call (launched by the call before) did."""

    finished: list[Sequence]
    num_prefill_tokens: int
    num_decode_tokens: int


class LLMEngine:
    # While exit's NCCL abort runs, its kernels may still spin: no other LLM may start meanwhile.
    nccl_abort: threading.Thread | None = None

    def __init__(self, model: str, **options):
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
        atexit.register(self.exit)
        self._exited = False
        try:
            port = free_port()
            if config.tensor_parallel_size > 1:
                ctx = mp.get_context("spawn")
                self.channel = ShmChannel(ctx, config.tensor_parallel_size - 1)
                for rank in range(1, config.tensor_parallel_size):
                    args = (config, rank, port, self.channel.worker_end(rank))
                    process = ctx.Process(target=run_worker, args=args, daemon=True)
                    process.start()
                    self.processes.append(process)
                self.channel.processes = self.processes
            self.model_runner = ModelRunner(config, 0, port, self.channel)
            self.tokenizer = AutoTokenizer.from_pretrained(config.model)
            self.eos_token_ids = eos_token_ids(self.tokenizer, config)
            self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens,
                                       config.max_model_len, self.model_runner.num_kvcache_blocks,
                                       config.kvcache_block_size, self.eos_token_ids)
        except BaseException:
            self.exit()
            raise

    @property
    def num_kvcache_blocks(self) -> int:
        return self.model_runner.num_kvcache_blocks

    def exit(self):
        """Stop the workers and release the GPU / shared memory. Safe to call more than once."""
        if self._exited:
            return
        self._exited = True
        atexit.unregister(self.exit)
        self.inflight = None
        worker_died = self.channel is not None and self.channel.dead_worker_error() is not None
        try:
            if worker_died:  # no orderly exit: it would wait for GPU work that never ends
                self.model_runner = None
            elif self.model_runner is not None:
                self.model_runner.call("exit")
        except WorkerDiedError:
            worker_died = True
        finally:
            if dist.is_initialized():
                if worker_died and dist.get_backend() == "nccl":
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.exit()

    def _check_alive(self):
        if self._exited:
            raise RuntimeError("this LLM has exited; create a new one")

    def make_sequences(self, prompts, sampling_params, detokenize: bool = False) -> list[Sequence]:
        """Validate a whole batch, then make its sequences; raises before anything is queued."""
        self._check_alive()
        prompts, sampling_params = as_batch(prompts, sampling_params)
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for i, (tokens, sp) in enumerate(zip(token_lists, sampling_params)):
            check_request(i, tokens, sp, self.config.hf_config.vocab_size)
            try:
                self.scheduler.check_fits(len(tokens), sp.max_tokens)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        seqs = [Sequence(tokens, sp, self.config.kvcache_block_size, self.eos_token_ids)
                for tokens, sp in zip(token_lists, sampling_params)]
        for seq in seqs:
            if detokenize or seq.sampling_params.stop:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.token_ids,
                                                         seq.sampling_params)
        return seqs

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> int:
        """Queue one request; returns its sequence id."""
        (seq,) = self.make_sequences([prompt], [sampling_params])
        self.scheduler.add(seq)
        return seq.seq_id

    def reset_prefix_cache(self):
        """Forget every cached prefix; running requests are not affected."""
        self.scheduler.block_manager.reset_prefix_cache()

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def step(self) -> StepResult:
        """Launch a step, then postprocess the previous one while the GPU runs it: the new step
        reads the previous one's sampled tokens on the device."""
        self._check_alive()
        done, finished = None, []
        try:
            seqs, is_prefill = self.scheduler.schedule()
            launched = None
            if seqs:
                pending = self.model_runner.call("run", seqs, is_prefill)
                launched = (self.scheduler.commit(seqs, is_prefill), pending)
            elif self.inflight is None:
                raise RuntimeError("the scheduler could not schedule any request (internal error)")
            if self.inflight is not None:
                done, finished = self._postprocess_inflight()
            self.inflight = launched
        except BaseException as error:
            # The ranks are out of step: release everything, naming a dead worker if there is one.
            died = None
            if self.channel is not None:
                died = self.channel.dead_worker_error(grace_seconds=0.5)
            self.exit()
            if died is not None and died is not error:
                raise died from error
            raise
        if done is None:
            return StepResult(finished, 0, 0)
        prefill = done.num_tokens if done.is_prefill else 0
        return StepResult(finished, prefill, done.num_tokens - prefill)

    def _postprocess_inflight(self) -> tuple[CommittedStep, list[Sequence]]:
        """Hand the in-flight step's tokens to its sequences; returns it and those it finished."""
        step, pending = self.inflight
        self.inflight = None
        output = pending.result() if pending is not None else None
        token_ids = output.token_ids.tolist() if output is not None else []
        alive = [not seq.is_finished for seq in step.sampled]
        finished = self.scheduler.postprocess(step, token_ids)
        if output is not None and output.logprobs is not None:
            self._add_logprobs(step.sampled, alive, output)
        sampled = zip(step.sampled, alive, token_ids)
        finished += self._detokenize([(seq, token) for seq, live, token in sampled if live])
        return step, finished

    @staticmethod
    def _add_logprobs(seqs: list[Sequence], alive: list[bool], output):
        rows = zip(seqs, alive, output.logprob_token_ids.tolist(), output.logprobs.tolist())
        for seq, live, ids, logprobs in rows:
            n = seq.sampling_params.logprobs
            if live and n is not None:  # ids: the sampled token, then the top N of the largest N
                top = dict(zip(ids[1:n + 1], logprobs[1:n + 1]))
                seq.logprobs.append({ids[0]: logprobs[0], **top})
                seq.cumulative_logprob += logprobs[0]

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

    def generate(self, prompts, sampling_params, use_tqdm: bool = True) -> list[dict]:
        """Run a batch to completion; outputs in input order."""
        seqs = self.make_sequences(prompts, sampling_params)
        for seq in seqs:
            self.scheduler.add(seq)
        wanted = {seq.seq_id for seq in seqs}
        outputs: dict[int, dict] = {}
        pbar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        while not wanted.issubset(outputs):
            start = time.perf_counter()
            result = self.step()
            elapsed = time.perf_counter() - start
            if result.num_prefill_tokens:
                prefill_rate = result.num_prefill_tokens / elapsed
            if result.num_decode_tokens:
                decode_rate = result.num_decode_tokens / elapsed
            pbar.set_postfix(prefill=f"{prefill_rate:.0f} tok/s", decode=f"{decode_rate:.0f} tok/s",
                             refresh=False)
            for seq in result.finished:
                outputs[seq.seq_id] = request_output(seq, self.tokenizer)
                if seq.seq_id in wanted:
                    pbar.update(1)
        pbar.close()
        return [outputs[seq.seq_id] for seq in seqs]
