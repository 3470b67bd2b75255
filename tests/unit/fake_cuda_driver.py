"""A fake of ``cuda.bindings.driver`` for the GPU path's unit tests (no GPU here).

:class:`FakeCudaDriver` implements, in-process, the subset of the CUDA
driver binding that :mod:`kvsidecar.ipc.cuda` and
``kvsidecar.daemon.cuda_device`` call, with the binding's calling convention
(every call returns a tuple whose first item is the ``CUresult``; enums and
structs are attributes of the module). It does not model device memory: it
books what a real driver would hold (allocations, reservations, mappings,
retained primary contexts, exported fds) so a test can assert that a failure
path gives all of it back, and it records every call in order
(:attr:`FakeCudaDriver.calls`). A call named in :attr:`FakeCudaDriver.fail`
returns that error instead of doing its work.

Exported POSIX fds are real (``/dev/null`` opened), so closing them and
passing them on behaves as the real ones do.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import os
from types import SimpleNamespace
from typing import Any


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_ILLEGAL_ADDRESS = 700


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_INVALID = 0
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_INVALID = 0
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemAllocationHandleType(enum.IntEnum):
    CU_MEM_HANDLE_TYPE_NONE = 0
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1


class CUmemAllocationGranularity_flags(enum.IntEnum):
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class CUmemAccess_flags(enum.IntEnum):
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUipcMem_flags(enum.IntEnum):
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110


class CUmemAllocationProp:
    def __init__(self) -> None:
        self.type = CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_INVALID
        self.requestedHandleTypes = CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        self.location = SimpleNamespace(type=CUmemLocationType.CU_MEM_LOCATION_TYPE_INVALID,
                                        id=0)
        self.allocFlags = SimpleNamespace(gpuDirectRDMACapable=0)


class CUmemAccessDesc:
    def __init__(self) -> None:
        self.location = SimpleNamespace(type=CUmemLocationType.CU_MEM_LOCATION_TYPE_INVALID,
                                        id=0)
        self.flags = CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE


class CUipcMemHandle:
    """64 opaque bytes, reachable only through :meth:`getPtr` (as in cuda-bindings 13)."""

    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(64)

    def getPtr(self) -> int:
        return ctypes.addressof(self._buf)


class CUuuid:
    def __init__(self, raw: bytes) -> None:
        self.bytes = raw


class CUmemGenericAllocationHandle:
    def __init__(self, value: int) -> None:
        self.value = value

    def __int__(self) -> int:
        return self.value


GRANULARITY = 2 << 20


class FakeCudaDriver:
    """One process's view of a fake driver with ``devices`` GPUs."""

    CUresult = CUresult
    CUmemAllocationType = CUmemAllocationType
    CUmemLocationType = CUmemLocationType
    CUmemAllocationHandleType = CUmemAllocationHandleType
    CUmemAllocationGranularity_flags = CUmemAllocationGranularity_flags
    CUmemAccess_flags = CUmemAccess_flags
    CUipcMem_flags = CUipcMem_flags
    CUdevice_attribute = CUdevice_attribute
    CUmemAllocationProp = CUmemAllocationProp
    CUmemAccessDesc = CUmemAccessDesc
    CUipcMemHandle = CUipcMemHandle

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        #: every call, in order: (name, positional arguments)
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        #: call name -> the error it returns (its work is not done)
        self.fail: dict[str, CUresult] = {}
        self.current: int | None = None
        #: device ordinal -> cuDevicePrimaryCtxRetain count not yet released
        self.retained: dict[int, int] = {}
        self.allocs: dict[int, int] = {}  # cuMemAlloc pointer -> bytes
        self.handles: dict[int, int] = {}  # live cuMemCreate/imported handle -> bytes
        self.reserved: dict[int, int] = {}  # reservation -> bytes
        self.mapped: dict[int, int] = {}  # mapped address -> handle value
        self.opened: dict[int, bytes] = {}  # cuIpcOpenMemHandle pointer -> handle bytes
        self.exported_fds: list[int] = []
        self._addr = itertools.count(0x7F00_0000_0000, 1 << 32)
        self._handle = itertools.count(1)

    # -- plumbing ------------------------------------------------------------------------------

    def _call(self, name: str, *args: Any) -> CUresult:
        self.calls.append((name, args))
        return self.fail.get(name, CUresult.CUDA_SUCCESS)

    def names(self) -> list[str]:
        """The names of the calls made so far, in order."""
        return [n for n, _ in self.calls]

    def held(self) -> dict[str, object]:
        """What a real driver would still hold (empty dicts/lists: nothing leaked)."""
        return {"allocs": dict(self.allocs), "handles": dict(self.handles),
                "reserved": dict(self.reserved), "mapped": dict(self.mapped),
                "opened": dict(self.opened)}

    # -- init, devices, contexts ----------------------------------------------------------------

    def cuInit(self, flags: int) -> tuple[CUresult]:
        return (self._call("cuInit", flags),)

    def cuDeviceGetCount(self) -> tuple[CUresult, int]:
        return self._call("cuDeviceGetCount"), self.devices

    def cuDeviceGet(self, ordinal: int) -> tuple[CUresult, int]:
        return self._call("cuDeviceGet", ordinal), ordinal

    def cuDeviceGetUuid(self, dev: int) -> tuple[CUresult, CUuuid]:
        return self._call("cuDeviceGetUuid", dev), CUuuid(bytes([dev + 1] * 16))

    def cuDeviceGetAttribute(self, attr: int, dev: int) -> tuple[CUresult, int]:
        return self._call("cuDeviceGetAttribute", attr, dev), 1

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[CUresult, int]:
        err = self._call("cuDevicePrimaryCtxRetain", dev)
        if err == 0:
            self.retained[dev] = self.retained.get(dev, 0) + 1
        return err, 1000 + dev

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple[CUresult]:
        err = self._call("cuDevicePrimaryCtxRelease", dev)
        if err == 0:
            self.retained[dev] -= 1
        return (err,)

    def cuCtxGetCurrent(self) -> tuple[CUresult, int]:
        """The thread's current context (one thread here): 0 for none, as the
        binding's null ``CUcontext``."""
        err = self._call("cuCtxGetCurrent")
        return err, 0 if self.current is None else 1000 + self.current

    def cuCtxSetCurrent(self, ctx: int) -> tuple[CUresult]:
        err = self._call("cuCtxSetCurrent", ctx)
        if err == 0:
            self.current = None if not ctx else ctx - 1000
        return (err,)

    def cuCtxSynchronize(self) -> tuple[CUresult]:
        return (self._call("cuCtxSynchronize"),)

    # -- cuMemAlloc and legacy IPC ---------------------------------------------------------------

    def cuMemAlloc(self, n: int) -> tuple[CUresult, int]:
        err = self._call("cuMemAlloc", n)
        if err:
            return err, 0
        ptr = next(self._addr)
        self.allocs[ptr] = n
        return err, ptr

    def cuMemFree(self, ptr: int) -> tuple[CUresult]:
        err = self._call("cuMemFree", ptr)
        if err == 0:
            del self.allocs[int(ptr)]
        return (err,)

    def cuMemsetD8(self, ptr: int, value: int, n: int) -> tuple[CUresult]:
        return (self._call("cuMemsetD8", ptr, value, n),)

    def cuMemcpyHtoD(self, dst: int, src: int, n: int) -> tuple[CUresult]:
        err = self._call("cuMemcpyHtoD", dst, src, n)
        return (err,)

    def cuMemcpyDtoH(self, dst: int, src: int, n: int) -> tuple[CUresult]:
        err = self._call("cuMemcpyDtoH", dst, src, n)
        return (err,)

    def cuIpcGetMemHandle(self, ptr: int) -> tuple[CUresult, CUipcMemHandle]:
        h = CUipcMemHandle()
        err = self._call("cuIpcGetMemHandle", ptr)
        if err == 0:
            ctypes.memmove(h.getPtr(), int(ptr).to_bytes(64, "little"), 64)
        return err, h

    def cuIpcOpenMemHandle(self, h: CUipcMemHandle,
                           flags: int) -> tuple[CUresult, int]:
        err = self._call("cuIpcOpenMemHandle", h, flags)
        if err:
            return err, 0
        ptr = next(self._addr)
        self.opened[ptr] = ctypes.string_at(h.getPtr(), 64)
        return err, ptr

    def cuIpcCloseMemHandle(self, ptr: int) -> tuple[CUresult]:
        err = self._call("cuIpcCloseMemHandle", ptr)
        if err == 0:
            del self.opened[int(ptr)]
        return (err,)

    # -- VMM --------------------------------------------------------------------------------------

    def cuMemGetAllocationGranularity(self, prop: CUmemAllocationProp,
                                      option: int) -> tuple[CUresult, int]:
        return self._call("cuMemGetAllocationGranularity", prop, option), GRANULARITY

    def cuMemCreate(self, size: int, prop: CUmemAllocationProp,
                    flags: int) -> tuple[CUresult, CUmemGenericAllocationHandle | None]:
        err = self._call("cuMemCreate", size, prop, flags)
        if err:
            return err, None
        h = next(self._handle)
        self.handles[h] = size
        return err, CUmemGenericAllocationHandle(h)

    def cuMemRelease(self, h: CUmemGenericAllocationHandle) -> tuple[CUresult]:
        err = self._call("cuMemRelease", h)
        if err == 0:
            del self.handles[int(h)]
        return (err,)

    def cuMemExportToShareableHandle(self, h: CUmemGenericAllocationHandle,
                                     kind: int, flags: int) -> tuple[CUresult, int]:
        err = self._call("cuMemExportToShareableHandle", h, kind, flags)
        if err:
            return err, -1
        fd = os.open(os.devnull, os.O_RDONLY)
        self.exported_fds.append(fd)
        return err, fd

    def cuMemImportFromShareableHandle(
            self, fd: int, kind: int) -> tuple[CUresult, CUmemGenericAllocationHandle | None]:
        err = self._call("cuMemImportFromShareableHandle", fd, kind)
        if err:
            return err, None
        os.fstat(fd)  # a closed fd would be EBADF in the real driver too
        h = next(self._handle)
        self.handles[h] = 0
        return err, CUmemGenericAllocationHandle(h)

    def cuMemAddressReserve(self, size: int, align: int, addr: int,
                            flags: int) -> tuple[CUresult, int]:
        err = self._call("cuMemAddressReserve", size, align, addr, flags)
        if err:
            return err, 0
        ptr = next(self._addr)
        self.reserved[ptr] = size
        return err, ptr

    def cuMemAddressFree(self, ptr: int, size: int) -> tuple[CUresult]:
        err = self._call("cuMemAddressFree", ptr, size)
        if err == 0:
            if int(ptr) in self.mapped:  # the real driver refuses to free a mapped range
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            del self.reserved[int(ptr)]
        return (err,)

    def cuMemMap(self, ptr: int, size: int, offset: int,
                 h: CUmemGenericAllocationHandle, flags: int) -> tuple[CUresult]:
        err = self._call("cuMemMap", ptr, size, offset, h, flags)
        if err == 0:
            self.mapped[int(ptr)] = int(h)
        return (err,)

    def cuMemUnmap(self, ptr: int, size: int) -> tuple[CUresult]:
        err = self._call("cuMemUnmap", ptr, size)
        if err == 0:
            del self.mapped[int(ptr)]
        return (err,)

    def cuMemSetAccess(self, ptr: int, size: int, descs: list[CUmemAccessDesc],
                       count: int) -> tuple[CUresult]:
        return (self._call("cuMemSetAccess", ptr, size, descs, count),)
