"""The sidecar's fd socket: hands a registration's file descriptors to its engine.

See :mod:`kvsidecar.ipc.fdpass` for why it exists and the message format.
It runs on the event loop (accepting and answering are non-blocking; a
SEQPACKET send of one header and a few hundred fds never waits on a fresh
socket), one task per connection, with a connection cap and a per-connection
deadline, so a silent client costs one slot for ``timeout_s``. At the cap, the
connection that has waited longest for its request (at least ``idle_grace_s``;
an engine sends its request right after connecting) is closed to make room
(reason ``idle_evicted``): idle connections cannot keep registrations out.

Where the access policy admits uids besides the sidecar's own, one uid holds
at most its share of the slots (the engine socket's per-uid cap,
:mod:`~kvsidecar.daemon.uid_limit`: ``--max-engine-connections-per-uid``,
at most three quarters of ``max_connections``, 48 of 64): at it, its own
connection waiting longest (past ``idle_grace_s``) makes room, else the new
one is refused with a reason naming the uid (``uid_connection_limit``).
Without it, one admitted uid opening connections faster than the grace let
them be evicted (about 64 a second, sending nothing) held every slot, and
the other uids' engines were refused their fds: their registrations failed.

Who gets what: the connection's ``SO_PEERCRED`` must pass the engine
socket's :class:`~kvsidecar.daemon.engine_access.AccessPolicy` (checked as
it is accepted, before any limit, so a refused peer evicts nobody), and its
uid must be the uid that registered (the offer's ``uid``), like every
request on the engine socket. The fds are borrowed: their regions own them,
and the owner withdraws the offer before it closes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass

from kvsidecar.daemon.engine_access import (
    ACCEPT_PAUSE_S,
    AccessPolicy,
    PeerCred,
    open_to,
    peer_cred,
    restricted_umask,
)
from kvsidecar.daemon.uid_limit import DEFAULT_MAX_CONNECTIONS_PER_UID, UidLimit
from kvsidecar.ipc.fdpass import (
    FdPassError,
    batches,
    encode_error,
    encode_header,
    parse_request,
)
from kvsidecar.metrics.log_rate import worth_logging

log = logging.getLogger(__name__)

__all__ = ["FdServer"]


@dataclass(frozen=True)
class _Offer:
    uid: int | None
    fds: tuple[int, ...]
    what: str


class FdServer:
    """Serves offers (token -> fds) on a SEQPACKET Unix socket at ``path``.

    ``refused`` counts connections turned away (forbidden, unknown token,
    malformed, over the cap, over the uid's cap); ``on_refuse(reason)`` is
    told of each.
    """

    def __init__(self, path: str, access: AccessPolicy, *, max_connections: int = 64,
                 max_connections_per_uid: int = DEFAULT_MAX_CONNECTIONS_PER_UID,
                 timeout_s: float = 5.0, idle_grace_s: float = 1.0,
                 on_refuse: Callable[[str], None] | None = None) -> None:
        self.path = os.path.abspath(path)
        self.access = access
        self.max_connections = max_connections
        #: one uid's share of the slots (``uid_limit.cap``; None: no cap)
        self.uid_limit = UidLimit(access, max_connections_per_uid, max_connections,
                                  what="fd socket", target="this sidecar's fd socket",
                                  advice="try again")
        self.timeout_s = timeout_s
        self.idle_grace_s = idle_grace_s
        self.refused = 0
        self.served = 0
        self._on_refuse = on_refuse
        self._offers: dict[str, _Offer] = {}
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        #: every connection's task, until it ends
        self._tasks: set[asyncio.Task[None]] = set()
        #: the connections that count against the limits, each with its peer's uid
        self._conns: dict[asyncio.Task[None], int] = {}
        #: connections still waiting for their request: when each was accepted
        self._waiting: dict[asyncio.Task[None], float] = {}
        #: accepts that failed (EMFILE, ENFILE, ENOBUFS): the socket paused, then went on
        self.accept_errors = 0

    def offer(self, fds: list[int], uid: int | None, what: str) -> str:
        """Make ``fds`` fetchable by ``uid`` under a fresh token (returned)."""
        token = secrets.token_hex(16)
        self._offers[token] = _Offer(uid, tuple(fds), what)
        return token

    def withdraw(self, token: str) -> None:
        self._offers.pop(token, None)

    @property
    def offers(self) -> int:
        return len(self._offers)

    async def start(self) -> None:
        """Bind (the caller holds the engine socket's lock, so a leftover file at
        ``path`` is a stale one of this sidecar and is replaced)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            with restricted_umask():
                sock.bind(self.path)
            os.chmod(self.path, 0o660 if self.access.shared else 0o600)
            if self.access.group is not None:
                os.chown(self.path, -1, self.access.group)
            open_to(self.path, self.access.other_uids, 0o6)
            sock.listen(64)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._accept(sock))
        log.info("fd socket listening on %s", self.path)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._offers.clear()

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            except OSError as e:  # EMFILE, ENFILE, ENOBUFS: pause, then accept again
                self.accept_errors += 1
                if worth_logging(self.accept_errors):
                    log.warning("fd socket: cannot accept a connection: %s (%d so far); "
                                "accepting again in %g s", e, self.accept_errors,
                                ACCEPT_PAUSE_S)
                await asyncio.sleep(ACCEPT_PAUSE_S)
                continue
            self._take(loop, conn)
            # sock_accept answers without yielding while connections wait in the
            # backlog: a process spinning on connect() (refused each time) would
            # otherwise keep the whole event loop in this loop
            await asyncio.sleep(0)

    def _take(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        """Serve ``conn`` or refuse it: the access policy, then the uid's share,
        then the total."""
        cred = peer_cred(conn)
        if not self.access.allows(cred):
            self._refuse(conn, "forbidden", "this user may not use this sidecar")
            conn.close()
            return
        assert cred is not None  # allows() admits no peer without credentials
        now = loop.time()
        if not self.uid_limit.room(cred.uid, self._conns.values(),
                                   functools.partial(self._evict_idlest, now)):
            self._refuse(conn, "uid_connection_limit", self.uid_limit.refusal(cred))
            conn.close()
            return
        if len(self._conns) >= self.max_connections and not self._evict_idlest(now):
            self._refuse(conn, "connection_limit", "too many fd connections; try again")
            conn.close()
            return
        task = loop.create_task(self._serve(conn, cred))
        self._tasks.add(task)
        self._conns[task] = cred.uid
        self._waiting[task] = now
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._conns.pop(task, None)
        self._waiting.pop(task, None)

    def _evict_idlest(self, now: float, uid: int | None = None) -> bool:
        """Cancel the connection waiting longest for its request (at least
        ``idle_grace_s``), of ``uid`` if given; False when none has waited that
        long. It stops counting at once (its task ends on the next turn)."""
        oldest = min(((t, at) for t, at in self._waiting.items()
                      if uid is None or self._conns.get(t) == uid),
                     key=lambda kv: kv[1], default=None)
        if oldest is None or now - oldest[1] < self.idle_grace_s:
            return False
        task = oldest[0]
        self._forget(task)
        task.cancel()
        self.refused += 1
        if self._on_refuse is not None:
            self._on_refuse("idle_evicted")
        return True

    async def _serve(self, conn: socket.socket, cred: PeerCred) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn.setblocking(False)
            try:
                data = await asyncio.wait_for(loop.sock_recv(conn, 256), self.timeout_s)
            except asyncio.TimeoutError:
                self._refuse(conn, "timeout", "no request in time")
                return
            self._waiting.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
            try:
                token = parse_request(data)
            except FdPassError as e:
                self._refuse(conn, "bad_message", str(e))
                return
            offer = self._offers.get(token)
            # An unknown token and another uid's token get the same answer: a
            # stranger learns nothing about which tokens exist.
            if offer is None or (offer.uid is not None and cred.uid != offer.uid):
                self._refuse(conn, "unknown_token", "unknown token (the registration is gone, "
                             "or belongs to another user)")
                return
            for first, count in batches(len(offer.fds)):
                socket.send_fds(conn, [encode_header(first, len(offer.fds))],
                                list(offer.fds[first:first + count]))
            self.served += 1
            log.debug("passed %d fds of %s to pid %d", len(offer.fds), offer.what, cred.pid)
        except (OSError, asyncio.CancelledError) as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            log.info("fd socket: a connection failed: %s", e)
        finally:
            conn.close()

    def _refuse(self, conn: socket.socket, reason: str, message: str) -> None:
        self.refused += 1
        if worth_logging(self.refused):
            log.warning("fd socket: refused a connection (%s; %d refused so far)", reason,
                        self.refused)
        if self._on_refuse is not None:
            self._on_refuse(reason)
        with contextlib.suppress(OSError):
            conn.send(encode_error(message))
