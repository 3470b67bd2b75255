"""What every kind of KV memory region is: host (DRAM) or GPU (VRAM), on which device.

A region is one contiguous span of an engine rank's KV cache, mapped in this
process at :attr:`Region.address`. Kinds differ in how the memory is made and
shared (POSIX shm, memfd, cudaMalloc + IPC handle, CUDA VMM + fd) but the
planner, the NIXL worker and the handshake only need three facts, which this
protocol carries: the NIXL memory type (``DRAM``/``VRAM``), the device (the
CUDA ordinal NIXL descriptors name, and the GPU UUID that is the same in
every process) and the reference another process maps it by.

Kinds are looked up in tables keyed by the reference's type (see
:mod:`kvsidecar.ipc.mapping` and ``kvsidecar.daemon.memory_kinds``), never in
``isinstance`` ladders: a new kind is a new module plus a table entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, Protocol, TypeAlias, runtime_checkable

import numpy as np
import numpy.typing as npt

from .protocol import CudaIpcRef, CudaVmmRef, MemfdRef, RegionRef, ReservedRef, ShmRef

MemType: TypeAlias = Literal["DRAM", "VRAM"]
MEM_TYPES: Final[tuple[MemType, ...]] = ("DRAM", "VRAM")


@dataclass(frozen=True)
class Device:
    """Where a region lives. ``index`` is the CUDA ordinal in *this* process
    (what NIXL descriptors carry; 0 for host memory, as NIXL wants for DRAM);
    ``uuid`` names the GPU across processes ('' for host memory)."""

    index: int = 0
    uuid: str = ""

    @property
    def is_host(self) -> bool:
        return not self.uuid


HOST: Final = Device()


@runtime_checkable
class Region(Protocol):
    """One mapped region of any kind (host or GPU)."""

    @property
    def address(self) -> int:
        """First byte in this process (a device pointer for VRAM)."""

    @property
    def nbytes(self) -> int: ...

    @property
    def mem_type(self) -> MemType: ...

    @property
    def device(self) -> Device: ...

    @property
    def name(self) -> str:
        """For logs and errors only."""

    def ref(self) -> RegionRef:
        """How another process maps this region."""

    def numpy(self) -> npt.NDArray[np.uint8]:
        """A zero-copy uint8 view of host memory (GPU kinds raise: use ``torch()``)."""

    def close(self) -> None:
        """Drop this process's mapping (GPU kinds the sidecar allocated: free it)."""

    def unlink(self) -> None:
        """Remove a name other processes could still open (a no-op for kinds without one)."""


#: The NIXL memory type of each reference kind: one table, so the planner,
#: worker and handshake agree on it.
REF_MEM_TYPE: Final[dict[type[RegionRef], MemType]] = {
    ShmRef: "DRAM",
    MemfdRef: "DRAM",
    CudaIpcRef: "VRAM",
    CudaVmmRef: "VRAM",
}
# ReservedRef has no memory type of its own: it is its reservation's.

#: Kinds whose references carry file descriptors fetched over the fd socket.
FD_REFS: Final[frozenset[type[RegionRef]]] = frozenset({MemfdRef, CudaVmmRef})


def uniform(regions: list[Region], what: str = "regions") -> tuple[MemType, Device]:
    """The one memory type and device all ``regions`` share.

    One engine rank's regions are registered as one NIXL registration with one
    memory type and device id, and a peer learns them as one pair: mixed
    regions are refused here rather than mis-described later.
    """
    if not regions:
        raise ValueError(f"no {what}")
    first = regions[0]
    for r in regions[1:]:
        if (r.mem_type, r.device) != (first.mem_type, first.device):
            raise ValueError(
                f"{what} mix memory kinds: {first.name!r} is {first.mem_type} on "
                f"{first.device}, {r.name!r} is {r.mem_type} on {r.device}")
    return first.mem_type, first.device


class Referable(Protocol):
    """Anything attach mode can send: it names its memory with a reference."""

    def ref(self) -> RegionRef: ...


@runtime_checkable
class FdExport(Protocol):
    """A region shared by passing a file descriptor (memfd, CUDA VMM POSIX fd)."""

    @property
    def fd(self) -> int: ...

    def share(self, token: str, index: int) -> None:
        """Record that the fd travels as number ``index`` of the set ``token`` names."""


class RegionView:
    """``nbytes`` at ``offset`` into another region (a reservation): same memory
    type and device; the parent's owner frees it, so :meth:`close` only
    forgets the view."""

    def __init__(self, parent: Region, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 1 or offset + nbytes > parent.nbytes:
            raise ValueError(f"view of {nbytes} B at {offset} does not fit {parent.nbytes} B")
        self.parent = parent
        self.offset = offset
        self._nbytes = nbytes

    @property
    def address(self) -> int:
        return self.parent.address + self.offset

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def mem_type(self) -> MemType:
        return self.parent.mem_type

    @property
    def device(self) -> Device:
        return self.parent.device

    @property
    def name(self) -> str:
        return f"{self.parent.name}[{self.offset}:+{self._nbytes}]"

    def ref(self) -> RegionRef:
        return ReservedRef(self.offset, self._nbytes)

    def numpy(self) -> npt.NDArray[np.uint8]:
        return self.parent.numpy()[self.offset:self.offset + self._nbytes]

    def close(self) -> None:
        """The parent's owner frees the memory."""

    def unlink(self) -> None:
        """Nothing of its own to unlink."""
