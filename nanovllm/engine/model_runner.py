"""One ModelRunner per tensor-parallel rank: owns the model shard, the KV pool and the step inputs.

Rank 0 lives in the engine's process and samples; ranks 1.. are spawned workers that loop on calls
received over shared memory (`ShmChannel`). Every rank runs every call, so collectives line up.
"""

import os
import socket
import time
from contextlib import contextmanager
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import Config, head_dim
from nanovllm.engine.cuda_graph import DecodeGraphs, SamplerGraphs
from nanovllm.engine.host_to_device import to_device_packed
from nanovllm.engine.sampling_metadata import ALL_CONTROLS, build_sampling_metadata
from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.engine.shm_channel import ShmChannel, WorkerEnd
from nanovllm.layers.attention import AttentionMetadata, dequantizing_pays, workspace_groups
from nanovllm.layers.sampler import Sampler, SamplerOutput
from nanovllm.models import model_class
from nanovllm.utils.loader import load_model

CPU_KV_CACHE_BYTES = 2 << 30  # KV pool budget on CPU when num_kvcache_blocks is not given
WORKER_CHECK_SECONDS = 0.01  # while rank 0 waits for a step, how often it checks that the workers live


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


def run_worker(config: Config, rank: int, port: int, channel: WorkerEnd):
    """Entry point of a spawned worker rank: serve calls until `exit`."""
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
            self.model = model_class(hf)(hf, config.attention_backend)
        load_model(self.model, config.model)
        self.sampler = Sampler()
        self.num_kv_heads = hf.num_key_value_heads // self.world_size
        self.head_dim = head_dim(hf)
        self.num_kvcache_blocks = self._allocate_kv_cache()
        # The last step's sampled tokens, left on the device (and on every rank): the next step may be
        # launched before they reach the host, and then takes its input tokens from here.
        self.last_tokens = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.last_token_rows: dict[int, int] = {}  # seq_id -> row in last_tokens
        self.graphs = self.sampler_graphs = None
        if is_cuda and not config.enforce_eager:
            self.graphs = DecodeGraphs(self, config.max_num_seqs, self.max_blocks_per_seq)
            if rank == 0:
                self.sampler_graphs = SamplerGraphs(self.sampler, config.max_num_seqs)

    def _init_process_group(self, port: int):
        """Rendezvous over a TCP store on this engine's own port. Rank 0 waits for the workers to
        check in while watching them, so a worker that dies during start-up is an error, not a hang."""
        store = dist.TCPStore("127.0.0.1", port, self.world_size, is_master=self.rank == 0,
                              wait_for_workers=False, timeout=timedelta(minutes=10))
        if self.rank == 0:
            while store.add("workers_ready", 0) < self.world_size - 1:
                self.channel.check_workers_alive()
                time.sleep(0.05)
        else:
            store.add("workers_ready", 1)
        is_cuda = self.device.type == "cuda"
        dist.init_process_group("nccl" if is_cuda else "gloo", store=store, world_size=self.world_size,
                                rank=self.rank, device_id=self.device if is_cuda else None)

    @property
    def max_blocks_per_seq(self) -> int:
        return (self.config.max_model_len + self.block_size - 1) // self.block_size

    def call(self, method: str, *args):
        """Run `method` on every rank (rank 0 only: also sends it to the workers). Returns rank 0's result."""
        if self.channel is not None:
            self.channel.send(method, *args)
        return getattr(self, method)(*args)

    def exit(self):
        for graphs in (self.graphs, self.sampler_graphs):
            if graphs is not None:
                graphs.release()
        self.graphs = self.sampler_graphs = None
        # Free the GPU memory even if the engine object lives on.
        self.model = self.kv_cache = self.kv_scales = self.dequant_workspace = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        dist.destroy_process_group()

    # ---- KV cache ------------------------------------------------------------------------------

    def _allocate_kv_cache(self) -> int:
        """Allocate [2, layers, blocks, block_size, kv_heads, head_dim] and hand each layer its views (an
        fp8 V cache viewed [blocks, kv_heads, head_dim, block_size]); with an fp8 cache also the scales,
        [2, layers, blocks, kv_heads, block_size] float32."""
        hf = self.config.hf_config
        cache_dtype = self.config.kv_cache_torch_dtype
        fp8 = cache_dtype == torch.float8_e4m3fn
        # Before the pool is sized, so the profile counts it: where prefill dequantizes an fp8 prefix
        # (attention.triton_attention). Any one context fits (max_model_len), and a full batch of prompts.
        self.dequant_workspace = None
        if fp8 and self.config.attention_backend == "triton":
            capacity = max(self.config.max_model_len, self.config.max_num_batched_tokens)
            self.dequant_workspace = torch.empty(2, capacity, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                                                 device=self.device)
        token_bytes = self.num_kv_heads * (self.head_dim * cache_dtype.itemsize + (4 if fp8 else 0))
        block_bytes = 2 * hf.num_hidden_layers * self.block_size * token_bytes
        if self.config.num_kvcache_blocks > 0:
            num_blocks = self.config.num_kvcache_blocks
        elif self.device.type == "cuda":
            num_blocks = self._profile_free_memory() // block_bytes
        else:
            num_blocks = CPU_KV_CACHE_BYTES // block_bytes
        # Every rank must agree on the pool size: take the smallest.
        agreed = torch.tensor([num_blocks], device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        num_blocks = int(agreed.item())
        if num_blocks <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache (one block of {self.block_size} tokens needs "
                f"{block_bytes / 2**20:.1f} MiB) at gpu_memory_utilization={self.config.gpu_memory_utilization}; "
                f"raise it or lower max_num_batched_tokens / max_num_seqs")
        shape = (2, hf.num_hidden_layers, num_blocks)
        # An fp8 cache must hold no NaN, not even in slots never written (attention.py): zeroed.
        new_pool = torch.zeros if fp8 else torch.empty
        self.kv_cache = new_pool(*shape, self.block_size, self.num_kv_heads, self.head_dim, dtype=cache_dtype,
                                 device=self.device)
        # kv_heads before block_size: an attention tile reads its KV head's scales as one contiguous run.
        self.kv_scales = torch.empty(*shape, self.num_kv_heads, self.block_size, dtype=torch.float32,
                                     device=self.device) if fp8 else None
        attention_layers = [m for m in self.model.modules() if hasattr(m, "k_cache")]
        for i, layer in enumerate(attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            if fp8:  # V tokens contiguous (attention.py)
                layer.v_cache = layer.v_cache.view(num_blocks, self.num_kv_heads, self.head_dim, self.block_size)
                layer.k_scale, layer.v_scale = self.kv_scales[0, i], self.kv_scales[1, i]
        return num_blocks

    def _profile_free_memory(self) -> int:
        """Run the largest prefill (and the largest sampling batch) to measure peak activation memory;
        return the bytes left for the KV cache under gpu_memory_utilization."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        num_tokens = self.config.max_num_batched_tokens
        lens = [min(self.config.max_model_len, num_tokens - i) for i in range(0, num_tokens, self.config.max_model_len)]
        seqs = [_dummy_sequence(n, self.block_size) for n in lens]
        input_ids, positions, meta, _ = self.prepare_prefill(seqs)
        hidden = self.model(input_ids, positions, meta)
        rows = hidden[-1:].expand(self.config.max_num_seqs, -1)
        logits = self.model.compute_logits(rows)
        if self.rank == 0:
            profiled = [Sequence([0], ALL_CONTROLS, self.block_size)] * len(rows)  # the most memory-hungry path
            self.sampler(logits, build_sampling_metadata(profiled, logits.shape[1], self._to_device))
        del hidden, rows, logits
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        used_outside_peak = total - free - current  # other processes, CUDA context, allocator cache
        return int(total * self.config.gpu_memory_utilization - used_outside_peak - peak)

    # ---- step inputs ---------------------------------------------------------------------------

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def _block_tables(self, seqs: list[Sequence]) -> np.ndarray:
        width = max(len(seq.block_table) for seq in seqs)
        tables = np.zeros((len(seqs), width), dtype=np.int32)
        for i, seq in enumerate(seqs):
            tables[i, :len(seq.block_table)] = seq.block_table
        return tables

    def prepare_prefill(self, seqs: list[Sequence]):
        """Flattened chunk tokens of all sequences, their positions and cache slots, and the varlen
        metadata. Returns (input_ids, positions, meta, sample_rows) where sample_rows index the last
        token of every sequence whose prefill completes in this step."""
        input_ids, positions, slots = [], [], []
        cu_q, cu_k, sample_rows = [0], [0], []
        for seq in seqs:
            start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
            pos = np.arange(start, end)
            table = np.asarray(seq.block_table, dtype=np.int64)
            input_ids.append(np.asarray(seq.scheduled_token_ids(), dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            cu_q.append(cu_q[-1] + end - start)
            cu_k.append(cu_k[-1] + end)
            if seq.completes_prefill:
                sample_rows.append(cu_q[-1] - 1)
        cu_seqlens_k = np.asarray(cu_k, dtype=np.int32)
        device = to_device_packed({
            "input_ids": np.concatenate(input_ids), "positions": np.concatenate(positions),
            "slot_mapping": np.concatenate(slots), "context_lens": np.diff(cu_seqlens_k),
            "block_tables": self._block_tables(seqs), "cu_seqlens_q": np.asarray(cu_q, dtype=np.int32),
            "cu_seqlens_k": cu_seqlens_k, "sample_rows": np.asarray(sample_rows, dtype=np.int64),
        }, self._to_device)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=device["slot_mapping"],
            context_lens=device["context_lens"],
            block_tables=device["block_tables"],
            cu_seqlens_q=device["cu_seqlens_q"],
            cu_seqlens_k=device["cu_seqlens_k"],
            max_seqlen_q=int(np.diff(cu_q).max()),
            max_seqlen_k=int(np.diff(cu_k).max()),
            prefix_cached=any(seq.num_cached_tokens > 0 for seq in seqs),
        )
        if self.dequant_workspace is not None and meta.prefix_cached and dequantizing_pays(cu_q, cu_k):
            meta.dequant_workspace = self.dequant_workspace
            meta.dequant_groups = workspace_groups(cu_q, cu_k, self.dequant_workspace.shape[1])
        return device["input_ids"], device["positions"], meta, device["sample_rows"]

    def decode_rows(self, seqs: list[Sequence], rows: int) -> dict[str, np.ndarray]:
        """A decode step's per-row inputs: one token per sequence, its last at position len - 1, then padding
        up to `rows` rows (a CUDA graph's batch size), which hold token 0 at position 0, write no cache slot
        and read no key, and keep their place in the decode order (the Triton backend's)."""
        def padded(values: np.ndarray, fill: int) -> np.ndarray:
            return np.concatenate([values, np.full(rows - len(values), fill, dtype=values.dtype)])

        positions = np.array([len(seq) - 1 for seq in seqs], dtype=np.int64)
        last_blocks = np.array([seq.block_table[-1] for seq in seqs], dtype=np.int64)
        context_lens = (positions + 1).astype(np.int32)
        host = {"input_ids": padded(np.array([seq.scheduled_token_ids()[0] for seq in seqs], dtype=np.int64), 0),
                "positions": padded(positions, 0),
                "slot_mapping": padded(last_blocks * self.block_size + positions % self.block_size, -1),
                "context_lens": padded(context_lens, 0)}
        if self.config.attention_backend == "triton":
            order = np.argsort(-context_lens, kind="stable").astype(np.int32)
            host["decode_order"] = np.concatenate([order, np.arange(len(seqs), rows, dtype=np.int32)])
        return host

    def prepare_decode(self, seqs: list[Sequence], graphs: DecodeGraphs | None = None):
        """The decode inputs of `seqs` on the device by one copy; with `graphs`, padded to the bucket's rows,
        where its graph reads them. A last token still in flight (a placeholder) is the previous step's
        sampled token, read on the device."""
        host = self.decode_rows(seqs, graphs.bucket(len(seqs)) if graphs is not None else len(seqs))
        host["block_tables"] = self._block_tables(seqs)
        inflight = np.flatnonzero(host["input_ids"] == PLACEHOLDER)
        if inflight.size:  # their rows in this step, and in last_tokens
            host["inflight"] = inflight.astype(np.int64)
            host["inflight_rows"] = np.array([self.last_token_rows[seqs[i].seq_id] for i in inflight], dtype=np.int64)
        device = to_device_packed(host, graphs.to_device if graphs is not None else self._to_device)
        meta = AttentionMetadata(is_prefill=False, slot_mapping=device["slot_mapping"],
                                 context_lens=device["context_lens"], block_tables=device["block_tables"],
                                 decode_order=device.get("decode_order"))
        input_ids = device["input_ids"]
        if inflight.size:
            input_ids[device["inflight"]] = self.last_tokens[device["inflight_rows"]]
        return input_ids, device["positions"], meta

    def _inflight_tokens(self, seqs: list[Sequence]) -> torch.Tensor:
        """The tokens the previous step sampled for `seqs`, read on the device."""
        rows = np.array([self.last_token_rows[seq.seq_id] for seq in seqs], dtype=np.int64)
        return self.last_tokens[self._to_device(rows)]

    # ---- the step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> "PendingOutput | None":
        """Launch one step without waiting for it. On rank 0, return its sampled tokens (one per
        sequence that completes its prefill; every sequence in decode) on their way to the host."""
        if is_prefill:
            # Prefill chunks hold no placeholder: a preempted sequence is re-prefilled only after the
            # step that sampled its last token has been postprocessed.
            input_ids, positions, meta, sample_rows = self.prepare_prefill(seqs)
            hidden = self.model(input_ids, positions, meta)[sample_rows]
            sampling_seqs = [seq for seq in seqs if seq.completes_prefill]
        else:
            graphs = self.graphs if self.graphs is not None and len(seqs) <= self.graphs.max_batch_size else None
            input_ids, positions, meta = self.prepare_decode(seqs, graphs)
            hidden = graphs.replay(meta) if graphs is not None else self.model(input_ids, positions, meta)
            sampling_seqs = seqs
        logits = self.model.compute_logits(hidden)
        if not sampling_seqs:
            return None
        if self.rank == 0:
            output = self._sample(logits, sampling_seqs)
            tokens = output.token_ids
        else:
            tokens = torch.empty(len(sampling_seqs), dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            dist.broadcast(tokens, src=0)
        self.last_tokens = tokens
        self.last_token_rows = {seq.seq_id: row for row, seq in enumerate(sampling_seqs)}
        return PendingOutput(output, self.channel) if self.rank == 0 else None

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Rank 0: a token per sequence."""
        if self.sampler_graphs is not None:
            return self.sampler_graphs(logits, seqs, self._to_device, self._inflight_tokens)
        return self.sampler(logits, build_sampling_metadata(seqs, logits.shape[1], self._to_device,
                                                            self._inflight_tokens))


class PendingOutput:
    """A step's sampled tokens, copied to the host behind the step's GPU work."""

    def __init__(self, output: SamplerOutput, channel: ShmChannel | None):
        self.output = output.to_host()
        self.event = None
        if output.token_ids.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()
        self.channel = channel

    def result(self) -> SamplerOutput:
        """Wait for the copies. With workers, keep checking they live: one that died leaves rank 0's
        NCCL collectives, hence this step, waiting forever."""
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


def _dummy_sequence(num_tokens: int, block_size: int) -> Sequence:
    """A sequence shaped like a real prefill (for memory profiling); its slots all point at block 0."""
    from nanovllm.sampling_params import SamplingParams

    seq = Sequence([0] * num_tokens, SamplingParams(), block_size)
    seq.block_table = [0] * seq.num_blocks
    seq.num_scheduled_tokens = num_tokens
    return seq

