"""One ModelRunner per tensor-parallel rank: the model shard, the KV pool, the CUDA graphs. Rank 0
samples; the workers run every call received over `ShmChannel`, so collectives line up."""

import os
import socket
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.checkpoint.hf_config import head_dim
from nanovllm.checkpoint.loader import load_model, load_weights
from nanovllm.config import Config
from nanovllm.kernels.attention.kv_cache import bytes_per_token
from nanovllm.models import model_class
from nanovllm.runner.cuda_graph import DecodeGraphs
from nanovllm.runner.sampler_graphs import SamplerGraphs
from nanovllm.runner.sampling_metadata import build_sampling_metadata, every_control
from nanovllm.runner.shm_channel import ShmChannel, WorkerEnd
from nanovllm.runner.sleep import Sleeper
from nanovllm.runner.step_inputs import StepInputs
from nanovllm.sampling.sampler import Sampler, SamplerOutput, to_host
from nanovllm.step import ScheduledStep, StepOutput, StepSampling

PROMPT_LOGPROB_ROWS = 256  # prompt positions a lm_head call takes: bounds its [rows, vocab] logits
CPU_KV_CACHE_BYTES = 2 << 30  # KV pool budget on CPU when num_kvcache_blocks is not given
WORKER_CHECK_SECONDS = 0.01  # how often rank 0, waiting for a step, checks that the workers live
PARENT_CHECK_SECONDS = 0.2  # how often a worker checks that rank 0's process lives


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def default_dtype_and_device(dtype: torch.dtype, device: torch.device):
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(old_dtype)


def _exit_with_parent(parent_pid: int):
    """A worker's watchdog: end this process once rank 0's is gone (even inside a collective)."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_SECONDS)
    os._exit(0)


def run_worker(config: Config, rank: int, port: int, channel: WorkerEnd):
    """Entry point of a spawned worker rank: serve calls until `exit`."""
    threading.Thread(target=_exit_with_parent, args=(channel.parent_pid,), name="parent-watch",
                     daemon=True).start()
    if config.device == "cpu":  # share the cores among the ranks instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
    runner = ModelRunner(config, rank, port)
    try:
        while True:
            method, args = channel.receive()
            getattr(runner, method)(*args)
            if method == "exit":
                break
    except KeyboardInterrupt:
        pass
    finally:
        channel.close()


class ModelRunner:
    def __init__(self, config: Config, rank: int, port: int, channel: ShmChannel | None = None):
        self.config = config
        self.rank = rank
        self.world_size = config.tensor_parallel_size
        self.channel = channel
        self.block_size = config.kvcache_block_size
        hf = config.hf_config
        is_cuda = config.device == "cuda"
        if is_cuda:
            torch.cuda.set_device(rank)
        self.device = torch.device("cuda", rank) if is_cuda else torch.device("cpu")
        self._init_process_group(port)
        self.dtype = config.torch_dtype
        with default_dtype_and_device(self.dtype, self.device):
            self.model = model_class(hf)(hf, config.attention_backend,
                                         expert_parallel=config.expert_parallel)
        self.weight_shapes = load_model(self.model, config.model,  # checkpoint name -> shape
                                        dummy=config.load_format == "dummy")
        self.sampler = Sampler(logprobs_mode=config.logprobs_mode)
        self.num_kv_heads = hf.num_key_value_heads // self.world_size
        self.head_dim = head_dim(hf)
        # On one GPU the decode graphs sample too (the workers do not know the requests' settings).
        graphs_sample = is_cuda and not config.enforce_eager and self.world_size == 1
        self.inputs = StepInputs(self.device, self.block_size,
                                 decode_order=config.attention_backend == "triton",
                                 decode_temperatures=graphs_sample,
                                 dequant_workspace=self._dequant_workspace())
        self.num_kvcache_blocks = self._allocate_kv_cache()
        self.graphs = self.sampler_graphs = None
        self.sleeper = Sleeper(self.device)  # what sleep() freed, by wake_up tag
        # A step `run` left at its logits for sample_masked: (logits, sampling, seq_ids, prompt).
        self.masked_step: tuple | None = None
        if is_cuda and not config.enforce_eager:
            self._capture_graphs()
            if rank == 0:
                self.sampler_graphs = SamplerGraphs(self.sampler, config.max_num_seqs)

    def _capture_graphs(self):
        # With tensor parallelism the workers, which do not know the requests' sampling, run
        # lm_head's gather eagerly every step; on one GPU the decode graphs sample too.
        sampler = self.sampler if self.inputs.decode_temperatures else None
        self.graphs = DecodeGraphs(self, self.config.max_num_seqs, self.max_blocks_per_seq,
                                   sampler, verify=self.config.speculative_config is not None)

    def _init_process_group(self, port: int):
        """Rendezvous over a TCP store; rank 0 watches the workers, so a dead one is no hang."""
        store = dist.TCPStore("127.0.0.1", port, self.world_size, is_master=self.rank == 0,
                              wait_for_workers=False, timeout=timedelta(minutes=10))
        if self.rank == 0:
            while store.add("workers_ready", 0) < self.world_size - 1:
                self.channel.check_workers_alive()
                time.sleep(0.05)
        else:
            store.add("workers_ready", 1)
        is_cuda = self.device.type == "cuda"
        dist.init_process_group("nccl" if is_cuda else "gloo", store=store,
                                world_size=self.world_size, rank=self.rank,
                                device_id=self.device if is_cuda else None)

    @property
    def max_blocks_per_seq(self) -> int:
        return (self.config.max_model_len + self.block_size - 1) // self.block_size

    def call(self, method: str, *args):
        """Run `method` on every rank (called on rank 0); returns rank 0's result."""
        if self.channel is not None:
            self.channel.send(method, *args)
        return getattr(self, method)(*args)

    def exit(self):
        for graphs in (self.graphs, self.sampler_graphs):
            if graphs is not None:
                graphs.release()
        self.graphs = self.sampler_graphs = None
        self.sleeper.free()
        self.sleeper = Sleeper(self.device)
        self.model = self.kv_cache = self.kv_scales = self.inputs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        dist.destroy_process_group()

    @torch.no_grad()
    def update_weights(self, specs: list[tuple[str, tuple]], weights=None):
        """Copy (name, tensor) pairs in place (order: specs); TP workers get each by broadcast."""
        load_weights(self.model, self._received(specs, weights), complete=False)

    def _received(self, specs: list[tuple[str, tuple]], weights):
        tensors = iter(weights) if weights is not None else None
        for name, shape in specs:
            if self.world_size == 1:
                yield next(tensors)
                continue
            if self.rank == 0:
                tensor = next(tensors)[1].to(self.device, self.dtype).contiguous()
            else:
                tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
            dist.broadcast(tensor, src=0)
            yield name, tensor

    def sleep(self, level: int):
        """Free the KV pool; the weights' bytes to the host copy (level 1) or discarded (level 2).
        On the CPU, level 1 leaves the weights, already in host memory."""
        cuda = self.device.type == "cuda"
        kv = [t for t in (self.kv_cache, self.kv_scales, self.inputs.dequant_workspace)
              if t is not None]
        groups = {"kv_cache": kv}
        if level == 2 or cuda:
            groups["weights"] = list(self.model.parameters())
        self.sleeper.sleep(groups, keep_weights=level == 1)
        if self.sampler_graphs is not None:
            self.sampler_graphs.release()  # captured again as their shapes recur
        if cuda:
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str]):
        """Restore what sleep freed under `tags` ("weights", "kv_cache"): the weights from the host
        copy (kept for the next sleep), the KV pool zeroed. Once both are back, capture the graphs
        again if anything came back at another address."""
        if "kv_cache" in self.sleeper.wake(tags):
            self._bind_kv_cache()  # the layers' views of the moved pool
        if self.sleeper.asleep or not self.sleeper.moved:
            return
        self.sleeper.moved = False
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
            torch.cuda.empty_cache()
            self._capture_graphs()

    def _dequant_workspace(self) -> torch.Tensor | None:
        """[2, tokens, kv_heads, head_dim]: where prefill dequantizes an fp8 prefix (a context, or
        a prefill) for the Triton backend; allocated before the profile, which counts it."""
        if not (self.config.kv_cache_torch_dtype == torch.float8_e4m3fn
                and self.config.attention_backend == "triton"):
            return None
        capacity = max(self.config.max_model_len, self.config.max_num_batched_tokens)
        return torch.empty(2, capacity, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                           device=self.device)

    def _allocate_kv_cache(self) -> int:
        """Allocate [2, layers, blocks, block_size, kv_heads, head_dim]; each layer gets its views;
        fp8: V viewed [blocks, kv_heads, head_dim, block_size], scales [2, layers, blocks,
        kv_heads, block_size] float32."""
        hf = self.config.hf_config
        cache_dtype = self.config.kv_cache_torch_dtype
        fp8 = cache_dtype == torch.float8_e4m3fn
        num_blocks = self._num_kv_blocks(cache_dtype)
        shape = (2, hf.num_hidden_layers, num_blocks)
        # An fp8 cache must hold no NaN, not even in slots never written (kv_cache.py).
        new_pool = torch.zeros if fp8 else torch.empty
        self.kv_cache = new_pool(*shape, self.block_size, self.num_kv_heads, self.head_dim,
                                 dtype=cache_dtype, device=self.device)
        # kv_heads before block_size: a tile reads its KV head's scales as one contiguous run.
        self.kv_scales = torch.empty(*shape, self.num_kv_heads, self.block_size,
                                     dtype=torch.float32, device=self.device) if fp8 else None
        self._bind_kv_cache()
        return num_blocks

    def _bind_kv_cache(self):
        """Give each attention layer its views of the pool (and of the fp8 scales)."""
        num_blocks = self.kv_cache.shape[2]
        attention_layers = [m for m in self.model.modules() if hasattr(m, "k_cache")]
        for i, layer in enumerate(attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            if self.kv_scales is not None:  # fp8
                layer.v_cache = layer.v_cache.view(num_blocks, self.num_kv_heads, self.head_dim,
                                                   self.block_size)
                layer.k_scale, layer.v_scale = self.kv_scales[0, i], self.kv_scales[1, i]

    def _num_kv_blocks(self, cache_dtype: torch.dtype) -> int:
        """The pool's size: as configured, else what memory allows; the smallest over the ranks."""
        hf = self.config.hf_config
        block_bytes = self.block_size * bytes_per_token(hf.num_hidden_layers, self.num_kv_heads,
                                                        self.head_dim, cache_dtype)
        if self.config.num_kvcache_blocks > 0:
            num_blocks = self.config.num_kvcache_blocks
        elif self.device.type == "cuda":
            num_blocks = self._profile_free_memory() // block_bytes
        else:
            num_blocks = CPU_KV_CACHE_BYTES // block_bytes
        agreed = torch.tensor([num_blocks], device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        num_blocks = int(agreed.item())
        if num_blocks <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache (one block of {self.block_size} tokens needs "
                f"{block_bytes / 2**20:.1f} MiB) at gpu_memory_utilization="
                f"{self.config.gpu_memory_utilization}; raise it or lower max_num_batched_tokens / "
                "max_num_seqs")
        return num_blocks

    def _profile_free_memory(self) -> int:
        """Bytes left for the KV cache under gpu_memory_utilization past the largest step's peak."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        num_tokens = self.config.max_num_batched_tokens
        max_len = self.config.max_model_len
        lens = [min(max_len, num_tokens - i) for i in range(0, num_tokens, max_len)]
        input_ids, positions, meta, _ = self.inputs.prepare_prefill(
            _dummy_prefill(lens, self.block_size))
        hidden = self.model(input_ids, positions, meta)
        rows = hidden[-1:].expand(self.config.max_num_seqs, -1)
        logits = self.model.compute_logits(rows)
        if self.rank == 0:
            # Every control on: the sampler's most memory-hungry path.
            self.sampler(logits, build_sampling_metadata(every_control(len(rows)), logits.shape[1],
                                                         self.inputs.to_device))
        del hidden, rows, logits
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        used_outside_peak = total - free - current  # other processes, CUDA context, allocator cache
        return int(total * self.config.gpu_memory_utilization - used_outside_peak - peak)

    @torch.inference_mode()
    def run(self, step: ScheduledStep) -> "PendingOutput | None":
        """Launch one step; on rank 0, return its sampled tokens on their way to the host."""
        prompt = {}
        if step.is_prefill:
            input_ids, positions, meta, sample_rows = self.inputs.prepare_prefill(step)
            chunks = self.model(input_ids, positions, meta)
            hidden = chunks[sample_rows]
            self._copy_blocks(self.inputs.fork_block_copies(step))
            if step.prompt_logprobs:
                prompt = self._prompt_logprobs(chunks, step)
        else:
            graphs = self.graphs
            if graphs is not None and len(step) > graphs.max_batch_size:
                graphs = None
            input_ids, positions, meta = self.inputs.prepare_decode(step, graphs)
            if graphs is not None:
                hidden = graphs.replay(meta, len(step))
            else:
                hidden = self.model(input_ids, positions, meta)
            if graphs is not None and graphs.samples(step):  # lm_head, sampler in graphs
                tokens = graphs.sample(meta, len(step))
                self.inputs.keep_sampled(tokens, step.seq_ids)
                return PendingOutput(SamplerOutput(tokens), self.channel)
        logits = self.model.compute_logits(hidden)
        seq_ids = step.sampled_seq_ids
        if not seq_ids:
            if self.rank == 0 and prompt:
                no_tokens = torch.empty(0, dtype=torch.int64, device=self.device)
                return PendingOutput(SamplerOutput(no_tokens), self.channel, prompt)
            return None
        if step.masked:  # sampled by sample_masked, once the grammar rows' masks are filled
            self.masked_step = (logits, step.sampling, seq_ids, prompt)
            return None
        return self._sample_and_keep(logits, step.sampling, seq_ids, prompt)

    def sample_masked(self, bitmask: np.ndarray) -> "PendingOutput":
        """Rank 0: sample the step `run` left at its logits, its grammar rows masked by bitmask
        [grammar rows, ceil(vocab / 32)] int32; the workers take part without the masks."""
        if self.channel is not None:
            self.channel.send("_sample_masked", None)
        return self._sample_masked(bitmask)

    @torch.inference_mode()
    def _sample_masked(self, bitmask: np.ndarray | None) -> "PendingOutput | None":
        logits, sampling, seq_ids, prompt = self.masked_step
        self.masked_step = None
        if sampling is not None:
            sampling.bitmask = bitmask
        return self._sample_and_keep(logits, sampling, seq_ids, prompt)

    def _sample_and_keep(self, logits: torch.Tensor, sampling: StepSampling | None,
                         seq_ids: list[int], prompt: dict) -> "PendingOutput | None":
        """Rank 0 samples logits [rows, vocab] and broadcasts the tokens; every rank keeps them
        as the next step's inputs."""
        if self.rank == 0:
            output = self._sample(logits, sampling, seq_ids)
            tokens = output.token_ids
        else:
            tokens = torch.empty(len(seq_ids), dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            dist.broadcast(tokens, src=0)
        self.inputs.keep_sampled(tokens, seq_ids)
        return PendingOutput(output, self.channel, prompt) if self.rank == 0 else None

    def _prompt_logprobs(self, chunks: torch.Tensor,
                         step: ScheduledStep) -> dict[int, tuple[torch.Tensor, ...]]:
        """chunks [step tokens, hidden] -> per row of step.prompt_logprobs (rank 0): its targets'
        logprobs [m] and ranks [m] (1: most likely), and the top ids and logprobs [m, num_top].
        The logits go through lm_head PROMPT_LOGPROB_ROWS positions at a time, on every rank."""
        starts = np.cumsum([0, *step.num_scheduled_tokens])
        specs = step.prompt_logprobs
        index = np.concatenate([starts[row] + spec.first + np.arange(len(spec.targets))
                                for row, spec in specs.items()])
        targets = torch.tensor([t for spec in specs.values() for t in spec.targets],
                               device=self.device)
        index = torch.from_numpy(index).to(self.device)
        num_top = max(spec.num_top for spec in specs.values())
        parts = []
        for begin in range(0, len(index), PROMPT_LOGPROB_ROWS):
            rows = slice(begin, begin + PROMPT_LOGPROB_ROWS)
            logits = self.model.compute_logits(chunks[index[rows]])
            if self.rank == 0:
                parts.append(_logprobs_of(logits, targets[rows], num_top))
        if self.rank != 0:
            return {}
        merged = [torch.cat(column) for column in zip(*parts)]
        sizes = [len(spec.targets) for spec in specs.values()]
        per_row = zip(*(column.split(sizes) for column in merged))
        return {row: tuple(t[:, :spec.num_top] if t.dim() == 2 else t for t in tensors)
                for (row, spec), tensors in zip(specs.items(), per_row)}

    def _copy_blocks(self, copies: list[tuple[int, int]]):
        """KV (and fp8 scales) of block src into block dst, for each (src, dst): copy-on-write."""
        if not copies:
            return
        src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*copies))
        for pool in (self.kv_cache, self.kv_scales):  # [2, layers, blocks, ...]
            if pool is not None:
                pool[:, :, dst] = pool[:, :, src]

    def _sample(self, logits: torch.Tensor, sampling: StepSampling,
                seq_ids: list[int]) -> SamplerOutput:
        """A token per sampling row (`seq_ids`: their sequences, whose in-flight tokens penalties
        read on the device)."""
        def inflight_tokens(rows: list[int]) -> torch.Tensor:
            return self.inputs.inflight_tokens([seq_ids[row] for row in rows])

        if self.sampler_graphs is not None and self.sampler_graphs.applies(sampling):
            return self.sampler_graphs(logits, sampling, self.inputs.to_device, inflight_tokens,
                                       self.inputs.seed)
        meta = build_sampling_metadata(sampling, logits.shape[1], self.inputs.to_device,
                                       inflight_tokens, seed=self.inputs.seed)
        return self.sampler(logits, meta)


def _logprobs_of(logits: torch.Tensor, targets: torch.Tensor,
                 num_top: int) -> tuple[torch.Tensor, ...]:
    """logits [m, vocab] -> the targets' logprobs [m] and ranks [m], the top ids and logprobs."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top = logprobs.topk(num_top, dim=-1)
    return chosen.squeeze(1), ranks, top.indices, top.values


class PendingOutput:
    """A step's sampled tokens (and prompt logprobs), copied to the host behind its GPU work."""

    def __init__(self, output: SamplerOutput, channel: ShmChannel | None,
                 prompt: dict[int, tuple[torch.Tensor, ...]] | None = None):
        host = output.to_host()
        # Views of the host copies (pinned on CUDA), filled once the event has passed.
        self.output = StepOutput(*(None if t is None else t.numpy() for t in host.tensors()))
        for row, tensors in (prompt or {}).items():
            self.output.prompt_logprobs[row] = tuple(to_host(t).numpy() for t in tensors)
        self.event = None
        if output.token_ids.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()
        self.channel = channel

    def result(self) -> StepOutput:
        """Wait for the copies, checking that the workers live: a dead one would hang the step."""
        if self.event is not None:
            if self.channel is None:
                self.event.synchronize()
            else:
                next_check = time.monotonic() + WORKER_CHECK_SECONDS
                while not self.event.query():  # spin: a step takes milliseconds
                    if time.monotonic() > next_check:
                        self.channel.check_workers_alive()
                        next_check = time.monotonic() + WORKER_CHECK_SECONDS
        return self.output


def _dummy_prefill(lens: list[int], block_size: int) -> ScheduledStep:
    """A prefill of sequences of `lens` tokens for memory profiling, their slots all in block 0."""
    return ScheduledStep(True, list(range(len(lens))), [0] * sum(lens), list(lens),
                         [0] * len(lens), [[0] * -(-n // block_size) for n in lens],
                         [True] * len(lens))
