"""The asyncio engine client: the same calls as the blocking one, several at once.

:class:`AsyncSidecarClient` runs the calls of :mod:`.client_core` over one
``SOCK_SEQPACKET`` connection (:mod:`.client_socket`) read by a loop reader
callback, which hands each reply to the call with the same id; a reply to a
call that already timed out is dropped. No daemon yet is waited for, up to
the call's timeout; a connection the daemon closed is replaced by a new one.
Users import it from :mod:`kvsidecar.ipc.client`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TypeVar

from . import client_socket
from .block_ids import BlockIdsLike
from .client_core import (
    MAPS_MEMORY,
    Call,
    ClientCore,
    Done,
    HoldSpec,
    ReadSpec,
    Registration,
    advance,
    can_verify,
    step,
)
from .errors import SidecarError, Unavailable, error_from_reply, expect
from .layout import Layout
from .protocol import (
    UNAVAILABLE,
    Completion,
    DrainMode,
    Error,
    Held,
    MemoryKind,
    Pong,
    RemoteEngine,
    Reply,
    Request,
    StatusReport,
)
from .regions import Region
from .seqpacket import MAX_PACKET, Buffer, packets, peer_closed

__all__ = ["AsyncSidecarClient"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncSidecarClient:
    """asyncio client; any number of calls may be outstanding at once.

    Its connection is read by a loop reader callback that hands each reply to
    the call with the same id; replies to calls that already timed out are
    dropped. Use it from one event loop.
    """

    def __init__(self, socket_path: str, timeout_s: float = 10.0) -> None:
        self._core = ClientCore(socket_path, timeout_s)
        self._poll_locks: dict[str, asyncio.Lock] = {}
        self._conn: _AsyncConnection | None = None

    @property
    def timeout_s(self) -> float:
        return self._core.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._core.timeout_s = value

    async def register(self, engine_id: str, tp_rank: int, layout: Layout, *,
                       regions: Sequence[Region] | None = None, allocate: bool = False,
                       keep_on_exit: bool = False, memory: MemoryKind = "memfd") -> Registration:
        return await self._run(self._core.register(engine_id, tp_rank, layout, regions,
                                                   allocate, keep_on_exit, memory))

    async def deregister(self, engine_id: str, mode: DrainMode = "drop") -> None:
        """See :meth:`SidecarClient.deregister`."""
        req, kind = self._core.deregister(engine_id, mode)
        expect(await self._exchange(req), kind)

    async def reserve(self, engine_id: str, nbytes: int,
                      memory: MemoryKind = "memfd") -> Region:
        return await self._run(self._core.reserve(engine_id, nbytes, memory))

    async def read(self, engine_id: str, request_id: str, local_block_ids: BlockIdsLike,
                   remote: RemoteEngine, remote_block_ids: BlockIdsLike, *,
                   remote_request_id: str | None = None,
                   skip_tokens: int | None = None, num_tokens: int | None = None,
                   verify: bool = False, remote_tokens: Sequence[str] = ()) -> None:
        """As :meth:`SidecarClient.read`."""
        if verify:
            can_verify((await self.ping()).minor)
        req, kind = self._core.read(engine_id, request_id, local_block_ids, remote,
                                    remote_block_ids, remote_request_id, skip_tokens, num_tokens,
                                    verify, remote_tokens)
        expect(await self._exchange(req), kind)

    async def hold(self, engine_id: str, request_id: str, block_ids: BlockIdsLike, *,
                   readers: int = 1, timeout_s: float | None = None) -> Held:
        req, kind = self._core.hold(engine_id, request_id, block_ids, readers, timeout_s)
        return expect(await self._exchange(req), kind)

    async def release(self, engine_id: str, request_id: str) -> None:
        req, kind = self._core.release(engine_id, request_id)
        expect(await self._exchange(req), kind)

    async def read_many(self, engine_id: str, specs: Sequence[ReadSpec]
                        ) -> list[SidecarError | None]:
        """As :meth:`SidecarClient.read_many`."""
        if any(s.verify for s in specs):
            can_verify((await self.ping()).minor)
        return await self._run(self._core.read_many(engine_id, specs))

    async def hold_many(self, engine_id: str, specs: Sequence[HoldSpec]
                        ) -> list[Held | SidecarError]:
        """As :meth:`SidecarClient.hold_many`."""
        return await self._run(self._core.hold_many(engine_id, specs))

    async def release_many(self, engine_id: str, request_ids: Sequence[str]
                           ) -> list[SidecarError | None]:
        """As :meth:`SidecarClient.release_many`."""
        return await self._run(self._core.release_many(engine_id, request_ids))

    async def poll(self, engine_id: str, wait_s: float = 0.0) -> list[Completion]:
        """As :meth:`SidecarClient.poll`. Polls of one engine are serialised: two
        in flight would acknowledge the same number and receive items twice."""
        async with self._poll_locks.setdefault(engine_id, asyncio.Lock()):
            core = self._core
            req, kind = core.poll(engine_id, wait_s)
            return core.polled(engine_id, expect(await self._exchange(req), kind))

    async def ping(self, engines: Sequence[str] = ()) -> Pong:
        """As :meth:`SidecarClient.ping`."""
        req, kind = self._core.ping(engines)
        return expect(await self._exchange(req), kind)

    async def status(self) -> StatusReport:
        """The sidecar's state for operators (``kvsidecar status``; protocol minor 6)."""
        req, kind = self._core.status()
        return expect(await self._exchange(req), kind)

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            conn.fail_pending(lambda: Unavailable(UNAVAILABLE, "client closed"))

    async def __aenter__(self) -> AsyncSidecarClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def _run(self, call: Call[T]) -> T:
        outcome: Reply | SidecarError | None = None
        while True:
            try:
                if type(outcome) in MAPS_MEMORY:
                    # The next step maps the regions, fetching their fds from the
                    # sidecar's fd socket: off this loop (it may be the sidecar's own).
                    stepped = await asyncio.get_running_loop().run_in_executor(
                        None, step, call, outcome)
                    if isinstance(stepped, Done):
                        return stepped.value  # type: ignore[no-any-return]
                    req = stepped
                else:
                    req = advance(call, outcome)
            except StopIteration as stop:
                result: T = stop.value
                return result
            try:
                outcome = await self._exchange(req)
            except SidecarError as e:
                outcome = e
            except BaseException:
                call.close()
                raise

    async def _exchange(self, req: Request) -> Reply:
        loop = asyncio.get_running_loop()
        core = self._core
        data = core.encode(req)
        timeout_s = core.timeout_for(req)
        fut: asyncio.Future[Reply] = loop.create_future()
        timer = loop.call_later(timeout_s, _expire, fut, core, req, timeout_s)
        conn: _AsyncConnection | None = None
        resends = 0
        try:
            while not fut.done():
                if resends:  # a daemon that keeps closing on us is not hammered
                    pause, most = client_socket.CONNECT_PAUSE_S
                    await asyncio.sleep(min(most, pause * resends))
                resends += 1
                conn = await self._connection(loop, fut)
                if conn is None:
                    break  # timed out waiting for a daemon
                conn.pending[req.id] = fut
                if conn.send(data):
                    break
                # The daemon had closed this connection: the request never reached
                # it. Whatever it said first is delivered; else it goes again.
                self._lost(conn, keep=req.id)
                conn.pending.pop(req.id, None)
            return await fut
        finally:
            timer.cancel()
            if conn is not None:
                conn.pending.pop(req.id, None)

    async def _connection(self, loop: asyncio.AbstractEventLoop,
                          fut: asyncio.Future[Reply]) -> _AsyncConnection | None:
        """The open connection, or a new one once a daemon listens (None if ``fut``
        timed out meanwhile)."""
        conn = self._conn
        if conn is not None and conn.loop is loop:
            return conn
        if conn is not None:  # made on another loop (a test's): start afresh
            self._lost(conn)
        pause, most = client_socket.CONNECT_PAUSE_S
        while self._conn is None:
            try:
                sock = client_socket.connect(self._core.path)
            except client_socket.NOT_YET:
                await asyncio.sleep(pause)
                if fut.done():
                    return None
                pause = min(2 * pause, most)
                continue
            if self._conn is None:
                self._core.reset_framing()
                self._conn = _AsyncConnection(self, sock, loop)
            else:
                sock.close()  # another call connected meanwhile
        return self._conn

    def _readable(self, conn: _AsyncConnection) -> None:
        core = self._core
        while True:
            try:
                n = conn.sock.recv_into(core.buf, 0, socket.MSG_TRUNC)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # ECONNRESET: the daemon closed with data of ours unread
                self._lost(conn)
                return
            if n == 0 and peer_closed(conn.sock):
                self._lost(conn)
                return
            got = core.received(n)
            if got is not None:
                conn.resolve(*got)

    def _lost(self, conn: _AsyncConnection, keep: int | None = None) -> None:
        """The daemon closed ``conn``: deliver what it queued first (a refusal),
        then fail the calls it did not answer (but ``keep``, which is sent again)."""
        if self._conn is conn:
            self._conn = None
        core = self._core
        for _ in range(4):
            try:
                n = conn.sock.recv_into(core.buf, 0, socket.MSG_DONTWAIT | socket.MSG_TRUNC)
            except ConnectionResetError:
                continue
            except OSError:
                break
            if n == 0:
                break
            got = core.received(n)
            if got is not None:
                conn.resolve(*got)
        conn.close()
        refusal = conn.refusal
        conn.fail_pending(
            (lambda: error_from_reply(refusal)) if refusal is not None
            else (lambda: core.closed_error("this call")), keep=keep)


def _expire(fut: asyncio.Future[Reply], core: ClientCore, req: Request,
            timeout_s: float) -> None:
    if not fut.done():
        fut.set_exception(core.timeout_error(req, timeout_s))


class _AsyncConnection:
    """The async client's connection: its calls waiting for replies (by id) and
    the packets the kernel could not take at once."""

    def __init__(self, client: AsyncSidecarClient, sock: socket.socket,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.loop = loop
        self.pending: dict[int, asyncio.Future[Reply]] = {}
        #: an error the daemon sent without an id (it refused this connection)
        self.refusal: Error | None = None
        self._client = client
        self._unsent: collections.deque[Buffer] = collections.deque()
        self._closed = False
        loop.add_reader(self.fd, client._readable, self)

    def send(self, data: bytes) -> bool:
        """Send (or queue) ``data``; False when the daemon closed the connection."""
        if self._closed:
            return False
        if self._unsent:
            self._unsent.extend(packets(data))
            return True
        queue: collections.deque[Buffer] = collections.deque(
            [data] if len(data) <= MAX_PACKET else packets(data))
        try:
            while queue:
                self.sock.send(queue[0], socket.MSG_NOSIGNAL)
                queue.popleft()
        except (BlockingIOError, InterruptedError):
            self._unsent = queue
            self.loop.add_writer(self.fd, self._flush)
        except OSError:
            return False
        return True

    def _flush(self) -> None:
        try:
            while self._unsent:
                self.sock.send(self._unsent[0], socket.MSG_NOSIGNAL)
                self._unsent.popleft()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._client._lost(self)
            return
        self.loop.remove_writer(self.fd)

    def resolve(self, id: int, outcome: Reply | SidecarError) -> None:
        if id == -1:
            if isinstance(outcome, Error):
                self.refusal = outcome
            if len(self.pending) == 1:
                # The daemon could not read our id; with one call waiting it is that one's.
                id = next(iter(self.pending))
        fut = self.pending.get(id)
        if fut is None or fut.done():
            log.debug("dropping a reply with no waiting call (id %d)", id)
            return
        if isinstance(outcome, SidecarError):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)

    def fail_pending(self, error: Callable[[], SidecarError], keep: int | None = None) -> None:
        for id, fut in self.pending.items():
            if id != keep and not fut.done():
                fut.set_exception(error())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(RuntimeError):  # its loop is closed: nothing to remove
            self.loop.remove_reader(self.fd)
            if self._unsent:
                self.loop.remove_writer(self.fd)
        self._unsent.clear()
        self.sock.close()
