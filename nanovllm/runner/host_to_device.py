"""Step inputs from host arrays to the device, many small arrays by one copy."""

from collections.abc import Callable

import numpy as np
import torch

ToDevice = Callable[[np.ndarray], torch.Tensor]

ALIGNMENT = 16  # Triton specializes kernels on 16-byte-aligned pointers: one variant, not two
TORCH_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.int64): torch.int64,
                np.dtype(np.int32): torch.int32}


def pinned(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).pin_memory()


def to_device_packed(arrays: dict[str, np.ndarray], to_device: ToDevice) -> dict[str, torch.Tensor]:
    """One copy of the arrays' bytes, viewed back; offsets follow their order, dtypes, sizes."""
    offsets, total = [], 0
    for array in arrays.values():
        offsets.append(total)
        total += -(-array.nbytes // ALIGNMENT) * ALIGNMENT
    packed = np.empty(total // 8, dtype=np.int64)
    for array, offset in zip(arrays.values(), offsets):
        start = offset // array.itemsize
        packed.view(array.dtype)[start:start + array.size] = array.reshape(-1)
    device = to_device(packed)
    dtypes = {array.dtype for array in arrays.values()}
    typed = {dtype: device.view(TORCH_DTYPES[dtype]) for dtype in dtypes}
    views = {}
    for (name, array), offset in zip(arrays.items(), offsets):
        start = offset // array.itemsize
        view = typed[array.dtype][start:start + array.size]
        views[name] = view if array.ndim == 1 else view.view(array.shape)
    return views
