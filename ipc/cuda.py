"""GPU regions through the CUDA driver API (``cuda-bindings``, the ``gpu`` extra).

Both processes use :class:`CudaRegion`: the sidecar for memory it allocated
and exports (``kvsidecar.daemon.cuda_device``), the engine for memory it
mapped from the sidecar's export:

* legacy IPC (``cuMemAlloc`` + ``cuIpcGetMemHandle``): the engine calls
  ``cuIpcOpenMemHandle`` (:func:`open_ipc`); works with every UCX version;
* VMM (``cuMemCreate`` with a POSIX-fd handle): the fd arrives over the fd
  socket (SCM_RIGHTS); the engine imports it, reserves an address range,
  maps and enables access (:func:`import_vmm`).

Tensors are zero-copy views (:meth:`CudaRegion.torch`): a uint8 tensor over
the device pointer, built from ``__cuda_array_interface__``, then viewed as
the dtype and shape the caller wants.

A maintained binding rather than ctypes over libcuda: ``cuda-bindings`` is
NVIDIA's, typed, and follows the driver API. ctypes is used only to copy the
64 opaque bytes of an IPC handle in and out of its struct (the binding
exposes the struct's address, not its bytes).

Nothing here runs without a GPU; the pure parts are in
:mod:`kvsidecar.ipc.cuda_handles` and tested everywhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .cuda_handles import check_ipc_handle, uuid_from_bytes
from .memory import RegionError
from .protocol import CUDA_IPC_HANDLE_BYTES, CudaIpcRef, CudaVmmRef, RegionRef
from .regions import Device, MemType

if TYPE_CHECKING:
    import torch as _torch

__all__ = ["CudaError", "CudaRegion", "current_device", "device_uuid", "driver", "fill",
           "import_vmm", "make_current",
           "open_ipc", "ordinal_for_uuid"]


class CudaError(RegionError):
    """A CUDA driver call failed (or the driver/binding is missing)."""


def driver() -> Any:
    """``cuda.bindings.driver``, initialised; CudaError naming the extra if absent."""
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        raise CudaError("GPU regions need cuda-bindings: pip install 'kvsidecar[gpu]'") from None
    try:
        (err,) = drv.cuInit(0)
    except Exception as e:  # the binding raises when libcuda.so is not there
        raise CudaError(f"no CUDA driver here: {e}") from None
    if int(err) != 0:
        raise CudaError(f"cuInit failed: {err}")
    return drv


def check(result: Any, what: str) -> Any:
    """Unpack ``(CUresult, *values)``; raise CudaError on a non-zero result."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise CudaError(f"{what} failed: {getattr(err, 'name', err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def device_uuid(ordinal: int) -> str:
    drv = driver()
    dev = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    return uuid_from_bytes(bytes(check(drv.cuDeviceGetUuid(dev), "cuDeviceGetUuid").bytes))


def ordinal_for_uuid(uuid: str) -> int:
    """This process's CUDA ordinal of the GPU ``uuid`` names (indices differ
    between processes with different ``CUDA_VISIBLE_DEVICES``)."""
    drv = driver()
    count = int(check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))
    for i in range(count):
        if device_uuid(i) == uuid:
            return i
    raise CudaError(f"GPU {uuid} is not visible in this process ({count} GPUs visible): "
                    "the engine and its sidecar must see the same GPU")


def make_current(ordinal: int) -> None:
    """Make the device's primary context current on the calling thread.

    The NIXL worker thread calls this before it registers or transfers: UCX's
    cuda transports use the current context, and a thread has none until set.
    """
    drv = driver()
    dev = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    ctx = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def fill(ptr: int, value: int, nbytes: int) -> None:
    """Set ``nbytes`` at ``ptr`` to ``value`` and wait until that is done (the
    device's context current).

    ``cuMemsetD8`` on device memory is asynchronous with respect to the host
    (CUDA driver API, "API synchronization behavior"): without the wait the
    memory could be handed out, written or read over NIXL (whose READs run on
    UCX's streams, unordered with it) before the memset ran, and an error of
    the memset would surface in some later call."""
    drv = driver()
    check(drv.cuMemsetD8(ptr, value, nbytes), "cuMemsetD8")
    check(drv.cuCtxSynchronize(), "cuCtxSynchronize (after cuMemsetD8)")


@contextlib.contextmanager
def current_device(ordinal: int) -> Iterator[None]:
    """The device's primary context current on the calling thread for the
    block, and the thread's previous context current again after it (also
    when the block raised).

    The engine's side maps and unmaps regions on its own threads, where torch
    follows the thread's current context: :func:`make_current` alone would
    leave the region's GPU current, so a model thread of one GPU would go on
    allocating on another. (The sidecar's own threads use
    :func:`make_current`: they keep their GPU.)"""
    drv = driver()
    previous = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    make_current(ordinal)
    try:
        yield
    finally:
        check(drv.cuCtxSetCurrent(previous), "cuCtxSetCurrent (restoring the caller's)")


def handle_bytes(handle: Any) -> bytes:
    """The 64 bytes of a ``CUipcMemHandle``."""
    return ctypes.string_at(int(handle.getPtr()), CUDA_IPC_HANDLE_BYTES)


def handle_from_bytes(raw: bytes) -> Any:
    drv = driver()
    h = drv.CUipcMemHandle()
    ctypes.memmove(int(h.getPtr()), check_ipc_handle(raw), CUDA_IPC_HANDLE_BYTES)
    return h


class _CudaArray:
    """Just enough of ``__cuda_array_interface__`` (v3) for ``torch.as_tensor``."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None, "stream": None,
        }


class CudaRegion:
    """One GPU region mapped in this process; :meth:`close` undoes what made it
    (with the GPU's context current: it may run on any thread)."""

    def __init__(self, name: str, address: int, nbytes: int, device: Device, ref: RegionRef,
                 release: Callable[[], None]) -> None:
        self._name = name
        self._address = address
        self._nbytes = nbytes
        self._device = device
        self._ref = ref
        self._release: Callable[[], None] | None = release

    @property
    def address(self) -> int:
        return self._address

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def mem_type(self) -> MemType:
        return "VRAM"

    @property
    def device(self) -> Device:
        return self._device

    @property
    def name(self) -> str:
        return self._name

    @property
    def closed(self) -> bool:
        return self._release is None

    def ref(self) -> RegionRef:
        return self._ref

    def numpy(self) -> Any:
        raise RegionError(f"{self._name} is GPU memory: use .torch() for a CUDA tensor view")

    def torch(self, dtype: _torch.dtype | None = None,
              shape: tuple[int, ...] | None = None) -> _torch.Tensor:
        """A zero-copy CUDA tensor over the region: uint8, or viewed as ``dtype``
        and ``shape`` (which must cover exactly ``nbytes``)."""
        import torch

        t = torch.as_tensor(_CudaArray(self._address, self._nbytes),
                            device=f"cuda:{self._device.index}")
        if dtype is not None:
            t = t.view(dtype)
        if shape is not None:
            t = t.view(shape)
        return t

    def close(self) -> None:
        """Unmap or free the region with its GPU's context current (on whatever
        thread calls: an executor's too), the caller's context current again
        after; the release runs at most once, and a close whose context could
        not be set may be called again."""
        release = self._release
        if release is None:
            return
        with current_device(self._device.index):
            self._release = None
            release()

    def unlink(self) -> None:
        """Nothing to unlink: GPU memory has no name; close() frees or unmaps it."""

    def __repr__(self) -> str:
        return (f"CudaRegion({self._name!r}, {self._nbytes} B at {self._address:#x} on "
                f"{self._device.uuid or self._device.index})")


class ExportedVmmRegion(CudaRegion):
    """A VMM allocation the sidecar made and exports as a POSIX fd: the fd
    travels over the fd socket (the ``FdExport`` protocol), and the reference
    names the fd set once :meth:`share` recorded it."""

    def __init__(self, name: str, address: int, nbytes: int, device: Device, alloc_bytes: int,
                 release: Callable[[], None], fd: int) -> None:
        super().__init__(name, address, nbytes, device,
                         CudaVmmRef("0" * 32, 0, device.uuid, nbytes, alloc_bytes), release)
        self._fd = fd
        self._alloc_bytes = alloc_bytes
        self._share: tuple[str, int] | None = None

    @property
    def fd(self) -> int:
        if self._fd < 0:
            raise RegionError(f"{self.name}: its exported fd is closed")
        return self._fd

    def share(self, token: str, index: int) -> None:
        self._share = (token, index)

    def ref(self) -> RegionRef:
        if self._share is None:
            raise RegionError(f"{self.name} has not been offered on the fd socket")
        return CudaVmmRef(self._share[0], self._share[1], self.device.uuid, self.nbytes,
                          self._alloc_bytes)

    def close(self) -> None:
        """Unmap and release the allocation, and close the exported fd (also
        when the release failed: the fd would otherwise keep it alive)."""
        try:
            super().close()
        finally:
            fd, self._fd = self._fd, -1
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


def open_ipc(ref: CudaIpcRef) -> CudaRegion:
    """Open a legacy CUDA IPC handle (engine side of ``cuda_malloc``)."""
    drv = driver()
    ordinal = ordinal_for_uuid(ref.device_uuid)
    flags = drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    with current_device(ordinal):
        base = int(check(drv.cuIpcOpenMemHandle(handle_from_bytes(ref.handle), flags),
                         "cuIpcOpenMemHandle"))

    def release() -> None:
        check(drv.cuIpcCloseMemHandle(base), "cuIpcCloseMemHandle")

    return CudaRegion(f"cuda_ipc@{ref.device_uuid}", base + ref.offset, ref.nbytes,
                      Device(ordinal, ref.device_uuid), ref, release)


def access_desc(drv: Any, ordinal: int) -> Any:
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def map_vmm(drv: Any, handle: Any, alloc_bytes: int, ordinal: int) -> int:
    """Reserve an address range, map the allocation and enable read-write access."""
    ptr = int(check(drv.cuMemAddressReserve(alloc_bytes, 0, 0, 0), "cuMemAddressReserve"))
    try:
        check(drv.cuMemMap(ptr, alloc_bytes, 0, handle, 0), "cuMemMap")
        try:
            check(drv.cuMemSetAccess(ptr, alloc_bytes, [access_desc(drv, ordinal)], 1),
                  "cuMemSetAccess")
        except CudaError:
            drv.cuMemUnmap(ptr, alloc_bytes)
            raise
    except CudaError:
        drv.cuMemAddressFree(ptr, alloc_bytes)
        raise
    return ptr


def unmap_vmm(drv: Any, ptr: int, handle: Any, alloc_bytes: int) -> None:
    """Undo :func:`map_vmm` and drop ``handle``: unmap, free the range, release.

    Every step is tried even when one before it failed, and the first
    failure is raised afterwards: releasing the handle is valid while the
    range is still mapped (the driver frees the memory once the last mapping
    and reference are gone), so a failed unmap never also leaks the handle.
    """
    first: CudaError | None = None
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("cuMemUnmap", lambda: drv.cuMemUnmap(ptr, alloc_bytes)),
        ("cuMemAddressFree", lambda: drv.cuMemAddressFree(ptr, alloc_bytes)),
        ("cuMemRelease", lambda: drv.cuMemRelease(handle))]
    for what, call in steps:
        try:
            check(call(), what)
        except CudaError as e:
            first = first or e
    if first is not None:
        raise first


def import_vmm(ref: CudaVmmRef, fd: int) -> CudaRegion:
    """Import a VMM allocation from its POSIX fd (engine side of ``cuda_vmm``).

    Takes ownership of ``fd`` (closed once imported: the imported handle keeps
    the allocation alive, the fd is no longer needed)."""
    try:
        drv = driver()
        ordinal = ordinal_for_uuid(ref.device_uuid)
        with current_device(ordinal):
            kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            handle = check(drv.cuMemImportFromShareableHandle(fd, kind),
                           "cuMemImportFromShareableHandle")
            try:
                ptr = map_vmm(drv, handle, ref.alloc_bytes, ordinal)
            except CudaError:
                drv.cuMemRelease(handle)
                raise
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)

    def release() -> None:
        unmap_vmm(drv, ptr, handle, ref.alloc_bytes)

    return CudaRegion(f"cuda_vmm@{ref.device_uuid}", ptr, ref.nbytes,
                      Device(ordinal, ref.device_uuid), ref, release)
