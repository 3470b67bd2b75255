"""Host memory in an anonymous memfd, shared by passing its file descriptor.

Why next to POSIX shm: a memfd has no name, so nothing in ``/dev/shm`` can be
guessed, opened by another tenant or leaked by a crash (the pages go with the
last fd or mapping), and it needs no shared ``/dev/shm`` between containers,
only a Unix socket to pass the fd over (``SCM_RIGHTS``, see
:mod:`kvsidecar.ipc.fdpass`). It is also the host-memory twin of the CUDA VMM
path, whose exported handle is a file descriptor too, so one fd channel
serves both.

Sealed: the sidecar seals every memfd it creates against shrinking and
growing (``F_SEAL_SHRINK | F_SEAL_GROW``, then ``F_SEAL_SEAL`` so no one can
change that). A process holding the fd can then not ``ftruncate`` the pages
out from under a mapping, which would kill whoever touches them next with
SIGBUS (the sidecar serving a peer's read, or the engine). The engine's side
(:meth:`MemfdRegion.from_fd`) maps only a memfd that carries
``F_SEAL_SHRINK``: a regular file or an unsealed memfd is refused.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os

from .memory import RegionError, ShmRegion
from .protocol import MemfdRef

__all__ = ["SIZE_SEALS", "MemfdRegion", "check_sealed", "seal_size"]

#: The seals that fix a memfd's size: no shrink (SIGBUS for every mapping past the
#: new end), no grow (a quota-free way to take host memory through the fd).
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def seal_size(fd: int) -> None:
    """Seal ``fd`` (a memfd made with ``MFD_ALLOW_SEALING``) against any size change,
    and against further seal changes."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_SEAL)


def check_sealed(fd: int, label: str) -> None:
    """Raise RegionError unless ``fd`` is a memfd (or other shmem file) sealed
    against shrinking: only then can no process cut its pages from under a mapping."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # EINVAL: a regular file, pipe, socket... (no seals at all)
        raise RegionError(f"{label}: the received fd is not a memfd (it has no seals); "
                          "refusing to map it") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise RegionError(f"{label}: the received memfd is not sealed against shrinking "
                          "(F_SEAL_SHRINK): whoever holds it could truncate it under this "
                          "mapping; refusing to map it")

_MAP_FIXED = 0x10  # Linux (every architecture this runs on); the mmap module lacks it
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]


def _map_fixed(address: int, nbytes: int, fd: int) -> None:
    """Map ``fd`` (shared, read-write) at exactly ``address``, replacing what was there."""
    got = _libc.mmap(address, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
    if got != address:
        err = ctypes.get_errno()
        raise RegionError(f"cannot map a memfd at {address:#x}: {os.strerror(err)}")


class MemfdRegion(ShmRegion):
    """A mapped memfd. :meth:`ref` works once :meth:`share` named the fd set
    (the token) it travels in; views and lazy unmapping are ShmRegion's."""

    def __init__(self, label: str, nbytes: int, mm: mmap.mmap, fd: int, owner: bool) -> None:
        super().__init__(label, nbytes, 0, mm, 0, owner=owner)
        self._fd: int | None = fd
        self._share: tuple[str, int] | None = None

    @classmethod
    def create(cls, name: str, nbytes: int, *, reserve: bool = True,
               owner_uid: int | None = None) -> MemfdRegion:
        """A new zero-filled memfd of ``nbytes``, its size sealed (``reserve``: pages
        allocated now, so a full memory cgroup fails here, not with SIGBUS on first
        touch). ``owner_uid`` is ignored: a memfd reaches its engine as an fd."""
        if nbytes < 1:
            raise RegionError(f"memfd {name!r}: nbytes must be >= 1, got {nbytes}")
        try:
            fd = os.memfd_create(name[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except (OSError, AttributeError) as e:
            raise RegionError(f"cannot create a memfd: {e}") from e
        try:
            os.ftruncate(fd, nbytes)
            if reserve:
                os.posix_fallocate(fd, 0, nbytes)
            seal_size(fd)
            mm = mmap.mmap(fd, nbytes)
        except (OSError, OverflowError) as e:
            os.close(fd)
            raise RegionError(f"cannot create a memfd of {nbytes} B: {e}") from e
        return cls(name, nbytes, mm, fd, owner=True)

    @classmethod
    def from_fd(cls, fd: int, nbytes: int, label: str = "memfd") -> MemfdRegion:
        """Map a received memfd (takes ownership of ``fd``), checking it is a memfd
        sealed against shrinking (:func:`check_sealed`) that holds ``nbytes``."""
        try:
            check_sealed(fd, label)
            size = os.fstat(fd).st_size
            if size < nbytes or nbytes < 1:
                raise RegionError(f"{label}: the received fd holds {size} B, "
                                  f"the region needs {nbytes} B")
            try:
                mm = mmap.mmap(fd, nbytes)
            except OSError as e:
                raise RegionError(f"cannot map {label}: {e}") from e
        except BaseException:
            os.close(fd)
            raise
        return cls(label, nbytes, mm, fd, owner=False)

    @property
    def fd(self) -> int:
        """The memfd (to pass to another process); an error once closed."""
        if self._fd is None:
            raise RegionError(f"memfd {self.name!r} is closed in this process")
        return self._fd

    def share(self, token: str, index: int) -> None:
        """This region travels as fd ``index`` of the set ``token`` names."""
        self._share = (token, index)

    def ref(self) -> MemfdRef:  # type: ignore[override]
        if self._share is None:
            raise RegionError(f"memfd {self.name!r} has not been offered on the fd socket")
        return MemfdRef(self._share[0], self._share[1], self.nbytes)

    def close(self) -> None:
        super().close()
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def take_over(self, other: MemfdRegion) -> None:
        """Go on in ``other``'s memfd at this region's address, contents kept.

        Copies this region's bytes into ``other``, then maps ``other``'s memfd
        over this region's own mapping (``MAP_FIXED``: one replacement, no
        unmapped gap), so every pointer into this region (numpy views, vLLM's
        KV tensors) reaches ``other``'s pages from now on, with the same bytes.
        This region's old pages go with its old fd, closed here; it keeps a
        duplicate of ``other``'s fd, and ``other`` (mapped elsewhere) is closed.
        What a restarted sidecar needs: it allocated ``other``, and cannot
        reach the memfd its predecessor allocated. Nothing may write into this
        region meanwhile (its owner calls this from the thread that uses it).
        """
        if other.nbytes != self.nbytes:
            raise RegionError(f"memfd {self.name!r} is {self.nbytes} B, its replacement "
                              f"{other.nbytes} B")
        other.numpy()[:] = self.numpy()
        fd = os.dup(other.fd)
        try:
            _map_fixed(self.address, self.nbytes, fd)
        except BaseException:
            os.close(fd)
            raise
        old, self._fd = self._fd, fd
        self._share = None
        if old is not None:
            os.close(old)
        other.close()

    def unlink(self) -> None:
        """Nothing to unlink: a memfd has no name; its pages go with the last fd."""

    def __repr__(self) -> str:
        return f"MemfdRegion({self.name!r}, nbytes={self.nbytes})"
