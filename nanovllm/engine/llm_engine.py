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

# How long LLMEngine.exit waits for NCCL to abort the collectives a dead worker left pending.
NCCL_ABORT_SECONDS = 5.0


def _abort_nccl_group() -> threading.Thread:
    """Abort this process's NCCL process group, whose kernels wait for a rank that died and never return.
    The abort itself may never return either (torch 2.11 on the H200: BENCHMARKS.md, eleventh session),
    so it runs on a daemon thread, returned after waiting NCCL_ABORT_SECONDS for it."""
    aborter = threading.Thread(target=dist.distributed_c10d._abort_process_group, name="nccl-abort", daemon=True)
    aborter.start()
    aborter.join(NCCL_ABORT_SECONDS)
    return aborter


@dataclass
class StepResult:
    """What the step completed by one `LLMEngine.step` call (the one launched by the call before) produced."""

    finished: list[Sequence]
    num_prefill_tokens: int
    num_decode_tokens: int


class LLMEngine:
    # exit's NCCL abort (_abort_nccl_group). While it runs, the process group stays registered and its
    # kernels may still spin on the GPU: no other LLM can start in this process.
    nccl_abort: threading.Thread | None = None

    def __init__(self, model: str, **options):
        self._exited = True  # until start-up completes, exit() has nothing of ours to release
        self.config = config = Config.from_options(model, **options)
        if dist.is_initialized():  # rank 0 uses this process's default process group
            if LLMEngine.nccl_abort is not None and LLMEngine.nccl_abort.is_alive():
                raise RuntimeError("an earlier LLM's tensor-parallel worker died and NCCL did not abort the "
                                   "collectives waiting for it, so this process cannot start another LLM; "
                                   "start a new process")
            raise RuntimeError("another LLM is still alive in this process (or torch.distributed is in use); "
                               "call its exit() first")
        self.processes = []
        self.channel = None
        self.model_runner = None
        self.inflight: tuple[CommittedStep, PendingOutput | None] | None = None  # launched, not postprocessed
        atexit.register(self.exit)
        self._exited = False
        try:
            port = free_port()
            if config.tensor_parallel_size > 1:
                ctx = mp.get_context("spawn")
                self.channel = ShmChannel(ctx, config.tensor_parallel_size - 1)
                for rank in range(1, config.tensor_parallel_size):
                    process = ctx.Process(target=run_worker, args=(config, rank, port, self.channel.worker_end(rank)),
                                          daemon=True)
                    process.start()
                    self.processes.append(process)
                self.channel.processes = self.processes
            self.model_runner = ModelRunner(config, 0, port, self.channel)
            self.tokenizer = AutoTokenizer.from_pretrained(config.model)
            self.eos_token_ids = eos_token_ids(self.tokenizer, config)
            self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
                                       self.model_runner.num_kvcache_blocks, config.kvcache_block_size,
                                       self.eos_token_ids)
        except BaseException:
            self.exit()
            raise

    @property
    def num_kvcache_blocks(self) -> int:
        return self.model_runner.num_kvcache_blocks

    # ---- lifecycle -----------------------------------------------------------------------------

    def exit(self):
        """Stop the workers and release the GPU / shared memory. Safe to call more than once."""
        if self._exited:
            return
        self._exited = True
        atexit.unregister(self.exit)
        self.inflight = None
        worker_died = self.channel is not None and self.channel.dead_worker_error() is not None
        try:
            if worker_died:  # no orderly exit: it would synchronize with GPU work that never ends (below)
                self.model_runner = None
            elif self.model_runner is not None:
                self.model_runner.call("exit")
        except WorkerDiedError:
            worker_died = True  # the survivors are stopped below
        finally:
            if dist.is_initialized():  # start-up failed midway, or a worker died
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

    # ---- requests ------------------------------------------------------------------------------

    def make_sequences(self, prompts, sampling_params, detokenize: bool = False) -> list[Sequence]:
        """Validate a whole batch and turn it into sequences; raises before anything is queued.
        Sequences with stop strings, or all of them when `detokenize`, decode their text as it grows."""
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
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.token_ids, seq.sampling_params)
        return seqs

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> int:
        """Queue one request; returns its sequence id."""
        (seq,) = self.make_sequences([prompt], [sampling_params])
        self.scheduler.add(seq)
        return seq.seq_id

    def reset_prefix_cache(self):
        """Forget every cached prefix (BlockManager.reset_prefix_cache): later prompts are computed in
        full, as on a fresh engine. Running requests are not affected."""
        self.scheduler.block_manager.reset_prefix_cache()

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def step(self) -> StepResult:
        """Schedule and launch a step, then postprocess the previous one while the GPU runs the new
        one, so the GPU never waits for the host's bookkeeping. The new step reads the tokens the
        previous one sampled (its decode inputs, penalty histories) on the device."""
        self._check_alive()
        done, finished = None, []  # the step completed by this call, and the sequences it finished
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
            # A failed step leaves the ranks out of step: release everything. If a worker died,
            # say so rather than surfacing the collective's connection error.
            died = self.channel.dead_worker_error(grace_seconds=0.5) if self.channel is not None else None
            self.exit()
            if died is not None and died is not error:
                raise died from error
            raise
        if done is None:
            return StepResult(finished, 0, 0)
        prefill = done.num_tokens if done.is_prefill else 0
        return StepResult(finished, prefill, done.num_tokens - prefill)

    def _postprocess_inflight(self) -> tuple[CommittedStep, list[Sequence]]:
        """Wait for the in-flight step's tokens and hand them to the sequences; returns the step and
        the sequences it finished."""
        step, pending = self.inflight
        self.inflight = None
        output = pending.result() if pending is not None else None
        token_ids = output.token_ids.tolist() if output is not None else []
        alive = [not seq.is_finished for seq in step.sampled]  # the others finished after launching it
        finished = self.scheduler.postprocess(step, token_ids)
        if output is not None and output.logprobs is not None:
            for seq, live, ids, logprobs in zip(step.sampled, alive, output.logprob_token_ids.tolist(),
                                                output.logprobs.tolist()):
                n = seq.sampling_params.logprobs
                if live and n is not None:  # ids: the sampled token, then the top N of the row asking the most
                    seq.logprobs.append({ids[0]: logprobs[0], **dict(zip(ids[1:n + 1], logprobs[1:n + 1]))})
                    seq.cumulative_logprob += logprobs[0]
        finished += self._detokenize([(seq, token) for seq, live, token in zip(step.sampled, alive, token_ids)
                                      if live])
        return step, finished

    def _detokenize(self, sampled: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Give each new token to its sequence's detokenizer; finish the sequences whose stop string
        appeared and return them."""
        finished = []
        for seq, token_id in sampled:
            if seq.detokenizer is None:
                continue
            stop = seq.detokenizer.update(token_id, seq.is_finished, stop_terminated=seq.finish_reason == "stop")
            if stop is None:
                continue
            if seq.is_finished:  # by length or a stop id in the same token: the stop string wins, as in vLLM
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
            pbar.set_postfix(prefill=f"{prefill_rate:.0f} tok/s", decode=f"{decode_rate:.0f} tok/s", refresh=False)
            for seq in result.finished:
                outputs[seq.seq_id] = request_output(seq, self.tokenizer)
                if seq.seq_id in wanted:
                    pbar.update(1)
        pbar.close()
        return [outputs[seq.seq_id] for seq in seqs]
