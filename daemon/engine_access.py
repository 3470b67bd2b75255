"""Who may use the engine socket, and the socket file's home.

The engine socket hands out the keys to KV memory (register, read, hold,
deregister), so three layers guard it, none trusting the others:

* its directory belongs to the sidecar's user and nobody else can write it
  (nobody can swap the socket for their own),
* the socket file is created ``0600`` (``0660`` when other users are
  allowed in) whatever the umask; users allowed by uid (``--allow-uid``) are
  let through the file modes by a POSIX ACL entry each on the socket and its
  directory (see :func:`grant_uids`),
* every connection is checked against the connecting process's kernel
  credentials (``SO_PEERCRED``, read once when it is accepted; the kernel
  records them at ``connect``, so they cannot be forged or changed later):
  root bypasses file modes, so file modes alone are not enough.

A second sidecar on the same socket is stopped by an ``flock`` on
``<socket>.lock``, held for the daemon's lifetime, so a stale socket can be
removed without any risk of removing a live one. A clean stop removes the
lock file too, while it still holds the lock; a claimer that opened the file
before that removal checks, once it holds the lock, that the name still
leads to the file it locked, and starts again if not (:func:`lock_socket`),
so two daemons never both hold "the" lock. A daemon killed outright leaves
the file, but the kernel drops its lock: the next start takes it.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fcntl
import os
import socket
import stat
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = [
    "ACCEPT_PAUSE_S",
    "AccessPolicy",
    "PeerCred",
    "SocketInUse",
    "acl_blob",
    "claim_socket",
    "current_peer",
    "grant_uids",
    "lock_socket",
    "open_to",
    "peer_cred",
    "prepare_socket_dir",
    "restricted_umask",
    "unlock_socket",
]


@dataclass(frozen=True)
class PeerCred:
    """The kernel's word on who is at the other end of a Unix socket connection."""

    uid: int
    gid: int
    pid: int


#: The credentials of the engine whose request is being answered. The engine
#: server sets it in each request's own task, so handlers read it without a
#: parameter threaded through every call (None: not known, e.g. in unit tests
#: that call a handler directly).
current_peer: contextvars.ContextVar[PeerCred | None] = contextvars.ContextVar(
    "kvsidecar_engine_peer", default=None)


#: how long a local socket (the engine socket, the fd socket) stops accepting
#: after an accept failed for want of fds or memory (EMFILE, ENFILE, ENOBUFS)
ACCEPT_PAUSE_S = 0.1

_UCRED = struct.Struct("3i")


def peer_cred(sock: socket.socket) -> PeerCred | None:
    """The kernel's credentials of a connected Unix socket's other end (None
    where they cannot be read: the caller then refuses, it never guesses)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCred(uid, gid, pid)


@dataclass(frozen=True)
class AccessPolicy:
    """Engines whose uid is in ``uids`` or whose gid is in ``gids`` may connect."""

    uids: frozenset[int]
    gids: frozenset[int] = frozenset()

    @classmethod
    def own_uid(cls) -> AccessPolicy:
        return cls(frozenset({os.geteuid()}))

    @classmethod
    def of(cls, uids: Iterable[int] = (), gids: Iterable[int] = ()) -> AccessPolicy:
        """The sidecar's own uid is always allowed (its own tools, tests)."""
        return cls(frozenset({os.geteuid(), *uids}), frozenset(gids))

    def allows(self, cred: PeerCred | None) -> bool:
        return cred is not None and (cred.uid in self.uids or cred.gid in self.gids)

    @property
    def group(self) -> int | None:
        """The group the socket (and a directory the sidecar creates) is given, so
        that members of an allowed group pass the file modes too."""
        return min(self.gids) if self.gids else None

    @property
    def other_uids(self) -> frozenset[int]:
        """Allowed users besides the sidecar's own (given ACL entries on the socket)."""
        return self.uids - {os.geteuid()}

    @property
    def shared(self) -> bool:
        """Whether users other than the sidecar's own must reach the socket file."""
        return bool(self.gids) or self.uids != {os.geteuid()}

    def describe(self) -> str:
        gids = f", gids {sorted(self.gids)}" if self.gids else ""
        return f"uids {sorted(self.uids)}{gids}"


_ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = 2
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_NO_ID = 0xFFFFFFFF


def acl_blob(mode: int, uids: Iterable[int], perm: int) -> bytes:
    """The kernel's ``system.posix_acl_access`` value: ``mode``'s owner, group and
    other bits plus a ``perm`` (rwx bits, 0-7) entry for each of ``uids``."""
    entries = [(_ACL_USER_OBJ, (mode >> 6) & 7, _ACL_NO_ID)]
    entries += [(_ACL_USER, perm, uid) for uid in sorted(set(uids))]
    group = (mode >> 3) & 7
    entries += [(_ACL_GROUP_OBJ, group, _ACL_NO_ID), (_ACL_MASK, group | perm, _ACL_NO_ID),
                (_ACL_OTHER, mode & 7, _ACL_NO_ID)]
    return struct.pack("<I", _ACL_VERSION) + b"".join(
        struct.pack("<HHI", tag, p, i) for tag, p, i in entries)


def grant_uids(path: str | int, uids: Iterable[int], perm: int) -> bool:
    """Let ``uids`` through ``path``'s file modes with ``perm`` (a POSIX ACL entry
    each); False when the file system takes no ACLs (the caller then opens the
    mode to others: every connection's credentials are checked anyway). ``path``
    may be an open file descriptor."""
    wanted = sorted(set(uids))
    if not wanted:
        return True
    mode = stat.S_IMODE(os.stat(path).st_mode)
    try:
        os.setxattr(path, _ACL_XATTR, acl_blob(mode, wanted, perm))
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise
    return True


def open_to(path: str | int, uids: Iterable[int], perm: int) -> None:
    """:func:`grant_uids`, or where ACLs are not supported, ``perm`` for others
    (the credential check on every connection is then the only gate)."""
    if not grant_uids(path, uids, perm):
        os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) | perm)


class SocketInUse(RuntimeError):
    """Another sidecar serves this socket; the message is the one line to print."""


def prepare_socket_dir(directory: str, *, shared: bool, group: int | None = None,
                       uids: Iterable[int] = ()) -> None:
    """Create the socket's directory (0700; 0750 and ``group`` when ``shared``, and
    search permission for each of ``uids``) or check that an existing one is the
    sidecar's: owned by its user (or root) and writable by nobody else. Raises
    PermissionError with what is wrong.

    The path is normalised first (``a/new/..`` is ``a``), and modes, group and
    ACL entries are only ever set on the directory this call itself created,
    through a descriptor of it: a directory that already existed (``/tmp``, say)
    is checked, never changed."""
    directory = os.path.abspath(directory)
    parent = os.path.dirname(directory)
    if not os.path.isdir(directory) and parent != directory:
        os.makedirs(parent, exist_ok=True)  # missing ancestors: default modes, never changed
        created = True
        try:
            os.mkdir(directory, 0o700)  # the umask can only narrow it
        except FileExistsError:  # made by someone else meanwhile: checked like any other
            created = False
        if created:
            _settle_new_dir(directory, 0o750 if shared else 0o700, group, uids)
    st = os.stat(directory)  # the directory the socket is bound in, symlinks resolved
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"socket directory {directory} is not a directory")
    _check_socket_dir(directory, st)


def _settle_new_dir(directory: str, mode: int, group: int | None, uids: Iterable[int]) -> None:
    """Set the mode (group, ACL entries) of the directory just made, through a
    descriptor opened without following a symlink, so a name swapped meanwhile
    changes nothing."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _check_socket_dir(directory, os.fstat(fd), ignore_mode=True)
        os.fchmod(fd, mode)
        if group is not None:
            os.fchown(fd, -1, group)
        open_to(fd, uids, 0o5)
    finally:
        os.close(fd)


def _check_socket_dir(directory: str, st: os.stat_result, *, ignore_mode: bool = False) -> None:
    if st.st_uid not in (os.geteuid(), 0):
        raise PermissionError(
            f"socket directory {directory} belongs to uid {st.st_uid}, not to this sidecar "
            f"(uid {os.geteuid()}); use a directory the sidecar owns (--socket, "
            "$RUNTIME_DIRECTORY)")
    if not ignore_mode and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"socket directory {directory} is writable by others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}): anyone could replace the socket; "
            "use a directory only the sidecar can write")


@contextlib.contextmanager
def restricted_umask(mask: int = 0o177) -> Iterator[None]:
    """Create files (the socket) with no group/other bits whatever the inherited umask.

    The umask is process-wide; this runs once at start-up, before any engine
    thread exists, and the mode is set explicitly right after anyway.
    """
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


#: Times :func:`lock_socket` opens the lock file again after finding it
#: replaced under it; each replacement is a sidecar stopping and another
#: starting meanwhile, so a few are plenty.
_LOCK_TRIES = 8


def lock_socket(path: str) -> int:
    """Take the flock on ``<path>.lock`` (created if missing) and return its fd.

    Raises :class:`SocketInUse` when another process holds it, OSError when the
    file cannot be opened. After locking, the name must still lead to the file
    locked: a sidecar stopping removes the file (still holding the lock) right
    before it closes it, and the file this call opened before that removal is
    then locked by nobody else but no longer the one others find, so it is let
    go and the name opened again.
    """
    lock = path + ".lock"
    for _ in range(_LOCK_TRIES):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SocketInUse(f"another sidecar is serving {path} (it holds {lock}); "
                                  "not starting a second one") from None
            raise
        if _names(lock, fd):
            return fd
        os.close(fd)
    raise SocketInUse(f"{lock} was replaced {_LOCK_TRIES} times while this sidecar took it: "
                      "sidecars keep starting and stopping on this socket")


def unlock_socket(path: str, fd: int) -> None:
    """Release the lock :func:`lock_socket` returned as ``fd``, removing
    ``<path>.lock`` first if it is still the file locked (so a clean stop leaves
    no file behind). Removed while locked: nobody that follows this protocol
    can remove or replace the name meanwhile, and whoever locks the removed
    file afterwards finds it gone from its name and opens the name again."""
    try:
        if _names(path + ".lock", fd):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path + ".lock")
    finally:
        os.close(fd)


def _names(name: str, fd: int) -> bool:
    """Whether ``name`` (not followed if a symlink) is the file open as ``fd``."""
    try:
        st = os.lstat(name)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def claim_socket(path: str) -> int:
    """Take ``<path>.lock`` for this daemon's lifetime and clear a stale socket.

    Returns the lock's fd (give it to :func:`unlock_socket` to release the
    claim). Raises :class:`SocketInUse` when another process holds the lock or
    answers on the socket, and FileExistsError when ``path`` is something other
    than a socket; in both cases ``path`` is left as it is (and the lock
    released as :func:`unlock_socket` does).
    """
    fd = lock_socket(path)
    try:
        _remove_stale_socket(path)
    except BaseException:
        unlock_socket(path, fd)
        raise
    return fd


def _remove_stale_socket(path: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    except OSError as e:
        if e.errno != errno.EPROTOTYPE:  # a live socket of another type answers too
            raise
    finally:
        probe.close()
    # Someone answers without holding the lock: an older sidecar, or a stranger.
    raise SocketInUse(f"another process is serving {path}; not starting a second sidecar on it")
