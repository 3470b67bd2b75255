"""A cap on how many connections one listening ZMQ socket keeps.

libzmq accepts every connection it is offered and has no connection limit,
so a flood of idle TCP connections eats the daemon's file descriptors until
nothing else (engines, NIXL, shared memory) can open one. The guard watches
the socket's monitor events on its own thread and shuts down (``shutdown``,
never ``close``: the fd stays libzmq's) every connection accepted beyond
``limit``; libzmq then sees the connection end and frees its fd. Connections
that were there first, such as registered engines and known peers, stay.

With ``per_source`` it also caps the connections from one remote address
(TCP): a flood from one host cannot take every slot from the fleet's other
members.

A failed handshake is logged with the remote address. libzmq's monitor event
for it carries an errno, not the connection (and, for a listener, only the
local endpoint), but libzmq emits the connection's ``DISCONNECTED`` (with its
fd) right after it, from the same I/O thread: the guard notes each TCP
connection's remote address when it is accepted and names it when that
``DISCONNECTED`` comes.

Accounting follows ``ACCEPTED``/``DISCONNECTED`` events, which libzmq emits
before it closes an fd, so a reused fd number always comes after its old
connection's end. The receiving pipe is unbounded (``RCVHWM`` 0), so no event
is dropped under a flood; a periodic sweep still forgets fds that are no
longer this listener's connections, in case one ever was.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import resource
import socket
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvsidecar.metrics.log_rate import worth_logging

__all__ = ["ConnectionGuard", "fd_budget", "raise_fd_limit"]

log = logging.getLogger(__name__)

_ids = itertools.count()
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_FAILURE_KINDS: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no_detail",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",  # e.g. no CURVE on a CURVE port
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",  # a key ZAP refused
}
_SWEEP_S = 5.0
#: fds kept free for everything that is not a connection (NIXL/UCX, shared
#: memory, ZMQ's own signalling, the metrics server, logs).
FD_RESERVE = 256


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force.

    systemd starts services with 1024 soft / 524288 hard: the soft limit is
    for select()-based programs, and libzmq uses epoll.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def fd_budget(wanted: int, share: float) -> int:
    """``wanted`` connections, or ``share`` of the fds left after the reserve if
    that is less (at least 8, so a tiny limit still serves a few engines)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(8, min(wanted, int((soft - FD_RESERVE) * share)))


class ConnectionGuard:
    """Caps the connections ``sock`` (a bound ZMQ socket) keeps at ``limit``.

    ``local`` is what the connections' local end looks like (the ipc:// path
    or the TCP port), checked before anything is shut so a number that is no
    longer one of this listener's connections is never touched.
    ``refused`` counts connections shut; ``on_refuse`` (if given) is called
    from the guard's thread for each, for metrics. ``handshake_failures``
    counts connections whose ZMTP handshake failed (wrong security mechanism,
    refused key, garbage instead of a greeting); ``on_handshake_failure``
    gets each.
    """

    def __init__(self, sock: zmq.Socket[Any], name: str, limit: int, *,
                 local: str | int, on_refuse: Callable[[], None] | None = None,
                 on_handshake_failure: Callable[[str], None] | None = None,
                 per_source: int | None = None,
                 on_source_refuse: Callable[[], None] | None = None) -> None:
        if limit < 1 or (per_source is not None and per_source < 1):
            raise ValueError(f"limit and per_source must be >= 1, got {limit}, {per_source}")
        self.name = name
        self.limit = limit
        self.per_source = per_source
        #: remote host of each open connection (per_source only) and counts per host
        self._source_of: dict[int, str] = {}
        self._by_source: dict[str, int] = {}
        self._on_source_refuse = on_source_refuse
        self.refused_source = 0
        self.local = local
        self.refused = 0
        self.handshake_failures = 0
        self._on_refuse = on_refuse
        self._on_handshake_failure = on_handshake_failure
        #: remote ``host:port`` of each accepted TCP connection, until it ends
        self._peer_of: dict[int, str] = {}
        #: a handshake failure whose log line waits for the connection's end (its fd)
        self._failed: str | None = None
        self._open: set[int] = set()
        self._lock = threading.Lock()
        self._sock: zmq.Socket[Any] = sock
        addr = f"inproc://kvsidecar-guard-{name}-{os.getpid()}-{next(_ids)}"
        # MONITOR_STOPPED wakes the thread when stop() disables the monitor, so it
        # can sleep in poll() until the next sweep instead of ticking to see _stop.
        sock.monitor(addr, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
                     | zmq.EVENT_MONITOR_STOPPED)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(sock.context.underlying)
        mon: zmq.Socket[bytes] = ctx.socket(zmq.PAIR)
        mon.setsockopt(zmq.RCVHWM, 0)  # with the sender's HWM: an unbounded pipe
        mon.connect(addr)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(mon,), daemon=True,
                                        name=f"kvs-guard-{name}")
        self._thread.start()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._open)

    def stop(self) -> None:
        """Stop watching (call before closing the socket, from the socket's thread)."""
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self, mon: zmq.Socket[bytes]) -> None:
        last_sweep = time.monotonic()
        try:
            while not self._stop.is_set():
                if mon.poll(int(_SWEEP_S * 1000)):
                    try:
                        ev = recv_monitor_message(mon)
                    except zmq.ZMQError:
                        return
                    if int(ev["event"]) == zmq.EVENT_MONITOR_STOPPED:
                        return
                    self._event(int(ev["event"]), int(ev["value"]))
                if time.monotonic() - last_sweep > _SWEEP_S:
                    last_sweep = time.monotonic()
                    self._sweep()
        finally:
            self._log_failure(None)
            mon.close(linger=0)

    def _event(self, event: int, fd: int) -> None:
        """One monitor event; ``fd`` is the event's value (an errno for a failed
        handshake)."""
        if self._failed is not None:
            self._log_failure(fd if event == zmq.EVENT_DISCONNECTED else None)
        if event & _HANDSHAKE_FAILED:
            self.handshake_failures += 1
            kind = _FAILURE_KINDS.get(event, "other")
            if self._on_handshake_failure is not None:
                self._on_handshake_failure(kind)
            if worth_logging(self.handshake_failures):
                self._failed = kind  # logged at the connection's DISCONNECTED, next
            return
        if event == zmq.EVENT_DISCONNECTED:
            with self._lock:
                self._open.discard(fd)
                self._forget_source(fd)
                self._peer_of.pop(fd, None)
            return
        if event != zmq.EVENT_ACCEPTED:
            return
        peer = self._peer(fd) if isinstance(self.local, int) else None
        source = peer.rsplit(":", 1)[0].strip("[]") if peer and self.per_source else None
        with self._lock:
            if peer is not None:
                self._peer_of[fd] = peer
            over_source = (source is not None and self.per_source is not None
                           and self._by_source.get(source, 0) >= self.per_source)
            if len(self._open) < self.limit and not over_source:
                self._open.add(fd)
                if source is not None:
                    self._source_of[fd] = source
                    self._by_source[source] = self._by_source.get(source, 0) + 1
                return
        if over_source:
            if self._shut(fd):
                self.refused_source += 1
                if self._on_source_refuse is not None:
                    self._on_source_refuse()
                if worth_logging(self.refused_source):
                    log.warning("%s socket: refused a connection from %s, %d open from one "
                                "address is the limit (%d refused so far)", self.name, source,
                                self.per_source, self.refused_source)
            return
        if self._shut(fd):
            self.refused += 1
            if self._on_refuse is not None:
                self._on_refuse()
            if worth_logging(self.refused):
                log.warning("%s socket: refused a connection, %d open is the limit "
                            "(%d refused so far)", self.name, self.limit, self.refused)

    def _log_failure(self, fd: int | None) -> None:
        """Log the pending handshake failure, naming the connection on ``fd``."""
        kind, self._failed = self._failed, None
        if kind is None:
            return
        with self._lock:
            peer = self._peer_of.get(fd) if fd is not None else None
        log.warning("%s socket: a connection from %s failed its handshake (%s; %d so far)",
                    self.name, peer or "an unknown address", kind, self.handshake_failures)

    def _forget_source(self, fd: int) -> None:
        """(Lock held.) ``fd``'s connection is gone: its source has one less."""
        source = self._source_of.pop(fd, None)
        if source is not None:
            left = self._by_source.get(source, 1) - 1
            if left > 0:
                self._by_source[source] = left
            else:
                self._by_source.pop(source, None)

    def _peer(self, fd: int) -> str | None:
        """The remote ``host:port`` of the TCP connection on ``fd`` (None: not one
        of ours, or not TCP)."""
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                return None
            s = socket.socket(fileno=fd)
        except OSError:
            return None
        try:
            if not self._mine(s):
                return None
            peer = s.getpeername()
            if not isinstance(peer, tuple):
                return None
            host = str(peer[0])
            return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
        except OSError:
            return None
        finally:
            s.detach()  # the fd is libzmq's

    def _mine(self, s: socket.socket) -> bool:
        try:
            here = s.getsockname()
        except OSError:
            return False
        if isinstance(self.local, int):
            return isinstance(here, tuple) and len(here) >= 2 and here[1] == self.local
        return bool(here == self.local)

    def _shut(self, fd: int) -> bool:
        """Shut ``fd`` down if it is still a socket with this listener's local end."""
        return self._on_mine(fd, _shut_down)

    def _is_mine(self, fd: int) -> bool:
        """Whether ``fd`` is still a socket with this listener's local end."""
        return self._on_mine(fd)

    def _on_mine(self, fd: int, act: Callable[[socket.socket], None] | None = None) -> bool:
        """Whether ``fd`` is still a socket with this listener's local end, after
        ``act`` on it if so (the fd is libzmq's: never closed here)."""
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                return False
            s = socket.socket(fileno=fd)
        except OSError:
            return False
        try:
            if not self._mine(s):
                return False
            if act is not None:
                act(s)
            return True
        finally:
            s.detach()

    def _sweep(self) -> None:
        with self._lock:
            fds = self._open | self._peer_of.keys()
        gone = [fd for fd in fds if not self._is_mine(fd)]
        if gone:
            with self._lock:
                self._open.difference_update(gone)
                for fd in gone:
                    self._forget_source(fd)
                    self._peer_of.pop(fd, None)


def _shut_down(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
