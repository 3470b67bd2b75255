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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Protocol

import zmq
import zmq.asyncio

from ..ipc.protocol import (
    BAD_MESSAGE,
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

__all__ = ["EngineServer", "RequestError", "RequestHandler"]

log = logging.getLogger(__name__)

_UNIX_PATH_MAX = 107  # sun_path is 108 bytes on Linux, including the NUL


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
    (undecodable input) and ``internal_errors`` (handler bugs).
    """

    def __init__(self, socket_path: str, handler: RequestHandler) -> None:
        self.socket_path = os.path.abspath(socket_path)
        self.handler = handler
        self.messages = 0
        self.errors = 0
        self.bad_messages = 0
        self.internal_errors = 0
        self._sock: zmq.asyncio.Socket | None = None
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
        Path(self.socket_path).parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_socket(self.socket_path)
        sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError:
            sock.close()
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
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close(linger=0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            self.messages += 1
            task = asyncio.ensure_future(self._answer(sock, frames))
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)

    async def _answer(self, sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        reply = await self._reply_to(frames)
        if isinstance(reply, Error):
            self.errors += 1
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


def _log_death(task: asyncio.Task[None]) -> None:
    """The serve loop only ends by cancellation; anything else must be loud."""
    if not task.cancelled() and task.exception() is not None:
        log.critical("engine server stopped serving", exc_info=task.exception())


def _remove_stale_socket(path: str) -> None:
    """Remove a socket file left by a dead daemon, but never a live daemon's
    socket nor a file that is not a socket."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    finally:
        probe.close()
    raise RuntimeError(f"another process is serving {path}; is a sidecar already running?")
