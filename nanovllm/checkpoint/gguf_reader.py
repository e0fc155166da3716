"""A GGUF file's header read with `struct` in one pass: the metadata as Python values and each
tensor as a (name, shape, type, bytes) view into the memory-mapped file.

gguf's own GGUFReader builds a numpy view per metadata value; a tokenizer's vocabulary and merges
are ~100,000 strings, which makes opening a small model's file take seconds. This reader does the
same work in a fraction of that and leaves the tensor bytes unread until they are dequantized."""

import mmap
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 counted in 32 bits and is long gone
DEFAULT_ALIGNMENT = 32
# metadata value type -> struct format of the fixed-size ones (8: string, 9: array)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
         10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: [columns, rows, ...]
    tensor_type: int  # a ggml type id (gguf.GGMLQuantizationType)
    data: np.ndarray  # uint8 [rows, bytes per row], a view into the mapped file


class GGUFFile:
    """`fields`: metadata key -> value (str, int, float, bool or a list); `tensors`: in file order.

    Raises ValueError on anything that is not a whole little-endian GGUF file."""

    def __init__(self, path: str, quant_sizes: dict):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._offset = 0
        if self._bytes(4) != MAGIC:
            raise ValueError("no GGUF magic")
        version = self._scalar("<I")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} (readable: {VERSIONS}; or big-endian)")
        tensor_count, kv_count = self._scalar("<Q"), self._scalar("<Q")
        self.fields = {}
        for _ in range(kv_count):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info, quant_sizes) for info in infos]

    def _bytes(self, n: int) -> bytes:
        end = self._offset + n
        if end > len(self._map):
            raise ValueError("the file ends inside its header")
        data = self._map[self._offset:end]
        self._offset = end
        return data

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._bytes(struct.calcsize(fmt)))
        return value

    def _string(self) -> str:
        return self._bytes(self._scalar("<Q")).decode("utf-8", errors="replace")

    def _value(self, kind: int):
        if kind in SCALARS:
            return self._scalar(SCALARS[kind])
        if kind == STRING:
            return self._string()
        if kind != ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self._scalar("<I"), self._scalar("<Q")
        if item in NUMPY:  # one read for the whole array
            dtype = np.dtype(NUMPY[item])
            return np.frombuffer(self._bytes(count * dtype.itemsize), dtype).tolist()
        return [self._value(item) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        ndims = self._scalar("<I")
        dims = struct.unpack(f"<{ndims}Q", self._bytes(8 * ndims))
        return name, dims, self._scalar("<I"), self._scalar("<Q")

    def _tensor(self, start: int, name: str, shape: tuple[int, ...], kind: int, offset: int,
                quant_sizes: dict) -> GGUFTensor:
        if kind not in quant_sizes:
            raise ValueError(f"tensor {name!r} has unknown ggml type {kind}")
        block, block_bytes = quant_sizes[kind]
        if not shape or shape[0] % block:
            raise ValueError(f"tensor {name!r} of shape {shape} is not whole blocks of {block}")
        rows = int(np.prod(shape[1:], dtype=np.int64))
        row_bytes = shape[0] // block * block_bytes
        begin = start + offset
        if begin + rows * row_bytes > len(self._map):
            raise ValueError(f"the file ends inside tensor {name!r}")
        data = np.frombuffer(self._map, np.uint8, rows * row_bytes, begin)
        return GGUFTensor(name, shape, kind, data.reshape(rows, row_bytes))
