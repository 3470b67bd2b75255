"""Fetching a registration's file descriptors from the sidecar (SCM_RIGHTS).

Why a second socket: file descriptors (memfd host memory, CUDA VMM POSIX-fd
handles) travel as ancillary data, which the engine channel's messages never
carry (its framing and its readers handle bytes only; it was ZMQ, which
cannot carry them at all, when this socket was made). It sits next to the
engine socket (``<socket>.fds``, same directory, same mode) and is guarded
the same way: the kernel's ``SO_PEERCRED`` of the connection is checked
against the sidecar's access policy *and* against the uid that made the
registration, before anything is read.

Exchange (``SOCK_SEQPACKET``: each send is one message)::

    engine -> sidecar   b"KVSFD/1 <token>"
    sidecar -> engine   b"KVFD" u32 first u32 total   + up to 250 fds (SCM_RIGHTS)
                        ... repeated until ``total`` fds were sent
                      | b"KVER" <utf-8 reason>

The token comes in the ``Registered`` reply over the engine socket, so only
the engine that registered learns it; it stays valid while the registration
lives (a retried registration gets the same token).

This module holds the message format (pure) and the engine's side
(:func:`fetch_fds`); ``kvsidecar.daemon.fd_server`` is the sidecar's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
import struct
import time
from typing import Any, Final

from .seqpacket import set_timeouts

__all__ = ["FD_SOCKET_SUFFIX", "MAX_FDS_PER_MESSAGE", "FdPassError", "batches",
           "encode_error", "encode_header", "encode_request", "fd_socket_for", "fetch_fds",
           "parse_reply", "parse_request"]

FD_SOCKET_SUFFIX: Final = ".fds"
#: The kernel takes at most SCM_MAX_FD (253) descriptors per message.
MAX_FDS_PER_MESSAGE: Final = 250
_REQUEST: Final = b"KVSFD/1 "
_HEADER: Final = struct.Struct("<4sII")
_FDS_MAGIC: Final = b"KVFD"
_ERR_MAGIC: Final = b"KVER"
_TOKEN = re.compile(rb"^[0-9a-f]{16,64}$")
MAX_REQUEST_BYTES: Final = 128
MAX_ERROR_BYTES: Final = 1024


class FdPassError(OSError):
    """File descriptors could not be fetched; the message says why."""


def fd_socket_for(engine_socket: str) -> str:
    """The fd socket that belongs to an engine socket path."""
    return os.path.abspath(engine_socket) + FD_SOCKET_SUFFIX


def encode_request(token: str) -> bytes:
    return _REQUEST + token.encode("ascii")


def parse_request(data: bytes) -> str:
    """The token of a request; FdPassError for anything else."""
    if len(data) > MAX_REQUEST_BYTES or not data.startswith(_REQUEST):
        raise FdPassError("not a KVSFD/1 request")
    token = data[len(_REQUEST):]
    if not _TOKEN.match(token):
        raise FdPassError("malformed token")
    return token.decode("ascii")


def encode_header(first: int, total: int) -> bytes:
    return _HEADER.pack(_FDS_MAGIC, first, total)


def encode_error(reason: str) -> bytes:
    return _ERR_MAGIC + reason.encode()[:MAX_ERROR_BYTES]


def parse_reply(data: bytes) -> tuple[int, int]:
    """``(first, total)`` of one batch; FdPassError with the sidecar's reason
    for an error reply, or for bytes that are neither."""
    if data.startswith(_ERR_MAGIC):
        raise FdPassError("the sidecar refused to pass file descriptors: "
                          + data[len(_ERR_MAGIC):].decode(errors="replace"))
    if len(data) != _HEADER.size or not data.startswith(_FDS_MAGIC):
        raise FdPassError(f"unexpected reply on the fd socket ({len(data)} bytes)")
    _, first, total = _HEADER.unpack(data)
    return int(first), int(total)


def batches(total: int, per_message: int = MAX_FDS_PER_MESSAGE) -> list[tuple[int, int]]:
    """``(first, count)`` of each message that carries ``total`` fds."""
    return [(i, min(per_message, total - i)) for i in range(0, total, per_message)]


def _recv(sock: socket.socket) -> tuple[bytes, list[int], int, Any]:
    """One message and its fds. A refusal sent before the sidecar read our request
    is queued for us, but the sidecar closing with that request unread makes a
    SOCK_SEQPACKET socket report ECONNRESET *before* the queued reply (datagram
    receive checks the socket error first). The error is reported once, so the
    next receive yields the reason (or end of file if there is none)."""
    try:
        return socket.recv_fds(sock, 4096, MAX_FDS_PER_MESSAGE)
    except ConnectionResetError:
        return socket.recv_fds(sock, 4096, MAX_FDS_PER_MESSAGE)


def _connect(sock: socket.socket, path: str, timeout_s: float) -> None:
    """Connect, waiting up to ``timeout_s`` for room in the sidecar's listen
    backlog: a blocking connect bounded by ``SO_SNDTIMEO``, which the kernel
    wakes as the sidecar accepts. (With a Python timeout the socket is
    non-blocking and a full backlog fails the connect at once with EAGAIN: a
    local process flooding the fd socket with connects kept it full, and every
    fetch, so every registration, failed.)

    The kernel ends that wait with EAGAIN (the backlog stayed full: said as
    such) or, when a signal arrives, EINTR, which Python takes for a connect
    under way and reports as success on a socket left unconnected: the wait
    goes on for what is left of ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        set_timeouts(sock, max(0.0, deadline - time.monotonic()))
        try:
            sock.connect(path)
        except BlockingIOError:  # EAGAIN: no room within the wait
            break
        try:
            sock.getpeername()
            return
        except OSError as e:
            if e.errno != errno.ENOTCONN:
                raise
        # a signal cut the wait short (EINTR): wait again, within the deadline
        if time.monotonic() >= deadline:
            break
    raise FdPassError(f"cannot fetch file descriptors from {path}: its listen backlog "
                      f"stayed full for {timeout_s:g} s (the sidecar is not accepting, or "
                      "a flood of connects fills it)")


def fetch_fds(path: str, token: str, expect: int, timeout_s: float = 10.0) -> list[int]:
    """Fetch the ``expect`` fds ``token`` names from the fd socket at ``path``.

    All or none: on any error every fd received so far is closed. The caller
    owns the returned fds.
    """
    deadline = time.monotonic() + timeout_s
    got: list[int] = []
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        try:
            _connect(sock, path, timeout_s)
            sock.settimeout(timeout_s)
            # Refused before the request arrived: the reason still waits to be read.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(encode_request(token))
            while len(got) < expect:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                data, fds, flags, _ = _recv(sock)
                got.extend(fds)
                if not data:
                    raise FdPassError(f"the sidecar closed the fd socket after {len(got)} of "
                                      f"{expect} file descriptors")
                if flags & socket.MSG_CTRUNC:
                    raise FdPassError("file descriptors were cut off (MSG_CTRUNC): the "
                                      "process's fd limit (ulimit -n) is too low")
                first, total = parse_reply(data)
                if total != expect or first != len(got) - len(fds):
                    raise FdPassError(f"the sidecar sent fds {first}.. of {total}; expected "
                                      f"{expect}, had {len(got) - len(fds)}")
        except FdPassError:
            raise
        except OSError as e:
            raise FdPassError(f"cannot fetch file descriptors from {path}: {e}") from e
    except BaseException:
        for fd in got:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise
    finally:
        sock.close()
    return got
