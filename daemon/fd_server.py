"""The sidecar's fd socket: hands a registration's file descriptors to its engine.

See :mod:`kvsidecar.ipc.fdpass` for why it exists and the message format.
It runs on the event loop (accepting and answering are non-blocking; a
SEQPACKET send of one header and a few hundred fds never waits on a fresh
socket), one task per connection, with a connection cap and a per-connection
deadline, so a silent client costs one slot for ``timeout_s``. At the cap, the
connection that has waited longest for its request (at least ``idle_grace_s``;
an engine sends its request right after connecting) is closed to make room
(reason ``idle_evicted``): idle connections cannot keep registrations out.

Who gets what: the connection's ``SO_PEERCRED`` must pass the engine
socket's :class:`~kvsidecar.daemon.engine_access.AccessPolicy`, and its uid
must be the uid that registered (the offer's ``uid``), like every request on
the engine socket. The fds are borrowed: their regions own them, and the
owner withdraws the offer before it closes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass

from kvsidecar.daemon.engine_access import AccessPolicy, open_to, peer_cred, restricted_umask
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
    malformed, over the cap); ``on_refuse(reason)`` is told of each.
    """

    def __init__(self, path: str, access: AccessPolicy, *, max_connections: int = 64,
                 timeout_s: float = 5.0, idle_grace_s: float = 1.0,
                 on_refuse: Callable[[str], None] | None = None) -> None:
        self.path = os.path.abspath(path)
        self.access = access
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.idle_grace_s = idle_grace_s
        self.refused = 0
        self.served = 0
        self._on_refuse = on_refuse
        self._offers: dict[str, _Offer] = {}
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        #: connections still waiting for their request: when each was accepted
        self._waiting: dict[asyncio.Task[None], float] = {}

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
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._offers.clear()

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(sock)
            if len(self._conns) >= self.max_connections and not self._evict_idlest(loop.time()):
                self._refuse(conn, "connection_limit", "too many fd connections; try again")
                conn.close()
                continue
            task = loop.create_task(self._serve(conn))
            self._conns.add(task)
            self._waiting[task] = loop.time()
            task.add_done_callback(self._conns.discard)
            task.add_done_callback(self._forget_waiting)

    def _forget_waiting(self, task: asyncio.Task[None]) -> None:
        self._waiting.pop(task, None)

    def _evict_idlest(self, now: float) -> bool:
        """Cancel the connection waiting longest for its request (at least
        ``idle_grace_s``); False when none has waited that long."""
        oldest = min(self._waiting.items(), key=lambda kv: kv[1], default=None)
        if oldest is None or now - oldest[1] < self.idle_grace_s:
            return False
        task = oldest[0]
        del self._waiting[task]
        task.cancel()
        self.refused += 1
        if self._on_refuse is not None:
            self._on_refuse("idle_evicted")
        return True

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn.setblocking(False)
            cred = peer_cred(conn)
            if not self.access.allows(cred):
                self._refuse(conn, "forbidden", "this user may not use this sidecar")
                return
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
            if offer is None or (offer.uid is not None and cred is not None
                                 and cred.uid != offer.uid):
                self._refuse(conn, "unknown_token", "unknown token (the registration is gone, "
                             "or belongs to another user)")
                return
            for first, count in batches(len(offer.fds)):
                socket.send_fds(conn, [encode_header(first, len(offer.fds))],
                                list(offer.fds[first:first + count]))
            self.served += 1
            log.debug("passed %d fds of %s to pid %s", len(offer.fds), offer.what,
                      cred.pid if cred else "?")
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
