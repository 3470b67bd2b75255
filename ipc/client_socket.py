"""The engine clients' connection to the daemon: connect, time out, survive a fork.

The channel is an ``AF_UNIX`` ``SOCK_SEQPACKET`` connection (framing in
:mod:`kvsidecar.ipc.seqpacket`). :func:`connect` opens one, non-blocking, or
raises: one of :data:`NOT_YET` while no daemon listens (a client waits for
one, pausing per :data:`CONNECT_PAUSE_S`, up to its call's timeout), a
:class:`~.errors.SidecarError` for what waiting cannot fix. :func:`forks`
counts the forks this process descends through: a connection opened before
a fork is the parent's, and a child's client opens its own.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from typing import Final

from .errors import Forbidden, Unavailable
from .protocol import FORBIDDEN, UNAVAILABLE
from .seqpacket import new_socket

__all__ = ["CONNECT_PAUSE_S", "NOT_YET", "connect", "forks", "set_timeouts"]

#: Retries while no daemon listens yet: from this pause, doubling up to the next.
CONNECT_PAUSE_S: Final = (0.002, 0.05)
#: Connection errors that mean "no daemon (yet)": wait for one within the timeout.
NOT_YET: Final = (FileNotFoundError, ConnectionRefusedError, BlockingIOError, InterruptedError)
_timeval = struct.Struct("@ll")
#: Forks this process descends through; a counter, so a call checks it without
#: a getpid().
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


def forks() -> int:
    """How many forks this process descends through (0 in the first process)."""
    return _forks


def connect(path: str) -> socket.socket:
    """A connected non-blocking socket to the daemon at ``path``, or raises: one
    of :data:`NOT_YET` while no daemon listens, :class:`Forbidden` or
    :class:`Unavailable` for what waiting cannot fix."""
    sock = new_socket()
    sock.setblocking(False)
    try:
        sock.connect(path)
    except NOT_YET:
        sock.close()
        raise
    except PermissionError as e:
        sock.close()
        raise Forbidden(FORBIDDEN, f"cannot connect to {path}: {e} (the socket's "
                                   "mode lets in the sidecar's own uid and those its "
                                   "--allow-uid/--allow-gid name)") from None
    except OSError as e:
        sock.close()
        hint = (" (a stream socket, not the sidecar's SOCK_SEQPACKET one: an older, "
                "ZMQ-based sidecar, or another program?)"
                if e.errno == errno.EPROTOTYPE else "")
        raise Unavailable(UNAVAILABLE, f"cannot connect to {path}: {e}{hint}") from None
    return sock


def set_timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Bound a blocking socket's sends and receives (``SO_SNDTIMEO``/``SO_RCVTIMEO``)
    to ``timeout_s``; a zero timeval means "block forever", so the shortest is 1 µs."""
    usec = max(1, int(timeout_s * 1e6))
    tv = _timeval.pack(usec // 1_000_000, usec % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
