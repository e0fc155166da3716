"""Sleep mode: each storage resized to zero bytes and back, so every tensor and view stays valid;
`restore` says whether every storage came back at its old address."""

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
        self.addresses = [storage.data_ptr() for storage in self.storages]
        self.sizes = [storage.nbytes() for storage in self.storages]
        self.host: list[torch.Tensor] | None = None
        if keep:
            pin = self.storages[0].device.type == "cuda"
            self.host = [torch.empty(size, dtype=torch.uint8, pin_memory=pin).copy_(_bytes(s))
                         for s, size in zip(self.storages, self.sizes)]
        for storage in self.storages:
            storage.resize_(0)

    def restore(self) -> bool:
        """Reallocate and refill the storages; returns whether each is at its old address."""
        for i, (storage, size) in enumerate(zip(self.storages, self.sizes)):
            storage.resize_(size)
            if self.host is None:
                _bytes(storage).zero_()
            else:
                _bytes(storage).copy_(self.host[i])
                self.host[i] = None  # free the host copy as we go
        return [s.data_ptr() for s in self.storages] == self.addresses
