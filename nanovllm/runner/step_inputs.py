"""A step's inputs (token ids, positions, cache slots, attention metadata) on the device, by one
packed copy; a decode step's lands where its CUDA graph reads it."""

import numpy as np
import torch

from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.layers.attention import AttentionMetadata, dequantizing_pays, workspace_groups
from nanovllm.runner.cuda_graph import DecodeGraphs
from nanovllm.runner.host_to_device import pinned, to_device_packed
from nanovllm.runner.sampling_metadata import noise_seed


class StepInputs:
    """One per rank. Keeps the last step's sampled tokens on the device, where the next step,
    launched before they reach the host, reads them."""

    def __init__(self, device: torch.device, block_size: int, decode_order: bool):
        self.device = device
        self.block_size = block_size
        self.decode_order = decode_order  # AttentionMetadata.decode_order, for the Triton backend
        self.decode_temperatures = False  # pack them for decode graphs that sample
        self.dequant_workspace: torch.Tensor | None = None
        # One noise seed a step, whichever sampler runs it, so that each draws what another would.
        self.seed = 0
        self.last_tokens = torch.zeros(0, dtype=torch.int64, device=device)
        self.last_token_rows: dict[int, int] = {}

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        if self.device.type == "cuda":
            return pinned(array).to(self.device, non_blocking=True)
        return torch.from_numpy(array)

    @staticmethod
    def _block_tables(seqs: list[Sequence], rows: int | None = None,
                      width: int | None = None) -> np.ndarray:
        width = max(len(seq.block_table) for seq in seqs) if width is None else width
        tables = np.zeros((len(seqs) if rows is None else rows, width), dtype=np.int32)
        for i, seq in enumerate(seqs):
            tables[i, :len(seq.block_table)] = seq.block_table
        return tables

    def prepare_prefill(self, seqs: list[Sequence]):
        """The chunks' tokens flattened: (input_ids, positions, varlen meta, sample_rows), the rows
        of the sequences that complete their prefill. (Chunks hold no placeholder.) A sequence
        with no token to compute is a fork of the last one before it that has some (Scheduler):
        it samples from that one's last row."""
        self.seed = noise_seed()
        input_ids, positions, slots = [], [], []
        cu_q, cu_k, sample_rows = [0], [0], []
        computed = [seq for seq in seqs if seq.num_scheduled_tokens]
        for seq in seqs:
            if not seq.num_scheduled_tokens:
                sample_rows.append(cu_q[-1] - 1)
                continue
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
            "block_tables": self._block_tables(computed),
            "cu_seqlens_q": np.asarray(cu_q, dtype=np.int32), "cu_seqlens_k": cu_seqlens_k,
            "sample_rows": np.asarray(sample_rows, dtype=np.int64),
        }, self.to_device)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=device["slot_mapping"],
            context_lens=device["context_lens"],
            block_tables=device["block_tables"],
            cu_seqlens_q=device["cu_seqlens_q"],
            cu_seqlens_k=device["cu_seqlens_k"],
            max_seqlen_q=int(np.diff(cu_q).max()),
            max_seqlen_k=int(np.diff(cu_k).max()),
            prefix_cached=any(seq.num_cached_tokens > 0 for seq in computed),
        )
        workspace = self.dequant_workspace
        if workspace is not None and meta.prefix_cached and dequantizing_pays(cu_q, cu_k):
            meta.dequant_workspace = workspace
            meta.dequant_groups = workspace_groups(cu_q, cu_k, workspace.shape[1])
        return device["input_ids"], device["positions"], meta, device["sample_rows"]

    @staticmethod
    def fork_block_copies(seqs: list[Sequence]) -> list[tuple[int, int]]:
        """(source, destination) block ids: the last blocks that forks hold copies of."""
        copies, source = [], None
        for seq in seqs:
            if seq.num_scheduled_tokens:
                source = seq
            elif seq.block_table[-1] != source.block_table[-1]:
                copies.append((source.block_table[-1], seq.block_table[-1]))
        return copies

    def decode_rows(self, seqs: list[Sequence], rows: int,
                    table_width: int | None = None) -> dict[str, np.ndarray]:
        """A decode step's host arrays, one row per sequence, padded to `rows` (a graph's batch) by
        rows that write no slot and read no key; block tables [rows, table_width] last."""
        def padded(values: np.ndarray, fill: int) -> np.ndarray:
            if len(values) == rows:
                return values
            return np.concatenate([values, np.full(rows - len(values), fill, dtype=values.dtype)])

        positions = np.array([len(seq) - 1 for seq in seqs], dtype=np.int64)
        last_blocks = np.array([seq.block_table[-1] for seq in seqs], dtype=np.int64)
        context_lens = (positions + 1).astype(np.int32)
        input_ids = np.array([seq.scheduled_token_ids()[0] for seq in seqs], dtype=np.int64)
        slots = last_blocks * self.block_size + positions % self.block_size
        host = {"input_ids": padded(input_ids, 0), "positions": padded(positions, 0),
                "slot_mapping": padded(slots, -1), "context_lens": padded(context_lens, 0)}
        if self.decode_order:
            order = np.argsort(-context_lens, kind="stable").astype(np.int32)
            if rows > len(seqs):
                order = np.concatenate([order, np.arange(len(seqs), rows, dtype=np.int32)])
            host["decode_order"] = order
        if self.decode_temperatures:
            temperatures = np.array([seq.temperature for seq in seqs], dtype=np.float32)
            host["temperatures"] = padded(temperatures, 0)
            host["seed"] = np.array([self.seed], dtype=np.int64)
        host["block_tables"] = self._block_tables(seqs, rows, table_width)
        return host

    def prepare_decode(self, seqs: list[Sequence], graphs: DecodeGraphs | None = None):
        """(input_ids, positions, meta) on the device, where `graphs` read them; in-flight tokens
        are read from the previous step's, on the device."""
        self.seed = noise_seed()
        if graphs is not None:
            host = self.decode_rows(seqs, graphs.bucket(len(seqs)), graphs.max_blocks_per_seq)
        else:
            host = self.decode_rows(seqs, len(seqs))
        inflight = np.flatnonzero(host["input_ids"] == PLACEHOLDER)
        rows = self._rows_in_last_tokens([seqs[i] for i in inflight])
        # Steady decode (all in flight, same order) copies last_tokens' first rows: no indexing.
        in_order = inflight.size == len(seqs) and np.array_equal(rows, np.arange(len(seqs)))
        if inflight.size and not in_order:
            host["inflight"] = inflight.astype(np.int64)
            host["inflight_rows"] = rows
        device = to_device_packed(host, graphs.to_device if graphs is not None else self.to_device)
        meta = AttentionMetadata(is_prefill=False, slot_mapping=device["slot_mapping"],
                                 context_lens=device["context_lens"],
                                 block_tables=device["block_tables"],
                                 decode_order=device.get("decode_order"))
        input_ids = device["input_ids"]
        if in_order:
            input_ids[:len(seqs)].copy_(self.last_tokens[:len(seqs)])
        elif inflight.size:
            input_ids[device["inflight"]] = self.last_tokens[device["inflight_rows"]]
        return input_ids, device["positions"], meta

    def keep_sampled(self, tokens: torch.Tensor, seqs: list[Sequence]):
        self.last_tokens = tokens
        self.last_token_rows = {seq.seq_id: row for row, seq in enumerate(seqs)}

    def inflight_tokens(self, seqs: list[Sequence]) -> torch.Tensor:
        return self.last_tokens[self.to_device(self._rows_in_last_tokens(seqs))]

    def _rows_in_last_tokens(self, seqs: list[Sequence]) -> np.ndarray:
        return np.array([self.last_token_rows[seq.seq_id] for seq in seqs], dtype=np.int64)
