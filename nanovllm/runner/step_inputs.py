"""A step's inputs (token ids, positions, cache slots, attention metadata) on the device, by one
packed copy; a decode step's lands where its CUDA graph reads it."""

import numpy as np
import torch

from nanovllm.layers.attention import AttentionMetadata, dequantizing_pays, workspace_groups
from nanovllm.runner.cuda_graph import DecodeGraphs
from nanovllm.runner.host_to_device import pinned, to_device_packed
from nanovllm.runner.sampling_metadata import noise_seed
from nanovllm.step import PLACEHOLDER, ScheduledStep


class StepInputs:
    """One per rank. Keeps the last step's sampled tokens on the device, where the next step,
    launched before they reach the host, reads them."""

    def __init__(self, device: torch.device, block_size: int, decode_order: bool,
                 decode_temperatures: bool = False,
                 dequant_workspace: torch.Tensor | None = None):
        self.device = device
        self.block_size = block_size
        self.decode_order = decode_order  # AttentionMetadata.decode_order, for the Triton backend
        self.decode_temperatures = decode_temperatures  # packed for decode graphs that sample
        # [2, tokens, kv_heads, head_dim]: where prefill dequantizes an fp8 prefix (Triton backend)
        self.dequant_workspace = dequant_workspace
        # One noise seed a step, whichever sampler runs it, so that each draws what another would.
        self.seed = 0
        self.last_tokens = torch.zeros(0, dtype=torch.int64, device=device)
        self.last_token_rows: dict[int, int] = {}

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        if self.device.type == "cuda":
            return pinned(array).to(self.device, non_blocking=True)
        return torch.from_numpy(array)

    @staticmethod
    def _block_tables(block_tables: list[list[int]], rows: int | None = None,
                      width: int | None = None) -> np.ndarray:
        width = max(len(table) for table in block_tables) if width is None else width
        tables = np.zeros((len(block_tables) if rows is None else rows, width), dtype=np.int32)
        for i, table in enumerate(block_tables):
            tables[i, :len(table)] = table
        return tables

    def prepare_prefill(self, step: ScheduledStep):
        """The chunks' tokens flattened: (input_ids, positions, varlen meta, sample_rows), the last
        token of each sampling row's chunk (a fork's: its prompt's). Chunks hold no placeholder."""
        self.seed = noise_seed()
        positions, slots, computed = [], [], []
        cu_q, cu_k, last = [0], [0], []  # last: each row's last token in the flattened chunks
        rows = zip(step.num_computed_tokens, step.num_scheduled_tokens, step.block_tables)
        for row, (start, num_scheduled, table) in enumerate(rows):
            if num_scheduled:
                end = start + num_scheduled
                pos = np.arange(start, end)
                table = np.asarray(table, dtype=np.int64)
                positions.append(pos)
                slots.append(table[pos // self.block_size] * self.block_size
                             + pos % self.block_size)
                cu_q.append(cu_q[-1] + num_scheduled)
                cu_k.append(cu_k[-1] + end)
                computed.append(row)
            last.append(cu_q[-1] - 1)
        sample_rows = [last[step.forks.get(row, row)]
                       for row, samples in enumerate(step.samples) if samples]
        cu_seqlens_k = np.asarray(cu_k, dtype=np.int32)
        device = to_device_packed({
            "input_ids": np.asarray(step.token_ids, dtype=np.int64),
            "positions": np.concatenate(positions),
            "slot_mapping": np.concatenate(slots), "context_lens": np.diff(cu_seqlens_k),
            "block_tables": self._block_tables([step.block_tables[row] for row in computed]),
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
            prefix_cached=any(step.num_computed_tokens[row] > 0 for row in computed),
        )
        workspace = self.dequant_workspace
        if workspace is not None and meta.prefix_cached and dequantizing_pays(cu_q, cu_k):
            meta.dequant_workspace = workspace
            meta.dequant_groups = workspace_groups(cu_q, cu_k, workspace.shape[1])
        return device["input_ids"], device["positions"], meta, device["sample_rows"]

    @staticmethod
    def fork_block_copies(step: ScheduledStep) -> list[tuple[int, int]]:
        """(source, destination) block ids: the last blocks that forks hold copies of."""
        tables = step.block_tables
        return [(tables[prompt][-1], tables[fork][-1]) for fork, prompt in step.forks.items()
                if tables[fork][-1] != tables[prompt][-1]]

    def decode_rows(self, step: ScheduledStep, rows: int,
                    table_width: int | None = None) -> dict[str, np.ndarray]:
        """A decode step's host arrays, one row per sequence, padded to `rows` (a graph's batch) by
        rows that write no slot and read no key; block tables [rows, table_width] last."""
        def padded(values: np.ndarray, fill: int) -> np.ndarray:
            if len(values) == rows:
                return values
            return np.concatenate([values, np.full(rows - len(values), fill, dtype=values.dtype)])

        num_seqs = len(step)
        # A decode row computes one token, at position num_computed_tokens, over the KV before
        # it (a sequence's last token; or a draft's token, in a block past the last one's).
        positions = np.array(step.num_computed_tokens, dtype=np.int64)
        blocks = np.array([table[p // self.block_size] for table, p
                           in zip(step.block_tables, step.num_computed_tokens)], dtype=np.int64)
        context_lens = (positions + 1).astype(np.int32)
        input_ids = np.array(step.token_ids, dtype=np.int64)
        slots = blocks * self.block_size + positions % self.block_size
        host = {"input_ids": padded(input_ids, 0), "positions": padded(positions, 0),
                "slot_mapping": padded(slots, -1), "context_lens": padded(context_lens, 0)}
        if self.decode_order:
            order = np.argsort(-context_lens, kind="stable").astype(np.int32)
            if rows > num_seqs:
                order = np.concatenate([order, np.arange(num_seqs, rows, dtype=np.int32)])
            host["decode_order"] = order
        if self.decode_temperatures:
            requests = step.sampling.requests if step.sampling is not None else []
            temperatures = np.array([r.params.temperature for r in requests], dtype=np.float32)
            host["temperatures"] = padded(temperatures, 0)
            host["seed"] = np.array([self.seed], dtype=np.int64)
        host["block_tables"] = self._block_tables(step.block_tables, rows, table_width)
        return host

    def prepare_decode(self, step: ScheduledStep, graphs: DecodeGraphs | None = None):
        """(input_ids, positions, meta) on the device, where `graphs` read them; in-flight tokens
        are read from the previous step's, on the device."""
        self.seed = noise_seed()
        if graphs is not None:
            host = self.decode_rows(step, graphs.bucket(len(step)), graphs.max_blocks_per_seq)
        else:
            host = self.decode_rows(step, len(step))
        num_seqs = len(step)
        inflight = np.flatnonzero(host["input_ids"] == PLACEHOLDER)
        rows = self._rows_in_last_tokens([step.seq_ids[i] for i in inflight])
        # Steady decode (all in flight, same order) copies last_tokens' first rows: no indexing.
        in_order = inflight.size == num_seqs and np.array_equal(rows, np.arange(num_seqs))
        if inflight.size and not in_order:
            host["inflight"] = inflight.astype(np.int64)
            host["inflight_rows"] = rows
        device = to_device_packed(host, graphs.to_device if graphs is not None else self.to_device)
        meta = AttentionMetadata(is_prefill=False, slot_mapping=device["slot_mapping"],
                                 context_lens=device["context_lens"],
                                 block_tables=device["block_tables"],
                                 decode_order=device.get("decode_order"),
                                 rows_share_sequences=step.verify)
        input_ids = device["input_ids"]
        if in_order:
            input_ids[:num_seqs].copy_(self.last_tokens[:num_seqs])
        elif inflight.size:
            input_ids[device["inflight"]] = self.last_tokens[device["inflight_rows"]]
        return input_ids, device["positions"], meta

    def keep_sampled(self, tokens: torch.Tensor, seq_ids: list[int]):
        """The step's tokens [rows] on the device, of the sequences `seq_ids` in row order."""
        self.last_tokens = tokens
        self.last_token_rows = {seq_id: row for row, seq_id in enumerate(seq_ids)}

    def inflight_tokens(self, seq_ids: list[int]) -> torch.Tensor:
        """The last step's tokens [len(seq_ids)] of these sequences, on the device."""
        return self.last_tokens[self.to_device(self._rows_in_last_tokens(seq_ids))]

    def _rows_in_last_tokens(self, seq_ids: list[int]) -> np.ndarray:
        return np.array([self.last_token_rows[seq_id] for seq_id in seq_ids], dtype=np.int64)
