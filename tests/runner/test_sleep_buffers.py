"""Sleep mode's buffers on the CPU: tensors packed into one flat buffer, their bytes through one
host copy reused every cycle. The engine's sleep and wake: tests/engine/test_sleep.py; on a GPU
(virtual memory, addresses kept, graphs not captured again): tests/runner/test_rollout_cuda.py."""

import pytest
import torch

from nanovllm.runner import cuda_vmm
from nanovllm.runner.sleep import ALIGNMENT, HostCopy, Packed, packed_offsets

pytestmark = pytest.mark.cpu_suite


def some_tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(3, 5, generator=generator).to(torch.bfloat16),
            torch.randn(7, generator=generator, dtype=torch.float64),
            torch.randint(0, 100, (2, 2, 3), generator=generator),
            torch.empty(0), torch.tensor(1.5)]


def test_offsets_are_aligned_and_leave_room_for_each_tensor():
    tensors = some_tensors()
    offsets, total = packed_offsets(tensors)
    assert offsets == [0, 256, 512, 768, 768]  # an empty tensor takes no room
    assert all(offset % ALIGNMENT == 0 for offset in offsets) and total == 1024


def test_packed_tensors_cycle_through_one_host_buffer():
    tensors = some_tensors()
    values = [t.clone() for t in tensors]
    packed = Packed(tensors)
    host = HostCopy(packed.nbytes, pin=False)
    host_address = host.flat.data_ptr()
    for cycle in range(3):
        packed.save(host.flat)
        packed.release()
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
        moved = not packed.restore()
        assert moved or cycle > 0  # the first restore moves them into the buffer
        packed.load(host.flat)
        flat = packed.buffer.flat.data_ptr()  # on the CPU the storage may come back elsewhere
        assert {t.untyped_storage().data_ptr() for t in tensors} == {flat}
        assert [t.data_ptr() - flat for t in tensors if t.numel()] == [0, 256, 512, 768]
        for tensor, value in zip(tensors, values):
            assert tensor.dtype == value.dtype and torch.equal(tensor, value)
        assert host.flat.data_ptr() == host_address  # refilled, never allocated again
    host.free()
    assert host.flat is None


def test_a_tensor_packed_twice_or_a_view_is_refused():
    base = torch.zeros(8)
    with pytest.raises(AssertionError, match="a view"):
        Packed([base[:4]])


def test_discarded_bytes_are_zeroed_on_request():
    tensors = some_tensors()[:3]
    packed = Packed(tensors)
    packed.release()
    packed.restore()
    packed.zero_()
    assert all(not t.any() for t in tensors)


def test_virtual_memory_is_for_cuda_only(monkeypatch):
    assert not cuda_vmm.available(torch.device("cpu"))
    monkeypatch.setenv("NANOVLLM_SLEEP_VMM", "0")
    assert not cuda_vmm.available(torch.device("cuda", 0))
