"""The sidecar's door for local engines: a ZMQ ROUTER on an IPC socket.

::

    engine A (DEALER) ─┐                       ┌─▶ handler.handle(req) -> Reply
    engine B (DEALER) ─┼─▶ ROUTER ipc://path ──┤   (a task per request)
    engine C (DEALER) ─┘   [identity, msg]     └─◀ Error(...) for bad input

The server owns decoding, error replies and the socket; the handler owns what
requests mean. Each request is answered by its own task, started in arrival
order: handlers that never await (reads, holds, polls) therefore run in
arrival order, and one that awaits (registering gigabytes of memory,
deregistering while reads drain) delays only its own caller.

No input can stop the loop: undecodable messages, wrong frame counts,
unknown ops, wrong types, refused requests and handler bugs all become
:class:`~kvsidecar.ipc.protocol.Error` replies to the sender.

Who may send is decided before anything is decoded: each message carries the
sender's kernel credentials and a sender outside the :class:`AccessPolicy`
gets one ``forbidden`` reply (see :mod:`~kvsidecar.daemon.engine_access` for
the socket's directory, mode and lock). Messages over ``max_message_bytes``
get one ``bad_message`` reply and are counted; those over twice that never
reach Python: libzmq drops the connection (``ZMQ_MAXMSGSIZE``; see
:mod:`~kvsidecar.daemon.message_limit` for why the two levels), and
connections beyond ``max_connections`` are shut as they arrive
(:class:`~kvsidecar.daemon.conn_guard.ConnectionGuard`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq

from kvsidecar.daemon.logs import worth_logging
from kvsidecar.ipc.loop_socket import LoopSocket

from ..ipc.protocol import (
    BAD_MESSAGE,
    FORBIDDEN,
    INTERNAL,
    REPLY_TYPES,
    Error,
    ProtocolError,
    Reply,
    Request,
    RequestError,
    decode_request,
    encode_reply,
)
from .conn_guard import ConnectionGuard
from .engine_access import (
    AccessPolicy,
    PeerCred,
    claim_socket,
    current_peer,
    parse_peer_address,
    prepare_socket_dir,
    restricted_umask,
)
from .message_limit import SizeLimit

__all__ = ["EngineServer", "RequestError", "RequestHandler"]

log = logging.getLogger(__name__)

_UNIX_PATH_MAX = 107  # sun_path is 108 bytes on Linux, including the NUL
#: Error messages are cut here: they may quote ids and other input, and a
#: reply must never grow with what a client sent.
MAX_ERROR_CHARS = 1024
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
DEFAULT_MAX_CONNECTIONS = 256


class RequestHandler(Protocol):
    """What the engine server calls for each decoded request.

    Return a reply (its ``id`` is filled in by the server); raise
    :class:`RequestError` to refuse. Any other exception is reported to the
    engine as an ``internal`` error and logged.
    """

    async def handle(self, req: Request) -> Reply: ...


class EngineServer:
    """Serves one sidecar's engines on ``ipc://socket_path``.

    Counters (plain ints until the metrics registry exists): ``messages``
    received, ``errors`` (error replies of any kind), ``bad_messages``
    (undecodable input), ``internal_errors`` (handler bugs) and ``forbidden``
    (messages from senders the access policy refuses).
    """

    def __init__(self, socket_path: str, handler: RequestHandler, *,
                 access: AccessPolicy | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 on_refuse: Callable[[str], None] | None = None) -> None:
        self.socket_path = os.path.abspath(socket_path)
        self.handler = handler
        self.access = access if access is not None else AccessPolicy.own_uid()
        self.max_message_bytes = max_message_bytes
        self.size_limit = SizeLimit("engine", max_message_bytes, on_refuse)
        self.max_connections = max_connections
        self.messages = 0
        self.errors = 0
        self.bad_messages = 0
        self.internal_errors = 0
        self.forbidden = 0
        self._on_refuse = on_refuse
        self.guard: ConnectionGuard | None = None
        self._lock_fd: int | None = None
        self._inode: tuple[int, int] | None = None
        self._sock: LoopSocket | None = None
        self._task: asyncio.Task[None] | None = None
        self._answering: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.socket_path}"

    async def start(self) -> None:
        if self._sock is not None:
            raise RuntimeError("engine server already started")
        if len(os.fsencode(self.socket_path)) > _UNIX_PATH_MAX:
            raise ValueError(
                f"socket path is longer than {_UNIX_PATH_MAX} bytes (a unix socket limit): "
                f"{self.socket_path}"
            )
        prepare_socket_dir(os.path.dirname(self.socket_path), shared=self.access.shared,
                           group=self.access.group)
        self._lock_fd = claim_socket(self.socket_path)  # SocketInUse: nothing was touched
        sock = LoopSocket.of(zmq.Context.instance(), zmq.ROUTER)
        sock.sock.setsockopt(zmq.LINGER, 0)
        sock.sock.setsockopt(zmq.MAXMSGSIZE, self.size_limit.zmq_cap)
        try:
            with restricted_umask():
                sock.sock.bind(self.endpoint)
            os.chmod(self.socket_path, 0o660 if self.access.shared else 0o600)
            if self.access.group is not None:
                os.chown(self.socket_path, -1, self.access.group)
            st = os.stat(self.socket_path)
            self._inode = (st.st_dev, st.st_ino)
            refuse = self._on_refuse
            self.guard = ConnectionGuard(
                sock.sock, "engine", self.max_connections, local=self.socket_path,
                on_refuse=(lambda: refuse("connection_limit")) if refuse is not None else None)
        except BaseException:
            sock.close(linger=0)
            self._release_lock()
            raise
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._serve(sock))
        self._task.add_done_callback(_log_death)
        log.info("engine server listening on %s", self.endpoint)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._answering:
            _, pending = await asyncio.wait(list(self._answering), timeout=5)
            for t in pending:
                t.cancel()
        guard, self.guard = self.guard, None
        if guard is not None:
            guard.stop()
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close(linger=0)
            self._unlink_own_socket()
        self._release_lock()

    def _unlink_own_socket(self) -> None:
        """Remove the socket file only if it is still the one this server bound."""
        try:
            st = os.stat(self.socket_path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._inode:
            os.unlink(self.socket_path)

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    async def _serve(self, sock: LoopSocket) -> None:
        while True:
            msg = await sock.recv_multipart(copy=False)
            self.messages += 1
            cred = parse_peer_address(str(msg[-1].get("Peer-Address")))
            frames = [f.bytes for f in msg]
            if not self.access.allows(cred):
                # A ROUTER send never blocks (it drops when the peer is gone or full).
                with contextlib.suppress(zmq.ZMQError):
                    await sock.send_multipart([frames[0], self._refusal(cred)])
                continue
            task = asyncio.ensure_future(self._answer(sock, frames, cred))
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)

    def _refusal(self, cred: PeerCred | None) -> bytes:
        """One ``forbidden`` reply, nothing decoded, nothing about the engines said."""
        self.forbidden += 1
        self.errors += 1
        if self._on_refuse is not None:
            self._on_refuse("forbidden")
        who = (f"uid {cred.uid} gid {cred.gid} pid {cred.pid}" if cred is not None
               else "a peer without credentials")
        if worth_logging(self.forbidden):
            log.warning("engine socket: refused %s (allowed: %s; %d refused so far)", who,
                        self.access.describe(), self.forbidden)
        return encode_reply(Error(FORBIDDEN, f"{who} may not use this sidecar (its operator "
                                             "can allow a uid or gid: --allow-uid, --allow-gid)"))

    async def _answer(self, sock: LoopSocket, frames: list[bytes],
                      cred: PeerCred | None = None) -> None:
        current_peer.set(cred)  # this task's own context: the handler sees its sender
        reply = await self._reply_to(frames)
        if isinstance(reply, Error):
            self.errors += 1
            if len(reply.message) > MAX_ERROR_CHARS:
                cut = len(reply.message) - MAX_ERROR_CHARS
                reply.message = f"{reply.message[:MAX_ERROR_CHARS]}... ({cut} characters cut)"
        # A ROUTER drops replies to engines that went away; it never blocks.
        with contextlib.suppress(zmq.ZMQError):
            await sock.send_multipart([frames[0], self._encode(reply)])

    def _encode(self, reply: Reply) -> bytes:
        try:
            return encode_reply(reply)
        except Exception as e:  # a handler's reply holding what msgpack cannot carry
            log.exception("cannot encode %s reply", type(reply).__name__)
            self.internal_errors += 1
            self.errors += 1
            return encode_reply(Error(INTERNAL, f"unencodable reply: {e}", id=reply.id))

    async def _reply_to(self, frames: list[bytes]) -> Reply:
        too_large = self.size_limit.check(frames[1:])
        if too_large is not None:
            self.bad_messages += 1
            return Error(BAD_MESSAGE, f"{too_large} (--max-message-bytes)", id=_salvage_id(frames))
        if len(frames) != 2:
            self.bad_messages += 1
            return Error(
                BAD_MESSAGE,
                f"expected one frame per message (a DEALER socket), got {len(frames) - 1}",
            )
        try:
            req = decode_request(frames[1])
        except ProtocolError as e:
            self.bad_messages += 1
            return Error(e.code, e.message, id=e.id)
        try:
            reply = await self.handler.handle(req)
        except RequestError as e:
            reply = Error(e.code, e.message)
        except Exception as e:
            log.exception("handler failed on %s (engine request id %d)", type(req).__name__,
                          req.id)
            self.internal_errors += 1
            reply = Error(INTERNAL, f"{type(e).__name__}: {e}")
        if not isinstance(reply, REPLY_TYPES):
            log.error("handler returned %r for %s, not a reply", reply, type(req).__name__)
            self.internal_errors += 1
            reply = Error(INTERNAL, f"handler returned {type(reply).__name__}, not a reply")
        reply.id = req.id
        return reply


class _Id(msgspec.Struct):
    id: int = -1


_id_decoder = msgspec.msgpack.Decoder(_Id)


def _salvage_id(frames: list[bytes]) -> int:
    """The request id of a message refused unread, if it has one (msgspec skips
    the rest without building it), so the engine can match the error."""
    try:
        return _id_decoder.decode(frames[-1]).id if len(frames) == 2 else -1
    except Exception:  # any bytes at all: no id
        return -1


def _log_death(task: asyncio.Task[None]) -> None:
    """The serve loop only ends by cancellation; anything else must be loud."""
    if not task.cancelled() and task.exception() is not None:
        log.critical("engine server stopped serving", exc_info=task.exception())
