"""Step inputs from host arrays to the device, many small arrays by one copy: each copy costs the host
~10-20 µs and the GPU a transfer of its own in the step's chain."""

from collections.abc import Callable

import numpy as np
import torch

ToDevice = Callable[[np.ndarray], torch.Tensor]  # one host array to the device (pinned, non-blocking)

ALIGNMENT = 16
TORCH_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.int64): torch.int64,
                np.dtype(np.int32): torch.int32}


def pinned(array: np.ndarray) -> torch.Tensor:
    """The array's data in page-locked host memory, from which a non_blocking copy does not block the host."""
    return torch.from_numpy(array).pin_memory()


def to_device_packed(arrays: dict[str, np.ndarray], to_device: ToDevice) -> dict[str, torch.Tensor]:
    """The arrays on the device by one to_device call, of an int64 array holding their bytes, viewed back in
    their dtypes and shapes (views cost no kernel launch). Each starts at a multiple of ALIGNMENT bytes, as
    Triton specializes a kernel for pointers so aligned: other offsets would compile a second variant. The
    offsets depend only on the arrays' order, dtypes and sizes."""
    offsets, total = [], 0
    for array in arrays.values():
        offsets.append(total)
        total += -(-array.nbytes // ALIGNMENT) * ALIGNMENT
    packed = np.empty(total // 8, dtype=np.int64)
    for array, offset in zip(arrays.values(), offsets):  # copied in their own dtype, not byte by byte
        start = offset // array.itemsize
        packed.view(array.dtype)[start:start + array.size] = array.reshape(-1)
    device = to_device(packed)  # int64, or the bytes of a buffer it was copied into (DecodeGraphs.to_device)
    typed = {dtype: device.view(TORCH_DTYPES[dtype]) for dtype in {array.dtype for array in arrays.values()}}
    views = {}
    for (name, array), offset in zip(arrays.items(), offsets):  # one slice per 1-D array: each op costs ~2 µs
        start = offset // array.itemsize
        view = typed[array.dtype][start:start + array.size]
        views[name] = view if array.ndim == 1 else view.view(array.shape)
    return views
