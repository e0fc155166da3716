"""Sleep mode: each group of tensors (the weights, the KV pool) packed into one flat device buffer
that sleep frees and wake_up allocates again, at the same addresses where CUDA virtual memory is
available; the weights' bytes kept in one host buffer that every sleep(level=1) refills."""

import sys

import torch

from nanovllm.runner import cuda_vmm

ALIGNMENT = 256  # bytes: every packed tensor starts where any dtype and any kernel can read it


def packed_offsets(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the packed buffer, and the buffer's size."""
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-tensor.nbytes // ALIGNMENT) * ALIGNMENT
    return offsets, total


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a [nbytes] uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)


class DeviceBuffer:
    """`flat` [nbytes] uint8 on `device`, whose memory release() frees and restore() allocates
    again. CUDA virtual memory keeps its address; elsewhere (the CPU, or NANOVLLM_SLEEP_VMM=0) its
    storage is resized to zero and back, which keeps every view valid but maybe not the address."""

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes = nbytes
        self.memory = None
        if cuda_vmm.available(device):
            self.memory = cuda_vmm.VirtualMemory(nbytes, device)
            self.flat = self.memory.tensor()
        else:
            self.flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.address = self.flat.data_ptr()

    def release(self):
        if self.memory is not None:
            self.memory.release()
        else:
            self.flat.untyped_storage().resize_(0)

    def restore(self) -> bool:
        """Memory back (contents undefined); returns whether it is at its old address."""
        if self.memory is not None:
            self.memory.map()
        else:
            self.flat.untyped_storage().resize_(self.nbytes)
        return self.flat.data_ptr() == self.address


class Packed:
    """Tensors, each owning its whole storage, that move into one DeviceBuffer: the first
    release() frees their own storages, the first restore() allocates the buffer and points each
    tensor (`.data`) at its view there. Later cycles free and allocate the buffer alone."""

    def __init__(self, tensors: list[torch.Tensor]):
        for tensor in tensors:
            assert tensor.is_contiguous() and tensor.storage_offset() == 0
            assert tensor.untyped_storage().nbytes() == tensor.nbytes, "a view: packed twice"
        self.tensors = tensors
        self.offsets, self.nbytes = packed_offsets(tensors)
        self.device = tensors[0].device
        self.buffer: DeviceBuffer | None = None

    def save(self, host: torch.Tensor):
        """Queue the copies of the bytes into host [nbytes] uint8 (the caller synchronizes)."""
        if self.buffer is not None:
            host.copy_(self.buffer.flat, non_blocking=True)
            return
        for tensor, offset in zip(self.tensors, self.offsets):
            host[offset:offset + tensor.nbytes].copy_(_bytes(tensor), non_blocking=True)

    def load(self, host: torch.Tensor):
        """Queue the copy of host [nbytes] uint8 back into the buffer (after restore)."""
        self.buffer.flat.copy_(host, non_blocking=True)

    def release(self):
        if self.buffer is not None:
            self.buffer.release()
            return
        for tensor in self.tensors:
            tensor.untyped_storage().resize_(0)

    @torch.no_grad()
    def restore(self) -> bool:
        """Memory back, contents undefined; returns whether every tensor kept its address (never
        on the first call: the tensors move into the buffer). Views taken of a tensor before a
        move still point at its old storage: take them again."""
        if self.buffer is not None:
            return self.buffer.restore()
        self.buffer = DeviceBuffer(self.nbytes, self.device)
        for tensor, offset in zip(self.tensors, self.offsets):
            view = self.buffer.flat[offset:offset + tensor.nbytes]
            tensor.data = view.view(tensor.dtype).view(tensor.shape)
        return False

    def zero_(self):
        self.buffer.flat.zero_()


class Sleeper:
    """What sleep freed, by wake_up tag ("weights", "kv_cache"): each tag's tensors Packed at its
    first sleep. The weights' bytes go to one HostCopy, allocated by the first sleep that keeps
    them and refilled by each later one; wake_up keeps it; a sleep that discards the weights
    (level 2) frees it, and so does free()."""

    def __init__(self, device: torch.device):
        self.device = device
        self.packed: dict[str, Packed] = {}
        self.asleep: set[str] = set()
        self.host_weights: HostCopy | None = None
        self.moved = False  # a tag came back at another address since all were last awake

    def sleep(self, groups: dict[str, list[torch.Tensor]], keep_weights: bool):
        """Free each tag's tensors; keep_weights: first copy the "weights" bytes to the host."""
        for tag, tensors in groups.items():
            if tag not in self.packed:
                self.packed[tag] = Packed(tensors)
        if "weights" in groups and keep_weights:
            if self.host_weights is None:
                self.host_weights = HostCopy(self.packed["weights"].nbytes,
                                             pin=self.device.type == "cuda")
            self.packed["weights"].save(self.host_weights.flat)
        else:
            self.free()
        self._synchronize()  # the copies have landed: free the memory
        for tag in groups:
            self.packed[tag].release()
        self.asleep |= set(groups)

    def wake(self, tags: list[str]) -> set[str]:
        """Restore the asleep among `tags`, the weights from the host copy (if kept) and the rest
        zeroed; returns the tags whose tensors came back at other addresses."""
        moved = set()
        for tag in [tag for tag in tags if tag in self.asleep]:
            packed = self.packed[tag]
            if not packed.restore():
                moved.add(tag)
            if tag != "weights":
                packed.zero_()
            elif self.host_weights is not None:
                packed.load(self.host_weights.flat)
            self.asleep.discard(tag)
        self._synchronize()
        self.moved |= bool(moved)
        return moved

    def free(self):
        """Free the host copy of the weights."""
        if self.host_weights is not None:
            self._synchronize()
            self.host_weights.free()
            self.host_weights = None

    def _synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class HostCopy:
    """`flat` [nbytes] uint8 in host memory; pin: page-locked by registering it with CUDA (not
    through the caching host allocator, which would round it up to a power of two and keep it
    after free), so that copies run at full speed and do not block."""

    def __init__(self, nbytes: int, pin: bool):
        self.flat = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned = False
        if pin:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.flat.data_ptr(),
                                                                        nbytes, 0))
            self.pinned = True

    def free(self):
        """Unpin and free (no copy may be in flight)."""
        if self.pinned:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr()))
            self.pinned = False
        self.flat = None

    def __del__(self):
        if not sys.is_finalizing():
            self.free()
