"""CUDA virtual memory through the driver API (ctypes, no extension to build): a range of device
addresses reserved once, whose physical memory is released and mapped again, so that tensors
viewing it, and CUDA graphs that read it, keep their addresses across sleep and wake."""

import ctypes
import functools
import os
import sys

import torch

# CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_PINNED, _ON_DEVICE, _READ_WRITE = 1, 1, 3


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp: 32 bytes
    _fields_ = [("type", ctypes.c_int), ("requested_handle_types", ctypes.c_int),
                ("location", _Location), ("win32_handle_metadata", ctypes.c_void_p),
                ("alloc_flags", ctypes.c_ubyte * 8)]  # compression, RDMA, usage: all zero


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_SIGNATURES = {  # every call returns a CUresult; CUdeviceptr and handles are 64-bit
    "cuMemGetAllocationGranularity": [ctypes.POINTER(ctypes.c_size_t),
                                      ctypes.POINTER(_AllocationProp), ctypes.c_int],
    "cuMemAddressReserve": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.c_size_t,
                            ctypes.c_uint64, ctypes.c_uint64],
    "cuMemAddressFree": [ctypes.c_uint64, ctypes.c_size_t],
    "cuMemCreate": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t,
                    ctypes.POINTER(_AllocationProp), ctypes.c_uint64],
    "cuMemRelease": [ctypes.c_uint64],
    "cuMemMap": [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64,
                 ctypes.c_uint64],
    "cuMemUnmap": [ctypes.c_uint64, ctypes.c_size_t],
    "cuMemSetAccess": [ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(_AccessDesc),
                       ctypes.c_size_t],
    "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
}


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return lib


def available(device: torch.device) -> bool:
    """Whether sleep keeps addresses through virtual memory here (NANOVLLM_SLEEP_VMM=0: never)."""
    return (device.type == "cuda" and os.environ.get("NANOVLLM_SLEEP_VMM", "1") != "0"
            and _driver() is not None)


def _check(result: int, call: str):
    if result != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{call} failed: CUDA error {result} "
                           f"({(text.value or b'unknown').decode()})")


class _CudaArray:
    """What torch.as_tensor wraps without copying; the tensor keeps it, and so its memory, alive."""

    def __init__(self, memory: "VirtualMemory", nbytes: int):
        self.memory = memory
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (memory.address, False), "version": 2}


class VirtualMemory:
    """`nbytes` of device memory at an address reserved for its lifetime. release() returns the
    physical memory to the device; map() backs the same addresses with new memory (contents
    undefined). Freed when the last tensor from tensor() is."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device, self.nbytes = device, nbytes
        self.address: int | None = None
        self.handle: int | None = None
        torch.cuda.synchronize(device)  # also makes the device's context current on this thread
        self.prop = _AllocationProp(type=_PINNED, location=_Location(_ON_DEVICE, device.index))
        granularity = ctypes.c_size_t()
        _check(_driver().cuMemGetAllocationGranularity(ctypes.byref(granularity),
                                                       ctypes.byref(self.prop), 0),
               "cuMemGetAllocationGranularity")
        self.size = -(-max(nbytes, 1) // granularity.value) * granularity.value
        address = ctypes.c_uint64()
        _check(_driver().cuMemAddressReserve(ctypes.byref(address), self.size, 0, 0, 0),
               "cuMemAddressReserve")
        self.address = address.value
        self.map()

    def tensor(self) -> torch.Tensor:
        """[nbytes] uint8, a view of the memory that does not own it."""
        return torch.as_tensor(_CudaArray(self, self.nbytes), device=self.device)

    def map(self):
        assert self.handle is None, "already mapped"
        torch.cuda.synchronize(self.device)  # the device's context current on this thread
        handle = ctypes.c_uint64()
        _check(_driver().cuMemCreate(ctypes.byref(handle), self.size, ctypes.byref(self.prop), 0),
               "cuMemCreate")
        result = _driver().cuMemMap(self.address, self.size, 0, handle.value, 0)
        if result != 0:
            _driver().cuMemRelease(handle.value)
        _check(result, "cuMemMap")
        self.handle = handle.value
        access = _AccessDesc(location=self.prop.location, flags=_READ_WRITE)
        _check(_driver().cuMemSetAccess(self.address, self.size, ctypes.byref(access), 1),
               "cuMemSetAccess")

    def release(self):
        """Unmap and free the physical memory, once the device has finished with it."""
        if self.handle is None:
            return
        torch.cuda.synchronize(self.device)
        _check(_driver().cuMemUnmap(self.address, self.size), "cuMemUnmap")
        _check(_driver().cuMemRelease(self.handle), "cuMemRelease")
        self.handle = None

    def __del__(self):
        if sys.is_finalizing() or self.address is None:  # at exit the driver frees everything
            return
        self.release()
        _check(_driver().cuMemAddressFree(self.address, self.size), "cuMemAddressFree")
