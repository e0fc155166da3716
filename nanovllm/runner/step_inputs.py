"""A step's inputs on the device, built from the scheduled sequences: token ids, positions, cache slots and
the attention metadata, all by one packed host-to-device copy (host_to_device.py). A decode step's copy
goes where its CUDA graph reads it (cuda_graph.DecodeGraphs)."""

import numpy as np
import torch

from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.layers.attention import AttentionMetadata, dequantizing_pays, workspace_groups
from nanovllm.runner.cuda_graph import DecodeGraphs
from nanovllm.runner.host_to_device import pinned, to_device_packed
from nanovllm.sampling.metadata import noise_seed


class StepInputs:
    """One per rank. Also keeps the last step's sampled tokens on the device: the next step may be launched
    before they reach the host, and then reads its input tokens (and the sampler its penalty histories)
    from there."""

    def __init__(self, device: torch.device, block_size: int, decode_order: bool):
        self.device = device
        self.block_size = block_size
        self.decode_order = decode_order  # build AttentionMetadata.decode_order (the Triton backend)
        # Pack each decode row's temperature too, for decode graphs that sample (cuda_graph.DecodeGraphs).
        self.decode_temperatures = False
        # Where prefill over an fp8 prefix dequantizes it (attention.triton_attention), or None.
        self.dequant_workspace: torch.Tensor | None = None
        # The step's noise seed (SamplingMetadata.seed), one drawn by each prepare_* call, whichever sampler
        # runs the step (a head graph, the eager sampler or a sampler graph), so that each draws what another would.
        self.seed = 0
        self.last_tokens = torch.zeros(0, dtype=torch.int64, device=device)
        self.last_token_rows: dict[int, int] = {}  # seq_id -> row in last_tokens

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        if self.device.type == "cuda":
            return pinned(array).to(self.device, non_blocking=True)
        return torch.from_numpy(array)

    @staticmethod
    def _block_tables(seqs: list[Sequence], rows: int | None = None, width: int | None = None) -> np.ndarray:
        """The sequences' block tables, zero-padded to `rows` rows and `width` blocks (default: theirs)."""
        width = max(len(seq.block_table) for seq in seqs) if width is None else width
        tables = np.zeros((len(seqs) if rows is None else rows, width), dtype=np.int32)
        for i, seq in enumerate(seqs):
            tables[i, :len(seq.block_table)] = seq.block_table
        return tables

    def prepare_prefill(self, seqs: list[Sequence]):
        """Flattened chunk tokens of all sequences, their positions and cache slots, and the varlen
        metadata. Returns (input_ids, positions, meta, sample_rows) where sample_rows index the last
        token of every sequence whose prefill completes in this step. Prefill chunks hold no placeholder:
        a preempted sequence is re-prefilled only after the step that sampled its last token has been
        postprocessed."""
        self.seed = noise_seed()
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
            prefix_cached=any(seq.num_cached_tokens > 0 for seq in seqs),
        )
        if self.dequant_workspace is not None and meta.prefix_cached and dequantizing_pays(cu_q, cu_k):
            meta.dequant_workspace = self.dequant_workspace
            meta.dequant_groups = workspace_groups(cu_q, cu_k, self.dequant_workspace.shape[1])
        return device["input_ids"], device["positions"], meta, device["sample_rows"]

    def decode_rows(self, seqs: list[Sequence], rows: int, table_width: int | None = None) -> dict[str, np.ndarray]:
        """A decode step's per-row inputs: one token per sequence, its last at position len - 1, then padding
        up to `rows` rows (a CUDA graph's batch size), which hold token 0 at position 0, write no cache slot
        and read no key, and keep their place in the decode order; with decode_temperatures, each row's
        temperature (the padding rows greedy) and the step's noise seed; last, the block tables [rows,
        table_width] (a CUDA graph's: its widest, so that they land where it reads them; None: the longest's)."""
        def padded(values: np.ndarray, fill: int) -> np.ndarray:
            if len(values) == rows:
                return values
            return np.concatenate([values, np.full(rows - len(values), fill, dtype=values.dtype)])

        positions = np.array([len(seq) - 1 for seq in seqs], dtype=np.int64)
        last_blocks = np.array([seq.block_table[-1] for seq in seqs], dtype=np.int64)
        context_lens = (positions + 1).astype(np.int32)
        host = {"input_ids": padded(np.array([seq.scheduled_token_ids()[0] for seq in seqs], dtype=np.int64), 0),
                "positions": padded(positions, 0),
                "slot_mapping": padded(last_blocks * self.block_size + positions % self.block_size, -1),
                "context_lens": padded(context_lens, 0)}
        if self.decode_order:
            order = np.argsort(-context_lens, kind="stable").astype(np.int32)
            if rows > len(seqs):  # the padding rows keep their place
                order = np.concatenate([order, np.arange(len(seqs), rows, dtype=np.int32)])
            host["decode_order"] = order
        if self.decode_temperatures:
            host["temperatures"] = padded(np.array([seq.temperature for seq in seqs], dtype=np.float32), 0)
            host["seed"] = np.array([self.seed], dtype=np.int64)
        host["block_tables"] = self._block_tables(seqs, rows, table_width)
        return host

    def prepare_decode(self, seqs: list[Sequence], graphs: DecodeGraphs | None = None):
        """The decode inputs of `seqs` (input_ids, positions, meta) on the device; with `graphs`, padded to
        the bucket's rows, where its graph reads them. A last token still in flight (a placeholder) is the
        previous step's sampled token, read on the device."""
        self.seed = noise_seed()
        if graphs is not None:
            host = self.decode_rows(seqs, graphs.bucket(len(seqs)), graphs.max_blocks_per_seq)
        else:
            host = self.decode_rows(seqs, len(seqs))
        inflight = np.flatnonzero(host["input_ids"] == PLACEHOLDER)
        rows = self._rows_in_last_tokens([seqs[i] for i in inflight])  # in last_tokens
        # Steady decode: every token in flight and the rows in the previous step's order, so one copy of the
        # first rows of last_tokens fills them in, not an indexed read and write (less host time a step).
        in_order = inflight.size == len(seqs) and np.array_equal(rows, np.arange(len(seqs)))
        if inflight.size and not in_order:  # their rows in this step, and in last_tokens
            host["inflight"] = inflight.astype(np.int64)
            host["inflight_rows"] = rows
        device = to_device_packed(host, graphs.to_device if graphs is not None else self.to_device)
        meta = AttentionMetadata(is_prefill=False, slot_mapping=device["slot_mapping"],
                                 context_lens=device["context_lens"], block_tables=device["block_tables"],
                                 decode_order=device.get("decode_order"))
        input_ids = device["input_ids"]
        if in_order:
            input_ids[:len(seqs)].copy_(self.last_tokens[:len(seqs)])
        elif inflight.size:
            input_ids[device["inflight"]] = self.last_tokens[device["inflight_rows"]]
        return input_ids, device["positions"], meta

    def keep_sampled(self, tokens: torch.Tensor, seqs: list[Sequence]):
        """Keep a step's sampled tokens [len(seqs)], on the device, for the next step's in-flight inputs."""
        self.last_tokens = tokens
        self.last_token_rows = {seq.seq_id: row for row, seq in enumerate(seqs)}

    def inflight_tokens(self, seqs: list[Sequence]) -> torch.Tensor:
        """The tokens the previous step sampled for `seqs`, read on the device."""
        return self.last_tokens[self.to_device(self._rows_in_last_tokens(seqs))]

    def _rows_in_last_tokens(self, seqs: list[Sequence]) -> np.ndarray:
        return np.array([self.last_token_rows[seq.seq_id] for seq in seqs], dtype=np.int64)
