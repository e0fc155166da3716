"""Sleep mode: tensors' device memory freed and restored under the same tensor objects.

Each storage is resized to zero bytes and back (`untyped_storage().resize_`), so every parameter,
every view of the KV pool and every module holding one stays valid; the bytes come back at a new
address, which is why the runner captures its CUDA graphs again on waking."""

import torch


def _storages(tensors: list[torch.Tensor]) -> list[torch.UntypedStorage]:
    unique = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        unique.setdefault(storage.data_ptr(), storage)
    return list(unique.values())


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage as a [nbytes] uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Offloaded:
    """The storages of `tensors`, freed; with keep, their bytes first copied to host memory
    (pinned for a GPU). restore() reallocates them (zeros if not kept) and copies the bytes back."""

    def __init__(self, tensors: list[torch.Tensor], keep: bool):
        self.storages = _storages(tensors)
        self.sizes = [storage.nbytes() for storage in self.storages]
        self.host: list[torch.Tensor] | None = None
        if keep:
            pin = self.storages[0].device.type == "cuda"
            self.host = [torch.empty(size, dtype=torch.uint8, pin_memory=pin).copy_(_bytes(s))
                         for s, size in zip(self.storages, self.sizes)]
        for storage in self.storages:
            storage.resize_(0)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def restore(self):
        for i, (storage, size) in enumerate(zip(self.storages, self.sizes)):
            storage.resize_(size)
            if self.host is None:
                _bytes(storage).zero_()
            else:
                _bytes(storage).copy_(self.host[i])
                self.host[i] = None  # free the host copy as we go
