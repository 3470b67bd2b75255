"""POSIX shared-memory regions: host KV caches both an engine and its sidecar map.

Either side may create a region (engine: attach mode; sidecar: allocate mode);
the other maps it by name from a :class:`~kvsidecar.ipc.protocol.ShmRef`. Both
mappings are the same physical pages, so NIXL reads land in the engine's cache
without a copy.

This is not :mod:`multiprocessing.shared_memory` on purpose: that module
registers every segment it opens with the resource tracker, which unlinks
(and warns about) segments at exit, including ones another process owns. Here
only an explicit :meth:`ShmRegion.unlink` removes a segment.
"""

from __future__ import annotations

import _posixshmem  # CPython's shm_open/shm_unlink, as multiprocessing uses
import contextlib
import ctypes
import itertools
import mmap
import os
import secrets
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from .layout import Layout
from .protocol import RegionRef, ShmRef
from .regions import HOST, Device, MemType

if TYPE_CHECKING:
    import torch as _torch

_counter = itertools.count()
_NAME_MAX = 200  # well under NAME_MAX (255); macOS allows only 31, keep prefixes short
#: Regions an engine creates and registers in attach mode must be named with
#: this prefix (``allocate_for_layout(layout, ENGINE_SHM_PREFIX + ...)``): the
#: sidecar maps nothing else, so a request cannot point it at some other
#: program's shared memory that happens to belong to the same user. The
#: sidecar's own allocations are named ``kvs-...`` and can never match it.
ENGINE_SHM_PREFIX = "kvsidecar-"


class RegionError(MemoryError):
    """A region cannot be created or mapped as asked (missing, too small, bad name).

    A MemoryError because, to the engine, it is a failure to obtain memory.
    """


def unique_name(prefix: str = "kvs") -> str:
    """A short name unlikely to collide across processes, forks and restarts."""
    return f"{prefix}-{os.getpid():x}-{next(_counter):x}-{secrets.token_hex(3)}"


def _check_name(name: str) -> str:
    if not name or "/" in name or "\0" in name or len(name) > _NAME_MAX:
        raise RegionError(
            f"bad shared memory name {name!r}: 1..{_NAME_MAX} characters, no '/' or NUL"
        )
    return name


def _shm_open(name: str, flags: int, mode: int = 0o600) -> int:
    fd: int = _posixshmem.shm_open("/" + name, flags, mode)
    return fd


class ShmRegion:
    """One mapped shared-memory region, ``nbytes`` long at ``offset`` into its object.

    :meth:`close` unmaps lazily: numpy and torch views keep the mapping alive
    until the last of them is gone, so a view can never point at unmapped
    memory.
    """

    def __init__(self, name: str, nbytes: int, offset: int, mm: mmap.mmap, delta: int,
                 owner: bool) -> None:
        """Use :meth:`create` or :meth:`attach`."""
        self._name = name
        self._nbytes = nbytes
        self._offset = offset
        self._mm: mmap.mmap | None = mm
        self._delta = delta  # where the region starts inside the (page-aligned) mapping
        self._owner = owner
        anchor = ctypes.c_char.from_buffer(mm)  # a buffer export: must not outlive this line
        self._address = ctypes.addressof(anchor) + delta
        del anchor

    @classmethod
    def create(cls, name: str, nbytes: int, *, reserve: bool = True,
               owner_uid: int | None = None) -> ShmRegion:
        """Create a new zero-filled segment (fails if ``name`` exists).

        ``reserve`` allocates the pages now, so a full ``/dev/shm`` fails here
        with a clear error instead of killing a process with SIGBUS on first touch.
        ``owner_uid``: the user the segment is given to (a sidecar allocating for
        an engine of another allowed user, which could not open a 0600 segment
        of the sidecar's own); needs the right to chown (root, CAP_CHOWN).
        """
        _check_name(name)
        if nbytes < 1:
            raise RegionError(f"shared memory {name!r}: nbytes must be >= 1, got {nbytes}")
        try:
            fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR)
        except FileExistsError:
            raise RegionError(f"shared memory {name!r} already exists") from None
        try:
            try:
                if owner_uid is not None and owner_uid != os.geteuid():
                    os.fchown(fd, owner_uid, -1)
                os.ftruncate(fd, nbytes)
                if reserve and hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, nbytes)
                mm = mmap.mmap(fd, nbytes)
            except (OSError, OverflowError) as e:
                _posixshmem.shm_unlink("/" + name)
                raise RegionError(f"cannot create shared memory {name!r} of {nbytes} B: {e}") from e
        finally:
            os.close(fd)
        return cls(name, nbytes, 0, mm, 0, owner=True)

    @classmethod
    def attach(cls, name: str, nbytes: int, *, offset: int = 0,
               owner_uid: int | None = None) -> ShmRegion:
        """Map an existing segment, checking it holds ``offset + nbytes`` bytes and,
        with ``owner_uid``, that it belongs to that user (checked on the opened
        object, so a symlink or a rename cannot swap it in between)."""
        _check_name(name)
        if nbytes < 1 or offset < 0:
            raise RegionError(
                f"shared memory {name!r}: need nbytes >= 1 and offset >= 0, "
                f"got nbytes={nbytes} offset={offset}"
            )
        try:
            fd = _shm_open(name, os.O_RDWR)
        except FileNotFoundError:
            raise RegionError(
                f"shared memory {name!r} does not exist (unlinked already, or created in "
                "another IPC namespace: engine and sidecar must share /dev/shm)"
            ) from None
        try:
            st = os.fstat(fd)
            if owner_uid is not None and st.st_uid != owner_uid:
                raise RegionError(
                    f"shared memory {name!r} belongs to uid {st.st_uid}, not to the "
                    f"registering engine's uid {owner_uid}"
                )
            size = st.st_size
            if size < offset + nbytes:
                raise RegionError(
                    f"shared memory {name!r} is {size} B, too small for {nbytes} B at offset "
                    f"{offset}"
                )
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            try:
                mm = mmap.mmap(fd, nbytes + offset - start, offset=start)
            except OSError as e:
                raise RegionError(f"cannot map shared memory {name!r}: {e}") from e
        finally:
            os.close(fd)
        return cls(name, nbytes, offset, mm, offset - start, owner=False)

    @property
    def name(self) -> str:
        return self._name

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def address(self) -> int:
        """The region's first byte in this process, for NIXL registration."""
        self._mapping()
        return self._address

    @property
    def mem_type(self) -> MemType:
        return "DRAM"

    @property
    def device(self) -> Device:
        return HOST

    @property
    def owner(self) -> bool:
        """Created by this object: leaving its ``with`` block also unlinks it."""
        return self._owner

    @property
    def closed(self) -> bool:
        return self._mm is None

    def ref(self) -> ShmRef:
        return ShmRef(self._name, self._nbytes, self._offset)

    def numpy(self) -> npt.NDArray[np.uint8]:
        """A writable uint8 view of the region (no copy)."""
        return np.frombuffer(self._mapping(), np.uint8, self._nbytes, self._delta)

    def torch(self) -> _torch.Tensor:
        """A uint8 CPU tensor view of the region (no copy); imports torch on first use."""
        try:
            import torch
        except ImportError:
            raise ImportError("Region.torch() needs torch: pip install 'kvsidecar[torch]' "
                              "(or use Region.numpy())") from None

        # torch.frombuffer keeps a reference to the object but not a buffer
        # export; a memoryview holds the export, so close() cannot unmap
        # under a live tensor.
        view = memoryview(self._mapping())[self._delta : self._delta + self._nbytes]
        return torch.frombuffer(view, dtype=torch.uint8)

    def close(self) -> None:
        """Drop this mapping; it is unmapped once no numpy/torch view uses it."""
        mm, self._mm = self._mm, None
        if mm is not None:
            # With views still alive close() refuses; the mmap object then
            # unmaps when the last view goes.
            with contextlib.suppress(BufferError):
                mm.close()

    def unlink(self) -> None:
        """Remove the name (existing mappings stay valid); a no-op if already gone."""
        with contextlib.suppress(FileNotFoundError):
            _posixshmem.shm_unlink("/" + self._name)

    def __enter__(self) -> ShmRegion:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
        if self._owner:
            self.unlink()

    def __repr__(self) -> str:
        state = "closed" if self._mm is None else f"at 0x{self._address:x}"
        return f"ShmRegion({self._name!r}, nbytes={self._nbytes}, offset={self._offset}, {state})"

    def _mapping(self) -> mmap.mmap:
        if self._mm is None:
            raise RegionError(f"shared memory {self._name!r} is closed in this process")
        return self._mm


def allocate_for_layout(layout: Layout, prefix: str = "kvs", *,
                        reserve: bool = True) -> list[ShmRegion]:
    """Create the ``layout.num_regions`` regions of one engine rank (all or none)."""
    out: list[ShmRegion] = []
    try:
        for _ in range(layout.num_regions):
            out.append(ShmRegion.create(unique_name(prefix), layout.region_bytes,
                                        reserve=reserve))
    except BaseException:
        _discard(out, unlink=True)
        raise
    return out


def attach_refs(refs: Sequence[RegionRef], *, owner_uid: int | None = None) -> list[ShmRegion]:
    """Map regions another process created (all or none); with ``owner_uid``
    only objects that user owns."""
    out: list[ShmRegion] = []
    try:
        for ref in refs:
            if not isinstance(ref, ShmRef):  # callers use kvsidecar.ipc.mapping for others
                raise RegionError(f"cannot map a region of kind {ref.__struct_config__.tag!r} "
                                  "as POSIX shared memory")
            out.append(ShmRegion.attach(ref.name, ref.nbytes, offset=ref.offset,
                                        owner_uid=owner_uid))
    except BaseException:
        _discard(out, unlink=False)
        raise
    return out


def _discard(regions: Sequence[ShmRegion], *, unlink: bool) -> None:
    for r in regions:
        r.close()
        if unlink:
            r.unlink()
