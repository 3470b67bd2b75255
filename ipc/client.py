"""The engine's side of the sidecar: a thin client over ZMQ IPC.

Every call is one short round trip: the daemon accepts or refuses a request
and answers at once; transfers finish later and are collected with
:meth:`SidecarClient.poll`. Nothing here waits on a transfer.

Two flavours with the same methods: :class:`SidecarClient` (blocking, one
call at a time, one per thread) and :class:`AsyncSidecarClient` (coroutines,
several calls outstanding, replies matched by id).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import operator
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeAlias, TypeVar

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from .layout import Layout
from .memory import ShmRegion, attach_refs
from .protocol import (
    BAD_MESSAGE,
    BAD_REQUEST,
    DUPLICATE,
    INCOMPATIBLE,
    INTERNAL,
    UNAVAILABLE,
    UNKNOWN_ENGINE,
    VERSION,
    Completion,
    Completions,
    Deregister,
    Error,
    Hold,
    Ok,
    Ping,
    Poll,
    Pong,
    ProtocolError,
    Read,
    Register,
    Registered,
    Release,
    RemoteEngine,
    Reply,
    Request,
    decode_reply,
    encode_request,
)

log = logging.getLogger(__name__)

BlockIdsLike: TypeAlias = (
    Sequence[Sequence[int]] | Sequence[np.ndarray[Any, Any]] | np.ndarray[Any, Any]
)
"""Per-group block ids: lists of ints, 1-D integer arrays, or one 2-D integer array."""

R = TypeVar("R", bound=Reply)


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class SidecarError(Exception):
    """The daemon refused or failed a request; ``code`` is the wire error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class BadMessage(SidecarError):
    """The daemon could not parse what this client sent (a client bug)."""


class VersionMismatch(SidecarError):
    """Client and daemon speak different protocol versions."""


class UnknownEngine(SidecarError):
    """The engine id is not registered (never, or the daemon restarted)."""


class BadRequest(SidecarError):
    """Well-formed but unacceptable (block ids out of range, wrong sizes...)."""


class Duplicate(SidecarError):
    """The engine or request id is already in use."""


class Incompatible(SidecarError):
    """The remote engine's layout describes a different model."""


class Unavailable(SidecarError):
    """The daemon cannot serve this now (peer unreachable, shutting down...)."""


class InternalError(SidecarError):
    """A bug in the daemon; the message carries the exception text."""


class SidecarTimeout(SidecarError):
    """No reply in time: the daemon is not running, stuck, or the socket path is wrong."""

    def __init__(self, message: str) -> None:
        super().__init__("timeout", message)


_ERRORS: dict[str, type[SidecarError]] = {
    BAD_MESSAGE: BadMessage,
    VERSION: VersionMismatch,
    UNKNOWN_ENGINE: UnknownEngine,
    BAD_REQUEST: BadRequest,
    DUPLICATE: Duplicate,
    INCOMPATIBLE: Incompatible,
    UNAVAILABLE: Unavailable,
    INTERNAL: InternalError,
}


def error_from_reply(err: Error) -> SidecarError:
    """The typed exception for an error reply (the base class for codes this
    client does not know, so a newer daemon's codes still surface)."""
    return _ERRORS.get(err.code, SidecarError)(err.code, err.message)


def _expect(reply: Reply, kind: type[R]) -> R:
    if isinstance(reply, Error):
        raise error_from_reply(reply)
    if not isinstance(reply, kind):
        got = type(reply).__name__
        raise BadMessage(BAD_MESSAGE, f"expected a {kind.__name__} reply, got {got}")
    return reply


# --------------------------------------------------------------------------
# Results and request building (shared by both clients)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Registration:
    """What the engine keeps after registering: where peers reach it, and the
    regions its KV cache lives in (its own in attach mode, mapped from the
    daemon's in allocate mode)."""

    engine_id: str
    handshake_address: str
    agent_name: str
    regions: list[ShmRegion]


def block_id_lists(groups: BlockIdsLike) -> list[list[int]]:
    """Plain ``list[list[int]]`` for the wire; rejects floats and flat lists."""
    if isinstance(groups, np.ndarray):
        if groups.ndim != 2:
            raise TypeError(f"block ids: expected a 2-D array (groups x ids), got {groups.ndim}-D")
        _check_int_dtype(groups)
        out: list[list[int]] = groups.tolist()
        return out
    try:
        return msgspec.convert(groups, list[list[int]])  # plain ints: one pass in C
    except msgspec.ValidationError:
        pass  # numpy arrays or scalars, ranges...: convert group by group
    result: list[list[int]] = []
    for g in groups:
        if isinstance(g, np.ndarray):
            if g.ndim != 1:
                raise TypeError(f"block ids: expected 1-D arrays per group, got {g.ndim}-D")
            _check_int_dtype(g)
            result.append(g.tolist())
        elif isinstance(g, Iterable) and not isinstance(g, (str, bytes)):
            result.append([operator.index(b) for b in g])
        else:
            raise TypeError(
                f"block ids: expected one sequence per KV-cache group, got {type(g).__name__}"
            )
    return result


def _check_int_dtype(a: np.ndarray[Any, Any]) -> None:
    if a.dtype.kind not in "iu":
        raise TypeError(f"block ids: expected an integer array, got dtype {a.dtype}")


def _register_request(id: int, engine_id: str, tp_rank: int, layout: Layout,
                      regions: Sequence[ShmRegion] | None, allocate: bool,
                      keep_on_exit: bool) -> Register:
    if allocate == (regions is not None):
        raise ValueError("register: pass either regions (attach mode) or allocate=True")
    return Register(
        engine_id, tp_rank, layout, "allocate" if allocate else "attach",
        [r.ref() for r in regions or ()], keep_on_exit, os.getpid(), id=id,
    )


def _read_request(id: int, engine_id: str, request_id: str, local_block_ids: BlockIdsLike,
                  remote: RemoteEngine, remote_block_ids: BlockIdsLike,
                  remote_request_id: str | None, skip_tokens: int | None,
                  num_tokens: int | None = None) -> Read:
    return Read(
        engine_id, request_id, block_id_lists(local_block_ids), remote,
        block_id_lists(remote_block_ids), remote_request_id, skip_tokens, num_tokens, id=id,
    )


def _hold_request(id: int, engine_id: str, request_id: str, block_ids: BlockIdsLike,
                  readers: int, timeout_s: float | None) -> Hold:
    return Hold(engine_id, request_id, block_id_lists(block_ids), readers, timeout_s, id=id)


def _registration(reply: Registered, regions: Sequence[ShmRegion] | None) -> Registration:
    """Map allocate-mode regions; the caller deregisters if this raises."""
    mapped = list(regions) if regions is not None else attach_refs(reply.regions)
    return Registration(reply.engine_id, reply.handshake_address, reply.agent_name, mapped)


def _endpoint(socket_path: str) -> str:
    return socket_path if "://" in socket_path else f"ipc://{socket_path}"


# --------------------------------------------------------------------------
# Blocking client
# --------------------------------------------------------------------------


class SidecarClient:
    """Blocking client; one call in flight at a time, not thread-safe (ZMQ sockets
    are not): use one per thread.

    After a timeout the socket is replaced, so a reply that arrives late cannot
    be taken for the next call's.
    """

    def __init__(self, socket_path: str, timeout_s: float = 10.0) -> None:
        self._endpoint = _endpoint(socket_path)
        self._timeout_s = timeout_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._ids = itertools.count(1)
        self._acks: dict[str, tuple[str, int]] = {}
        self._sock: zmq.Socket[bytes] | None = None

    def register(self, engine_id: str, tp_rank: int, layout: Layout, *,
                 regions: Sequence[ShmRegion] | None = None, allocate: bool = False,
                 keep_on_exit: bool = False) -> Registration:
        req = _register_request(next(self._ids), engine_id, tp_rank, layout, regions, allocate,
                                keep_on_exit)
        reply = _expect(self._call(req), Registered)
        try:
            return _registration(reply, regions)
        except BaseException:
            self._deregister_quietly(engine_id)
            raise

    def deregister(self, engine_id: str) -> None:
        _expect(self._call(Deregister(engine_id, id=next(self._ids))), Ok)

    def read(self, engine_id: str, request_id: str, local_block_ids: BlockIdsLike,
             remote: RemoteEngine, remote_block_ids: BlockIdsLike, *,
             remote_request_id: str | None = None, skip_tokens: int | None = None,
             num_tokens: int | None = None) -> None:
        req = _read_request(next(self._ids), engine_id, request_id, local_block_ids, remote,
                            remote_block_ids, remote_request_id, skip_tokens, num_tokens)
        _expect(self._call(req), Ok)

    def hold(self, engine_id: str, request_id: str, block_ids: BlockIdsLike, *,
             readers: int = 1, timeout_s: float | None = None) -> None:
        req = _hold_request(next(self._ids), engine_id, request_id, block_ids, readers,
                            timeout_s)
        _expect(self._call(req), Ok)

    def release(self, engine_id: str, request_id: str) -> None:
        _expect(self._call(Release(engine_id, request_id, id=next(self._ids))), Ok)

    def poll(self, engine_id: str) -> list[Completion]:
        """Completions since the last poll; one that was lost to a timeout comes again."""
        epoch, ack = self._acks.get(engine_id, ("", 0))
        reply = _expect(self._call(Poll(engine_id, ack, epoch, id=next(self._ids))), Completions)
        self._acks[engine_id] = (reply.epoch, reply.last)
        return reply.items

    def ping(self) -> Pong:
        return _expect(self._call(Ping(id=next(self._ids))), Pong)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._endpoint)
            self._sock = sock
        return self._sock

    def _call(self, req: Request) -> Reply:
        sock = self._socket()
        try:
            sock.send(encode_request(req), zmq.NOBLOCK)
        except zmq.Again:
            self.close()
            raise SidecarTimeout(f"cannot queue {type(req).__name__} to {self._endpoint}") from None
        deadline = time.monotonic() + self._timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(max(1, int(remaining * 1000))):
                self.close()  # a fresh socket next time: a late reply dies with this one
                raise SidecarTimeout(
                    f"no reply to {type(req).__name__} within {self._timeout_s} s "
                    f"from {self._endpoint}"
                )
            try:
                reply = decode_reply(sock.recv())
            except ProtocolError as e:
                raise BadMessage(e.code, f"undecodable reply: {e}") from None
            # With one call in flight, an error without an id (the daemon could
            # not read ours) is still this call's.
            if reply.id == req.id or (reply.id == -1 and isinstance(reply, Error)):
                return reply
            log.debug("dropping a stale reply with id %d", reply.id)

    def _deregister_quietly(self, engine_id: str) -> None:
        try:
            self.deregister(engine_id)
        except SidecarError as e:
            log.warning("could not deregister %s after a failed registration: %s", engine_id, e)


# --------------------------------------------------------------------------
# asyncio client
# --------------------------------------------------------------------------


class AsyncSidecarClient:
    """asyncio client; any number of calls may be outstanding at once.

    A reader task (started on the first call) hands each reply to the call
    with the same id; replies to calls that already timed out are dropped.
    Use it from one event loop.
    """

    def __init__(self, socket_path: str, timeout_s: float = 10.0) -> None:
        self._endpoint = _endpoint(socket_path)
        self._timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._acks: dict[str, tuple[str, int]] = {}
        self._poll_locks: dict[str, asyncio.Lock] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Reply]] = {}

    async def register(self, engine_id: str, tp_rank: int, layout: Layout, *,
                       regions: Sequence[ShmRegion] | None = None, allocate: bool = False,
                       keep_on_exit: bool = False) -> Registration:
        req = _register_request(next(self._ids), engine_id, tp_rank, layout, regions, allocate,
                                keep_on_exit)
        reply = _expect(await self._call(req), Registered)
        try:
            return _registration(reply, regions)
        except BaseException:
            await self._deregister_quietly(engine_id)
            raise

    async def deregister(self, engine_id: str) -> None:
        _expect(await self._call(Deregister(engine_id, id=next(self._ids))), Ok)

    async def read(self, engine_id: str, request_id: str, local_block_ids: BlockIdsLike,
                   remote: RemoteEngine, remote_block_ids: BlockIdsLike, *,
                   remote_request_id: str | None = None,
                   skip_tokens: int | None = None, num_tokens: int | None = None) -> None:
        req = _read_request(next(self._ids), engine_id, request_id, local_block_ids, remote,
                            remote_block_ids, remote_request_id, skip_tokens, num_tokens)
        _expect(await self._call(req), Ok)

    async def hold(self, engine_id: str, request_id: str, block_ids: BlockIdsLike, *,
                   readers: int = 1, timeout_s: float | None = None) -> None:
        req = _hold_request(next(self._ids), engine_id, request_id, block_ids, readers,
                            timeout_s)
        _expect(await self._call(req), Ok)

    async def release(self, engine_id: str, request_id: str) -> None:
        _expect(await self._call(Release(engine_id, request_id, id=next(self._ids))), Ok)

    async def poll(self, engine_id: str) -> list[Completion]:
        """As :meth:`SidecarClient.poll`. Polls of one engine are serialised: two
        in flight would acknowledge the same number and receive items twice."""
        lock = self._poll_locks.setdefault(engine_id, asyncio.Lock())
        async with lock:
            epoch, ack = self._acks.get(engine_id, ("", 0))
            reply = _expect(await self._call(Poll(engine_id, ack, epoch, id=next(self._ids))),
                            Completions)
            self._acks[engine_id] = (reply.epoch, reply.last)
            return reply.items

    async def ping(self) -> Pong:
        return _expect(await self._call(Ping(id=next(self._ids))), Pong)

    async def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._fail_pending(Unavailable(UNAVAILABLE, "client closed"))

    async def __aenter__(self) -> AsyncSidecarClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._endpoint)
            self._sock = sock
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_replies(self._sock))
        return self._sock

    async def _call(self, req: Request) -> Reply:
        sock = self._socket()
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[req.id] = fut
        try:
            return await asyncio.wait_for(self._exchange(sock, req, fut), self._timeout_s)
        except asyncio.TimeoutError:
            raise SidecarTimeout(
                f"no reply to {type(req).__name__} within {self._timeout_s} s "
                f"from {self._endpoint}"
            ) from None
        finally:
            self._pending.pop(req.id, None)

    @staticmethod
    async def _exchange(sock: zmq.asyncio.Socket, req: Request,
                        fut: asyncio.Future[Reply]) -> Reply:
        await sock.send(encode_request(req))
        return await fut

    async def _read_replies(self, sock: zmq.asyncio.Socket) -> None:
        """Route replies to waiting calls until cancelled or the socket dies."""
        try:
            while True:
                data = await sock.recv()
                try:
                    reply = decode_reply(data)
                except ProtocolError as e:
                    self._resolve(e.id, BadMessage(e.code, f"undecodable reply: {e}"))
                    continue
                self._resolve(reply.id, reply)
        except zmq.ZMQError as e:
            self._fail_pending(Unavailable(UNAVAILABLE, f"socket failed: {e}"))

    def _resolve(self, id: int, outcome: Reply | SidecarError) -> None:
        if id == -1 and len(self._pending) == 1:
            # The daemon could not read our id; with one call waiting it is that one's.
            id = next(iter(self._pending))
        fut = self._pending.get(id)
        if fut is None or fut.done():
            log.debug("dropping a reply with no waiting call (id %d)", id)
            return
        if isinstance(outcome, SidecarError):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)

    def _fail_pending(self, exc: SidecarError) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)

    async def _deregister_quietly(self, engine_id: str) -> None:
        try:
            await self.deregister(engine_id)
        except SidecarError as e:
            log.warning("could not deregister %s after a failed registration: %s", engine_id, e)
