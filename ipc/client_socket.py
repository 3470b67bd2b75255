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
import logging
import os
import socket
from typing import TYPE_CHECKING, Final

from .errors import Forbidden, SidecarError, Unavailable
from .protocol import FORBIDDEN, UNAVAILABLE, Reply
from .seqpacket import new_socket, peer_closed, set_timeouts

if TYPE_CHECKING:
    from .client_core import ClientCore

__all__ = ["CONNECT_PAUSE_S", "NOT_YET", "connect", "forks", "set_timeouts", "take_queued"]

log = logging.getLogger(__name__)

#: Retries while no daemon listens yet: from this pause, doubling up to the next.
CONNECT_PAUSE_S: Final = (0.002, 0.05)
#: Connection errors that mean "no daemon (yet)": wait for one within the timeout.
NOT_YET: Final = (FileNotFoundError, ConnectionRefusedError, BlockingIOError, InterruptedError)
#: At most this many packets are read by one :func:`take_queued` (a daemon's
#: queue is finite; the bound only guards against a peer that is not a daemon).
_MAX_QUEUED: Final = 65536
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


def take_queued(core: ClientCore, sock: socket.socket, req_id: int | None
                ) -> tuple[tuple[int, Reply | SidecarError] | None, bool, bool]:
    """What is queued on ``sock`` now, read without waiting (all of it, on a
    connection that failed: a SEQPACKET socket reports a reset once, before
    what is queued): answers to requests sent without waiting go to
    ``core.posted``, stale replies are dropped, and the reply to ``req_id`` (or
    an error without an id, which with one call in flight is that call's) is
    returned, with whether a reset was seen (the daemon closed it with
    messages of ours unread) and whether its end was."""
    found: tuple[int, Reply | SidecarError] | None = None
    resets, ended = 0, False
    for _ in range(_MAX_QUEUED):
        try:
            n = sock.recv_into(core.buf, 0, socket.MSG_DONTWAIT | socket.MSG_TRUNC)
        except ConnectionResetError:
            resets += 1
            if resets > 1:
                break
            continue
        except OSError:  # nothing more queued (EAGAIN), or the socket is broken
            break
        if n == 0:
            ended = peer_closed(sock)
            break
        got = core.received(n)
        if got is None or core.posted.answered(*got):
            continue
        if found is None and (got[0] == req_id or got[0] == -1):
            found = got
        else:
            log.debug("dropping a stale reply with id %d", got[0])
    return found, resets > 0, ended
