"""Step inputs reach the device by one copy: packed, then viewed back in their dtypes and shapes."""

import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.scheduler import scheduled_step
from nanovllm.engine.sequence import Sequence
from nanovllm.runner.cuda_graph import batch_buckets, decode_inputs_bytes, smallest_bucket
from nanovllm.runner.host_to_device import ALIGNMENT, to_device_packed
from nanovllm.runner.step_inputs import StepInputs
from nanovllm.step import PLACEHOLDER, ScheduledStep


def test_packed_arrays_come_back_equal_and_aligned():
    arrays = {"ids": np.arange(3, dtype=np.int64), "lens": np.array([5, 7, 9], dtype=np.int32),
              "table": np.arange(10, dtype=np.int32).reshape(2, 5),
              "empty": np.zeros(0, dtype=np.int64),
              "temperatures": np.array([0.5], dtype=np.float32),
              "last": np.array([-1, 2], dtype=np.int64)}
    copies = []

    def to_device(array):
        copies.append(array)
        return torch.from_numpy(array)

    device = to_device_packed(arrays, to_device)
    assert len(copies) == 1
    base = copies[0].ctypes.data
    for name, array in arrays.items():
        assert device[name].dtype == torch.from_numpy(array).dtype
        assert device[name].shape == array.shape
        assert np.array_equal(device[name].numpy(), array), name
        assert (device[name].data_ptr() - base) % ALIGNMENT == 0, name
    assert copies[0].nbytes == 32 + 16 + 48 + 0 + 16 + 16  # each array's bytes rounded up to 16


def test_a_step_copies_its_inputs_to_the_device_once(tiny_model, prompts):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64,
             attention_backend="triton") as llm:
        inputs, graphs = llm.llm_engine.model_runner.inputs, llm.llm_engine.model_runner.graphs
        copies, steps = [], []
        # Every copy, by the inputs' to_device or, in a decode step with graphs, by the graphs'.
        for copier in (inputs, graphs) if graphs is not None else (inputs,):
            to_device = copier.to_device
            copier.to_device = (lambda array, to_device=to_device:
                                copies.append(array.shape) or to_device(array))
        for name in ("prepare_prefill", "prepare_decode"):
            prepare = getattr(inputs, name)

            def spy(*args, prepare=prepare, name=name):
                before = len(copies)
                result = prepare(*args)
                steps.append((name, len(copies) - before))
                return result

            setattr(inputs, name, spy)
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate(prompts[:2], params, use_tqdm=False)
    assert ("prepare_prefill", 1) in steps and ("prepare_decode", 1) in steps
    assert all(count == 1 for _, count in steps)


@pytest.mark.parametrize("temperatures", [False, True])
def test_decode_rows_are_padded_where_a_graph_reads_them(tiny_model, temperatures):
    """A step's rows, padded to a graph's R rows, land at the offsets that R padding rows had at
    capture (temperatures and seed too, when graphs sample; block tables last, 3 wide)."""
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64,
             attention_backend="triton") as llm:
        inputs = StepInputs(torch.device("cpu"), 16, decode_order=True,
                            decode_temperatures=temperatures)
        inputs.seed = 12345
        params = [SamplingParams(temperature=0.5), SamplingParams(temperature=0)]
        requests = llm.make_requests([[5, 6, 7], list(range(1, 21))], params)
        seqs = llm.llm_engine.add(requests)
        for block, seq in enumerate(seqs):  # as the scheduler leaves them for a decode step
            seq.block_table = [2 * block + 1, 2 * block + 2][:seq.num_blocks]
            seq.num_cached_tokens, seq.num_scheduled_tokens = len(seq) - 1, 1
        rows = inputs.decode_rows(scheduled_step(seqs, is_prefill=False), 4, 3)
        capture = inputs.decode_rows(ScheduledStep(is_prefill=False), 4, 3)

    assert {name: array.tolist() for name, array in rows.items()} == {
        "input_ids": [7, 20, 0, 0], "positions": [2, 19, 0, 0],
        "slot_mapping": [1 * 16 + 2, 4 * 16 + 3, -1, -1],
        "context_lens": [3, 20, 0, 0], "decode_order": [1, 0, 2, 3],
        **({"temperatures": [0.5, 0, 0, 0], "seed": [12345]} if temperatures else {}),
        "block_tables": [[1, 0, 0], [3, 4, 0], [0, 0, 0], [0, 0, 0]]}
    def layout(arrays):
        return [(a.dtype, a.shape) for a in arrays.values()]

    assert layout(rows) == layout(capture)

    def offsets(arrays):
        buffer = []
        views = to_device_packed(arrays, lambda packed: buffer.append(packed)
                                 or torch.from_numpy(packed))
        return {name: views[name].data_ptr() - buffer[0].ctypes.data for name in capture}

    step = {**rows, "inflight": np.arange(2)}
    assert offsets(step) == offsets(capture)


def in_flight_decode_batch(num_seqs: int, blocks_per_seq: int = 1,
                           block_size: int = 16) -> list[Sequence]:
    """Decode sequences of blocks_per_seq full blocks each, each last token still in flight."""
    seqs = []
    for i in range(num_seqs):
        tokens = list(range(1, block_size * blocks_per_seq + 1))
        seq = Sequence(tokens, SamplingParams(), block_size)
        seq.token_ids[-1] = PLACEHOLDER
        seq.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        seq.num_cached_tokens, seq.num_scheduled_tokens = len(seq) - 1, 1
        seqs.append(seq)
    return seqs


def test_the_largest_decode_step_fits_the_graphs_input_buffer():
    """A full batch at its widest, every token in flight: what the graphs' input buffer holds."""
    rows, width, block_size = 64, 4, 16
    # Temperatures packed, as for decode graphs that sample.
    inputs = StepInputs(torch.device("cpu"), block_size, decode_order=True,
                        decode_temperatures=True)
    seqs = in_flight_decode_batch(rows, width, block_size)
    # Sampled in the other order: gathered through the (packed) in-flight arrays, not copied.
    inputs.keep_sampled(torch.arange(100, 100 + rows), [seq.seq_id for seq in seqs[::-1]])
    packed = []
    inputs.to_device = lambda array: packed.append(array.nbytes) or torch.from_numpy(array)
    input_ids, _, meta = inputs.prepare_decode(scheduled_step(seqs, is_prefill=False))
    assert input_ids.tolist() == list(range(100 + rows - 1, 99, -1))  # read "on the device"
    assert meta.block_tables.shape == (rows, width)
    capacity = decode_inputs_bytes(rows, width)
    assert capacity - 10 * ALIGNMENT <= packed[0] <= capacity


def test_a_batch_runs_in_the_smallest_bucket_that_holds_it():
    buckets = batch_buckets(40)
    assert buckets == [1, 2, 4, 8, 16, 32, 40]
    chosen = [smallest_bucket(buckets, rows) for rows in (1, 3, 8, 9, 17, 33, 40)]
    assert chosen == [1, 4, 8, 16, 32, 40, 40]


@pytest.mark.parametrize("rows, copied", [((0, 1, 2), True), ((0, 1), True), ((1, 2), False),
                                          ((2, 0, 1), False)])
def test_in_flight_tokens_in_the_last_steps_order_are_copied(monkeypatch, rows, copied):
    """Rows a prefix of the last step's, in order, copy last_tokens; others gather through the
    in-flight arrays. Either way each sequence reads the token its previous step sampled."""
    from nanovllm.runner import step_inputs

    inputs = StepInputs(torch.device("cpu"), 16, decode_order=False)
    last = in_flight_decode_batch(3)
    inputs.keep_sampled(torch.tensor([7, 8, 9]), [seq.seq_id for seq in last])
    packed_names = []

    def spy(arrays, to_device):
        packed_names.append(list(arrays))
        return to_device_packed(arrays, to_device)

    monkeypatch.setattr(step_inputs, "to_device_packed", spy)
    input_ids, _, _ = inputs.prepare_decode(scheduled_step([last[row] for row in rows], False))
    assert input_ids.tolist() == [7 + row for row in rows]
    assert ("inflight" in packed_names[0]) == (not copied)


def test_each_step_draws_one_noise_seed_from_torchs_generator():
    """Each prepare_* draws the step's seed: torch.manual_seed reproduces it, a new step differs."""
    inputs = StepInputs(torch.device("cpu"), 16, decode_order=False)
    seqs = in_flight_decode_batch(2)
    inputs.keep_sampled(torch.tensor([7, 8]), [seq.seq_id for seq in seqs])
    prompt = Sequence([1, 2, 3], SamplingParams(), 16)
    prompt.block_table, prompt.num_scheduled_tokens = [5], 3
    drawn = []
    for _ in range(2):
        torch.manual_seed(4)
        inputs.prepare_decode(scheduled_step(seqs, is_prefill=False))
        first = inputs.seed
        inputs.prepare_prefill(scheduled_step([prompt], is_prefill=True))
        drawn.append((first, inputs.seed))
    assert drawn[0] == drawn[1] and drawn[0][0] != drawn[0][1]
