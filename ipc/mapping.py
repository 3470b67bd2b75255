"""The engine's side of allocate mode: map the regions a sidecar allocated.

One table, :data:`MAPPERS`, keyed by the reference's type. Kinds that travel
by file descriptor (memfd, CUDA VMM) first fetch their fd set from the
sidecar's fd socket (:func:`kvsidecar.ipc.fdpass.fetch_fds`); every mapper
takes ownership of its fd. All or none: a failure unmaps what was mapped and
closes every fd.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Final

from .fdpass import fetch_fds
from .memfd import MemfdRegion
from .memory import RegionError, ShmRegion
from .protocol import CudaIpcRef, CudaVmmRef, MemfdRef, RegionRef, ShmRef
from .regions import FD_REFS, Region

__all__ = ["MAPPERS", "map_refs"]

#: (reference, its fd or -1) -> the mapped region. A mapper owns the fd it is given.
Mapper = Callable[[RegionRef, int], Region]


def _map_shm(ref: RegionRef, fd: int) -> Region:
    assert isinstance(ref, ShmRef)  # routed here by type
    return ShmRegion.attach(ref.name, ref.nbytes, offset=ref.offset)


def _map_memfd(ref: RegionRef, fd: int) -> Region:
    assert isinstance(ref, MemfdRef)
    return MemfdRegion.from_fd(fd, ref.nbytes, label=f"memfd#{ref.index}")


def _map_cuda_ipc(ref: RegionRef, fd: int) -> Region:
    assert isinstance(ref, CudaIpcRef)
    from .cuda import open_ipc  # needs cuda-bindings (the gpu extra): imported on use

    return open_ipc(ref)


def _map_cuda_vmm(ref: RegionRef, fd: int) -> Region:
    assert isinstance(ref, CudaVmmRef)
    from .cuda import import_vmm

    return import_vmm(ref, fd)


MAPPERS: Final[dict[type[RegionRef], Mapper]] = {
    ShmRef: _map_shm,
    MemfdRef: _map_memfd,
    CudaIpcRef: _map_cuda_ipc,
    CudaVmmRef: _map_cuda_vmm,
}


def map_refs(refs: Sequence[RegionRef], fd_socket: str = "",
             timeout_s: float = 10.0) -> list[Region]:
    """Map every region of a ``Registered`` reply in this process."""
    fd_refs = [r for r in refs if type(r) in FD_REFS]
    fds: list[int] = []
    if fd_refs:
        if not fd_socket:
            raise RegionError("the sidecar sent fd-passed regions but no fd socket")
        tokens = {r.token for r in fd_refs if isinstance(r, (MemfdRef, CudaVmmRef))}
        if len(tokens) != 1:
            raise RegionError(f"fd-passed regions name {len(tokens)} fd sets, expected one")
        fds = fetch_fds(fd_socket, tokens.pop(), len(fd_refs), timeout_s)
    out: list[Region] = []
    used: set[int] = set()
    try:
        for ref in refs:
            fd = -1
            if isinstance(ref, (MemfdRef, CudaVmmRef)):
                if not 0 <= ref.index < len(fds) or ref.index in used:
                    raise RegionError(f"fd index {ref.index} is out of range or used twice")
                used.add(ref.index)
                fd = fds[ref.index]
            out.append(MAPPERS[type(ref)](ref, fd))
    except BaseException:
        for r in out:
            r.close()
        for i, fd in enumerate(fds):
            if i not in used:  # a mapper owns (and on failure closed) the fds it was given
                with contextlib.suppress(OSError):
                    os.close(fd)
        raise
    return out
