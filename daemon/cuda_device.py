"""The sidecar's GPU (``--device cuda:N``): allocates, exports and attaches GPU regions.

Why the sidecar allocates: the process that registers memory with NIXL/UCX
must own it. Memory imported from another process (``cuIpcOpenMemHandle``)
cannot be re-exported by any documented CUDA call, and UCX's cuda_ipc and
dma-buf paths need that export; where it fails, UCX quietly takes a slower
path. So the sidecar allocates, registers as VRAM and exports to the engine:

* ``cuda_malloc``: ``cuMemAlloc`` + legacy IPC handle (every UCX version);
* ``cuda_vmm``: ``cuMemCreate`` with a POSIX-fd handle type (plus
  ``gpuDirectRDMACapable`` where the device supports RDMA on VMM memory),
  exported with ``cuMemExportToShareableHandle`` and passed to the engine
  over the fd socket (SCM_RIGHTS).

Engine-allocated GPU memory (attach mode, :class:`CudaIpcRef`) is opened
here and registered only as ``--cuda-attach`` and the start-up VRAM
transport check allow (:func:`~kvsidecar.ipc.cuda_handles.decide_attach`).

Nothing here runs without a GPU; no test here has one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from kvsidecar.ipc import cuda
from kvsidecar.ipc.cuda import (
    CudaError,
    CudaRegion,
    ExportedVmmRegion,
    check,
    handle_bytes,
    map_vmm,
    unmap_vmm,
)
from kvsidecar.ipc.cuda_handles import AttachPolicy, decide_attach, vmm_alloc_bytes
from kvsidecar.ipc.protocol import BAD_REQUEST, CudaIpcRef, RequestError
from kvsidecar.ipc.regions import Device, Region

log = logging.getLogger(__name__)

__all__ = ["CudaDevice"]


class CudaDevice:
    """One GPU as the sidecar uses it. :meth:`open` resolves it (needs a GPU)."""

    def __init__(self, ordinal: int, attach_policy: AttachPolicy = "warn") -> None:
        self.ordinal = ordinal
        self.attach_policy: AttachPolicy = attach_policy
        #: set from the start-up VRAM transport check (None: not run yet / off)
        self.vram_check_passed: bool | None = None
        self._device = Device(ordinal, "")
        self._drv: Any = None

    def open(self) -> None:
        """Initialise the driver, name the GPU and make its context current here."""
        self._drv = cuda.driver()
        self._device = Device(self.ordinal, cuda.device_uuid(self.ordinal))
        cuda.make_current(self.ordinal)
        log.info("GPU cuda:%d is %s", self.ordinal, self._device.uuid)

    @property
    def device(self) -> Device:
        return self._device

    def make_current(self) -> None:
        """For the NIXL worker thread, before it registers or transfers."""
        cuda.make_current(self.ordinal)

    def attribute(self, name: str) -> int:
        drv = self._need()
        attr = getattr(drv.CUdevice_attribute, name)
        dev = check(drv.cuDeviceGet(self.ordinal), "cuDeviceGet")
        return int(check(drv.cuDeviceGetAttribute(attr, dev), f"cuDeviceGetAttribute({name})"))

    # -- allocate mode --------------------------------------------------------------------------

    def allocate(self, kind: str, count: int, nbytes: int) -> list[Region]:
        make = {"cuda_malloc": self._malloc, "cuda_vmm": self._vmm}.get(kind)
        if make is None:
            raise RequestError(BAD_REQUEST, f"a GPU sidecar does not allocate {kind!r} memory")
        cuda.make_current(self.ordinal)  # a run_in_executor thread: set its context
        out: list[Region] = []
        try:
            for i in range(count):
                out.append(make(i, nbytes))
        except BaseException:
            for r in out:
                r.close()
            raise
        return out

    def _malloc(self, i: int, nbytes: int) -> CudaRegion:
        drv = self._need()
        ptr = int(check(drv.cuMemAlloc(nbytes), f"cuMemAlloc({nbytes})"))
        try:
            cuda.fill(ptr, 0, nbytes)  # zero, and done before it is handed out
            raw = handle_bytes(check(drv.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle"))
        except CudaError:
            drv.cuMemFree(ptr)
            raise

        def release() -> None:
            check(drv.cuMemFree(ptr), "cuMemFree")

        ref = CudaIpcRef(raw, self._device.uuid, nbytes, 0)
        return CudaRegion(f"cuda_malloc#{i}", ptr, nbytes, self._device, ref, release)

    def _vmm(self, i: int, nbytes: int) -> CudaRegion:
        drv = self._need()
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.ordinal
        fd_type = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop.requestedHandleTypes = fd_type
        # A request CUDA may ignore; UCX checks the pointer attribute itself.
        prop.allocFlags.gpuDirectRDMACapable = int(bool(
            self.attribute("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED")))
        gran = int(check(drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity"))
        size = vmm_alloc_bytes(nbytes, gran)
        handle = check(drv.cuMemCreate(size, prop, 0), f"cuMemCreate({size})")
        fd, ptr = -1, 0
        try:
            fd = int(check(drv.cuMemExportToShareableHandle(handle, fd_type, 0),
                           "cuMemExportToShareableHandle(POSIX_FD)"))
            ptr = map_vmm(drv, handle, size, self.ordinal)
            cuda.fill(ptr, 0, size)
        except BaseException:
            # Give back every step that succeeded, last first: a failure after
            # map_vmm must not leave the range mapped and reserved.
            if ptr:
                drv.cuMemUnmap(ptr, size)
                drv.cuMemAddressFree(ptr, size)
            if fd >= 0:
                os.close(fd)
            drv.cuMemRelease(handle)
            raise

        def release() -> None:
            unmap_vmm(drv, ptr, handle, size)

        return ExportedVmmRegion(f"cuda_vmm#{i}", ptr, nbytes, self._device, size, release, fd)

    # -- attach mode ----------------------------------------------------------------------------

    def attach_ipc(self, refs: Sequence[CudaIpcRef], owner_uid: int | None) -> list[Region]:
        """Open engine-allocated regions if the policy and the VRAM check allow it.

        ``owner_uid`` is not checkable for GPU memory (a handle carries no
        owner); the engine socket's uid check already limits who can send one.
        """
        decision = decide_attach(self.attach_policy, self.vram_check_passed, list(refs),
                                 self._device.uuid)
        if not decision.serve:
            raise RequestError(BAD_REQUEST, decision.message)
        (log.warning if self.attach_policy == "warn" else log.info)("%s", decision.message)
        out: list[Region] = []
        try:
            for ref in refs:
                out.append(cuda.open_ipc(ref))
        except BaseException:
            for r in out:
                r.close()
            raise
        return out

    def _need(self) -> Any:
        if self._drv is None:
            raise CudaError(f"GPU cuda:{self.ordinal} was not opened")
        return self._drv
