"""The engine's side of the sidecar: a thin client over ZMQ IPC.

Every call is one short round trip: the daemon accepts or refuses a request
and answers at once; transfers finish later and are collected with
:meth:`SidecarClient.poll`. Nothing here waits on a transfer.

Two faces with the same methods over one core: :class:`SidecarClient`
(blocking, one call at a time, one per thread) and :class:`AsyncSidecarClient`
(coroutines, several calls outstanding, replies matched by id). Each call is
written once, in :class:`ClientCore`, as a generator that yields requests and
receives replies; a face only moves bytes and waits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import operator
import os
import secrets
import time
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeAlias, TypeVar

import msgspec
import numpy as np
import zmq

from .layout import Layout
from .loop_socket import LoopSocket
from .mapping import map_refs
from .protocol import (
    BAD_MESSAGE,
    BAD_REQUEST,
    DUPLICATE,
    FORBIDDEN,
    INCOMPATIBLE,
    INTERNAL,
    MAX_BATCH,
    UNAVAILABLE,
    UNKNOWN_ENGINE,
    VERSION,
    Batch,
    Completion,
    Completions,
    Deregister,
    Error,
    Held,
    Hold,
    MemoryKind,
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
    Replies,
    Reply,
    Request,
    Reserve,
    Reserved,
    decode_reply,
    encode_request,
)
from .regions import Region

log = logging.getLogger(__name__)

BlockIdsLike: TypeAlias = (
    Sequence[Sequence[int]] | Sequence[np.ndarray[Any, Any]] | np.ndarray[Any, Any]
)
"""Per-group block ids: lists of ints, 1-D integer arrays, or one 2-D integer array."""

R = TypeVar("R", bound=Reply)
T = TypeVar("T")


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


class Forbidden(SidecarError):
    """This process's uid/gid may not use the sidecar (its ``--allow-uid``/``--allow-gid``)."""


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
    FORBIDDEN: Forbidden,
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
    daemon's in allocate mode: shm, memfd or GPU regions, see
    :class:`~kvsidecar.ipc.regions.Region`)."""

    engine_id: str
    handshake_address: str
    agent_name: str
    regions: list[Region]


@dataclass(frozen=True)
class ReadSpec:
    """One read of a :meth:`SidecarClient.read_many` batch (the arguments of
    :meth:`SidecarClient.read` after the engine id)."""

    request_id: str
    local_block_ids: BlockIdsLike
    remote: RemoteEngine
    remote_block_ids: BlockIdsLike
    remote_request_id: str | None = None
    skip_tokens: int | None = None
    num_tokens: int | None = None


@dataclass(frozen=True)
class HoldSpec:
    """One hold of a :meth:`SidecarClient.hold_many` batch."""

    request_id: str
    block_ids: BlockIdsLike
    readers: int = 1
    timeout_s: float | None = None


def _item_outcome(reply: Ok | Held | Error) -> Held | SidecarError | None:
    """One batch item's answer: the error it was refused with, a hold's
    :class:`Held`, or None for an accepted read or release."""
    if isinstance(reply, Error):
        return error_from_reply(reply)
    return reply if isinstance(reply, Held) else None


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


def _registration(reply: Registered, regions: Sequence[Region] | None) -> Registration:
    """Map allocate-mode regions (fetching fds from the sidecar's fd socket for
    memfd / CUDA VMM kinds); the caller deregisters if this raises."""
    mapped: list[Region] = (list(regions) if regions is not None
                            else map_refs(reply.regions, reply.fd_socket))
    return Registration(reply.engine_id, reply.handshake_address, reply.agent_name, mapped)


REGISTER_S_PER_GB = 2.0
"""Extra reply wait per GB registered (measured 0.9 s/GB to create and touch shm)."""

_INSTANCE = secrets.token_hex(6)


def process_instance() -> str:
    """Names this engine process for the sidecar (a fork is another instance):
    a registration retried by the same process is recognised as a retry."""
    return f"{_INSTANCE}-{os.getpid():x}"


def _pid_namespace() -> str:
    """``pid:[inode]`` of this process's PID namespace ('' where unknown): the
    sidecar trusts ``pid`` only when this names its own namespace."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _endpoint(socket_path: str) -> str:
    return socket_path if "://" in socket_path else f"ipc://{socket_path}"



# --------------------------------------------------------------------------
# The core shared by both clients: every call as a generator (sans I/O)
# --------------------------------------------------------------------------

Call: TypeAlias = Generator[Request, Reply, T]
"""One client call without I/O: it yields each request it needs answered and
receives the reply (or has the transport's exception thrown in); its return
value is the call's result. Both clients run the same generators, so request
building, reply checking, error mapping and acknowledgement bookkeeping exist
once; the clients only move bytes."""


class ClientCore:
    """What both clients share: ids, calls, decoding and correlation of replies,
    error mapping and the per-engine poll acknowledgements."""

    def __init__(self, socket_path: str, timeout_s: float) -> None:
        self.endpoint = _endpoint(socket_path)
        self.timeout_s = timeout_s
        self.acks: dict[str, tuple[str, int]] = {}
        self._ids = itertools.count(1)

    # ---- calls

    def register(self, engine_id: str, tp_rank: int, layout: Layout,
                 regions: Sequence[Region] | None, allocate: bool,
                 keep_on_exit: bool, memory: MemoryKind = "shm") -> Call[Registration]:
        if allocate == (regions is not None):
            raise ValueError("register: pass either regions (attach mode) or allocate=True")
        req = Register(engine_id, tp_rank, layout, "allocate" if allocate else "attach",
                       [r.ref() for r in regions or ()], keep_on_exit, os.getpid(),
                       _pid_namespace(), process_instance(), memory, id=self._next_id())
        reply = _expect((yield req), Registered)
        try:
            return _registration(reply, regions)
        except BaseException:
            # The daemon holds a registration this engine cannot use: undo it.
            try:
                _expect((yield Deregister(engine_id, id=self._next_id())), Ok)
            except SidecarError as e:
                log.warning("could not deregister %s after a failed registration: %s",
                            engine_id, e)
            raise

    def deregister(self, engine_id: str) -> Call[None]:
        _expect((yield Deregister(engine_id, id=self._next_id())), Ok)

    def reserve(self, engine_id: str, nbytes: int, memory: MemoryKind) -> Call[Region]:
        reply = _expect((yield Reserve(engine_id, nbytes, memory, id=self._next_id())),
                        Reserved)
        (region,) = map_refs([reply.region], reply.fd_socket)
        return region

    def read(self, engine_id: str, request_id: str, local_block_ids: BlockIdsLike,
             remote: RemoteEngine, remote_block_ids: BlockIdsLike,
             remote_request_id: str | None, skip_tokens: int | None,
             num_tokens: int | None) -> Call[None]:
        req = Read(engine_id, request_id, block_id_lists(local_block_ids), remote,
                   block_id_lists(remote_block_ids), remote_request_id, skip_tokens, num_tokens,
                   id=self._next_id())
        _expect((yield req), Ok)

    def hold(self, engine_id: str, request_id: str, block_ids: BlockIdsLike, readers: int,
             timeout_s: float | None) -> Call[Held]:
        req = Hold(engine_id, request_id, block_id_lists(block_ids), readers, timeout_s,
                   id=self._next_id())
        return _expect((yield req), Held)

    def release(self, engine_id: str, request_id: str) -> Call[None]:
        _expect((yield Release(engine_id, request_id, id=self._next_id())), Ok)

    def read_many(self, engine_id: str, specs: Sequence[ReadSpec]
                  ) -> Call[list[SidecarError | None]]:
        reqs: list[Read | Hold | Release] = [
            Read(engine_id, s.request_id, block_id_lists(s.local_block_ids), s.remote,
                 block_id_lists(s.remote_block_ids), s.remote_request_id, s.skip_tokens,
                 s.num_tokens, id=self._next_id())
            for s in specs]
        out = yield from self._batch(reqs)
        return [o if isinstance(o, SidecarError) else None for o in out]

    def hold_many(self, engine_id: str, specs: Sequence[HoldSpec]
                  ) -> Call[list[Held | SidecarError]]:
        reqs: list[Read | Hold | Release] = [
            Hold(engine_id, s.request_id, block_id_lists(s.block_ids), s.readers, s.timeout_s,
                 id=self._next_id())
            for s in specs]
        out = yield from self._batch(reqs)
        for o in out:
            if o is None:
                raise BadMessage(BAD_MESSAGE, "a hold in a batch was answered without Held")
        return [o for o in out if o is not None]

    def release_many(self, engine_id: str, request_ids: Sequence[str]
                     ) -> Call[list[SidecarError | None]]:
        reqs: list[Read | Hold | Release] = [
            Release(engine_id, rid, id=self._next_id()) for rid in request_ids]
        out = yield from self._batch(reqs)
        return [o if isinstance(o, SidecarError) else None for o in out]

    def _batch(self, reqs: list[Read | Hold | Release]
               ) -> Call[list[Held | SidecarError | None]]:
        """One :class:`Batch` (protocol minor 5; an older sidecar refuses the op
        as a ``bad_message``), answered item by item."""
        if not reqs:
            return []
        if len(reqs) > MAX_BATCH:
            raise ValueError(f"{len(reqs)} requests in one batch; at most {MAX_BATCH}")
        reply = _expect((yield Batch(reqs, id=self._next_id())), Replies)
        if len(reply.items) != len(reqs):
            raise BadMessage(BAD_MESSAGE, f"a batch of {len(reqs)} was answered with "
                                          f"{len(reply.items)} replies")
        return [_item_outcome(r) for r in reply.items]

    def poll(self, engine_id: str, wait_s: float = 0.0) -> Call[list[Completion]]:
        """Completions since the last poll; one that was lost to a timeout comes
        again, because each poll acknowledges only what this client received.
        With ``wait_s`` an empty poll waits that long for one (protocol minor 4;
        an older sidecar answers at once)."""
        epoch, ack = self.acks.get(engine_id, ("", 0))
        reply = _expect((yield Poll(engine_id, ack, epoch, wait_s, id=self._next_id())),
                        Completions)
        self.acks[engine_id] = (reply.epoch, reply.last)
        return reply.items

    def ping(self) -> Call[Pong]:
        return _expect((yield Ping(id=self._next_id())), Pong)

    # ---- wire

    def encode(self, req: Request) -> bytes:
        return encode_request(req)

    def decode(self, data: bytes) -> tuple[int, Reply | SidecarError]:
        """The reply's id and the reply, or the error an undecodable reply means."""
        try:
            reply = decode_reply(data)
        except ProtocolError as e:
            return e.id, BadMessage(e.code, f"undecodable reply: {e}")
        return reply.id, reply

    def timeout_for(self, req: Request) -> float:
        """How long to wait for the reply to ``req``: registration creates (or maps
        and NIXL-registers) every byte of the cache, about 0.9 s per GB here, so
        its wait grows with the layout's size (with a 2x margin for a loaded
        machine); everything else is one short round trip."""
        if isinstance(req, Register):
            nbytes = req.layout.num_regions * req.layout.region_bytes
            return self.timeout_s + REGISTER_S_PER_GB * nbytes / 1e9
        if isinstance(req, Poll):
            return self.timeout_s + req.wait_s
        return self.timeout_s

    def timeout_error(self, req: Request, timeout_s: float) -> SidecarTimeout:
        return SidecarTimeout(f"no reply to {type(req).__name__} within {timeout_s} s "
                              f"from {self.endpoint}")

    def _next_id(self) -> int:
        return next(self._ids)


def _advance(call: Call[T], outcome: Reply | SidecarError | None) -> Request:
    """Hand ``call`` its reply (or the transport's error) and return the next
    request it needs answered; raises StopIteration carrying the result."""
    if isinstance(outcome, SidecarError):
        return call.throw(outcome)
    return call.send(outcome)  # type: ignore[arg-type]  # None starts the generator


# --------------------------------------------------------------------------
# Blocking face
# --------------------------------------------------------------------------


class SidecarClient:
    """Blocking client; one call in flight at a time, not thread-safe (ZMQ sockets
    are not): use one per thread.

    After a timeout the socket is replaced, so a reply that arrives late cannot
    be taken for the next call's.
    """

    def __init__(self, socket_path: str, timeout_s: float = 10.0) -> None:
        self._core = ClientCore(socket_path, timeout_s)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self._rcvtimeo_ms = -1  # the socket's RCVTIMEO as last set (-1: libzmq's default)

    @property
    def timeout_s(self) -> float:
        return self._core.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._core.timeout_s = value

    def register(self, engine_id: str, tp_rank: int, layout: Layout, *,
                 regions: Sequence[Region] | None = None, allocate: bool = False,
                 keep_on_exit: bool = False, memory: MemoryKind = "shm") -> Registration:
        """``memory`` (allocate mode): what the sidecar allocates, ``shm``/``memfd``
        host memory or ``cuda_malloc``/``cuda_vmm`` on its GPU."""
        return self._run(self._core.register(engine_id, tp_rank, layout, regions, allocate,
                                             keep_on_exit, memory))

    def deregister(self, engine_id: str) -> None:
        self._run(self._core.deregister(engine_id))

    def reserve(self, engine_id: str, nbytes: int, memory: MemoryKind = "memfd") -> Region:
        """Have the sidecar allocate one region of ``nbytes`` for ``engine_id`` and
        map it here; register ``RegionView``s into it later (attach mode). For
        engines that learn their layout from their own allocation (vLLM: see
        :mod:`kvsidecar.ipc.kv_pool`). ``deregister(engine_id)`` drops it."""
        return self._run(self._core.reserve(engine_id, nbytes, memory))

    def read(self, engine_id: str, request_id: str, local_block_ids: BlockIdsLike,
             remote: RemoteEngine, remote_block_ids: BlockIdsLike, *,
             remote_request_id: str | None = None, skip_tokens: int | None = None,
             num_tokens: int | None = None) -> None:
        """Ask the sidecar to pull ``remote_block_ids`` of ``remote`` into local blocks.

        Errors, one rule: what the local sidecar can judge from the request
        itself (malformed, unknown engine, local ids out of range or named
        twice, group counts, tp sizes that do not divide, a request id already
        reading, a per-engine limit) raises here, and nothing was started;
        everything that needs the peer (handshake, model fingerprint, remote
        ids, the transfer) arrives later as a ``failed``
        completion from :meth:`poll`. An adapter that wants a single route
        turns the exception into a failed read itself (``kvsidecar.ipc.vllm``
        does).

        Units (one convention for read, hold and the vLLM adapter, defined in
        :mod:`kvsidecar.ipc.layout`, "Units and offsets"): block ids name pages
        (vLLM's logical blocks), never kernel blocks; ``skip_tokens`` and
        ``num_tokens`` count tokens.

        ``skip_tokens``: leading tokens D already holds (a prefix hit); a whole
        number of the local group's logical blocks (``sub_blocks *
        block_tokens``), the granularity of a prefix-cache hit. Leave it out
        only when both sides have the same ``sub_blocks`` (then it is inferred
        from the block counts); with differing ``sub_blocks`` and no
        ``num_tokens`` the read is refused rather than guessed.
        ``num_tokens``: the prompt length. It only trims kernel blocks past the
        last token; leaving it out reads whole blocks (more bytes, never fewer),
        so the default is the safe side.
        """
        self._run(self._core.read(engine_id, request_id, local_block_ids, remote,
                                  remote_block_ids, remote_request_id, skip_tokens, num_tokens))

    def hold(self, engine_id: str, request_id: str, block_ids: BlockIdsLike, *,
             readers: int = 1, timeout_s: float | None = None) -> Held:
        """Keep blocks for readers; the reply's lease travels to them with the request."""
        return self._run(self._core.hold(engine_id, request_id, block_ids, readers, timeout_s))

    def release(self, engine_id: str, request_id: str) -> None:
        self._run(self._core.release(engine_id, request_id))

    def read_many(self, engine_id: str, specs: Sequence[ReadSpec]
                  ) -> list[SidecarError | None]:
        """Start several reads in one message (protocol minor 5): what a
        scheduler step starts at once costs one round trip. Returns, per read
        and in order, None (accepted: its completion comes through poll) or
        the error it was refused with; the others are unaffected."""
        return self._run(self._core.read_many(engine_id, specs))

    def hold_many(self, engine_id: str, specs: Sequence[HoldSpec]
                  ) -> list[Held | SidecarError]:
        """Place several holds in one message (protocol minor 5); per hold, its
        :class:`~kvsidecar.ipc.protocol.Held` or the error it was refused with."""
        return self._run(self._core.hold_many(engine_id, specs))

    def release_many(self, engine_id: str, request_ids: Sequence[str]
                     ) -> list[SidecarError | None]:
        """Release several reads or holds in one message (protocol minor 5)."""
        return self._run(self._core.release_many(engine_id, request_ids))

    def poll(self, engine_id: str, wait_s: float = 0.0) -> list[Completion]:
        """Completions since the last poll; one that was lost to a timeout comes again.

        ``wait_s``: with nothing to return, block up to that long until a
        completion arrives (an engine waiting for its reads then costs no CPU
        and learns of each at once, instead of spinning on empty polls)."""
        return self._run(self._core.poll(engine_id, wait_s))

    def ping(self) -> Pong:
        return self._run(self._core.ping())

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _run(self, call: Call[T]) -> T:
        outcome: Reply | SidecarError | None = None
        while True:
            try:
                req = _advance(call, outcome)
            except StopIteration as stop:
                result: T = stop.value
                return result
            try:
                outcome = self._exchange(req)
            except SidecarError as e:
                outcome = e
            except BaseException:
                call.close()
                raise

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._core.endpoint)
            self._sock = sock
            self._rcvtimeo_ms = -1  # libzmq's default: block forever
        return self._sock

    def _exchange(self, req: Request) -> Reply:
        sock = self._socket()
        try:
            sock.send(self._core.encode(req), zmq.NOBLOCK)
        except zmq.Again:
            self.close()
            raise SidecarTimeout(f"cannot queue {type(req).__name__} to "
                                 f"{self._core.endpoint}") from None
        timeout_s = self._core.timeout_for(req)
        deadline = time.monotonic() + timeout_s
        wait_ms = max(1, int(timeout_s * 1000))
        while True:
            # A blocking recv bounded by RCVTIMEO (set only when it changes): one
            # libzmq call per reply, where poll-then-recv built a Poller and made
            # two; about a quarter of this client's CPU per call.
            if wait_ms != self._rcvtimeo_ms:
                sock.setsockopt(zmq.RCVTIMEO, wait_ms)
                self._rcvtimeo_ms = wait_ms
            try:
                data = sock.recv()
            except zmq.Again:
                self.close()  # a fresh socket next time: a late reply dies with this one
                raise self._core.timeout_error(req, timeout_s) from None
            id, outcome = self._core.decode(data)
            # With one call in flight, an error without an id (the daemon could
            # not read ours) is still this call's.
            if id == req.id or (id == -1 and isinstance(outcome, (Error, SidecarError))):
                if isinstance(outcome, SidecarError):
                    raise outcome
                return outcome
            log.debug("dropping a stale reply with id %d", id)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close()
                raise self._core.timeout_error(req, timeout_s)
            wait_ms = max(1, int(remaining * 1000))


# --------------------------------------------------------------------------
# asyncio face
# --------------------------------------------------------------------------


class AsyncSidecarClient:
    """asyncio client; any number of calls may be outstanding at once.

    A reader task (started on the first call) hands each reply to the call
    with the same id; replies to calls that already timed out are dropped.
    Use it from one event loop.
    """

    def __init__(self, socket_path: str, timeout_s: float = 10.0) -> None:
        self._core = ClientCore(socket_path, timeout_s)
        self._poll_locks: dict[str, asyncio.Lock] = {}
        self._sock: LoopSocket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Reply]] = {}

    @property
    def timeout_s(self) -> float:
        return self._core.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._core.timeout_s = value

    async def register(self, engine_id: str, tp_rank: int, layout: Layout, *,
                       regions: Sequence[Region] | None = None, allocate: bool = False,
                       keep_on_exit: bool = False, memory: MemoryKind = "shm") -> Registration:
        return await self._run(self._core.register(engine_id, tp_rank, layout, regions,
                                                   allocate, keep_on_exit, memory))

    async def deregister(self, engine_id: str) -> None:
        await self._run(self._core.deregister(engine_id))

    async def reserve(self, engine_id: str, nbytes: int,
                      memory: MemoryKind = "memfd") -> Region:
        return await self._run(self._core.reserve(engine_id, nbytes, memory))

    async def read(self, engine_id: str, request_id: str, local_block_ids: BlockIdsLike,
                   remote: RemoteEngine, remote_block_ids: BlockIdsLike, *,
                   remote_request_id: str | None = None,
                   skip_tokens: int | None = None, num_tokens: int | None = None) -> None:
        await self._run(self._core.read(engine_id, request_id, local_block_ids, remote,
                                        remote_block_ids, remote_request_id, skip_tokens,
                                        num_tokens))

    async def hold(self, engine_id: str, request_id: str, block_ids: BlockIdsLike, *,
                   readers: int = 1, timeout_s: float | None = None) -> Held:
        return await self._run(self._core.hold(engine_id, request_id, block_ids, readers,
                                               timeout_s))

    async def release(self, engine_id: str, request_id: str) -> None:
        await self._run(self._core.release(engine_id, request_id))

    async def read_many(self, engine_id: str, specs: Sequence[ReadSpec]
                        ) -> list[SidecarError | None]:
        """As :meth:`SidecarClient.read_many`."""
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
            return await self._run(self._core.poll(engine_id, wait_s))

    async def ping(self) -> Pong:
        return await self._run(self._core.ping())

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

    async def _run(self, call: Call[T]) -> T:
        outcome: Reply | SidecarError | None = None
        while True:
            try:
                req = _advance(call, outcome)
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

    def _socket(self) -> LoopSocket:
        if self._sock is None:
            sock = LoopSocket.of(zmq.Context.instance(), zmq.DEALER)
            sock.sock.setsockopt(zmq.LINGER, 0)
            sock.sock.connect(self._core.endpoint)
            self._sock = sock
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_replies(self._sock))
        return self._sock

    async def _exchange(self, req: Request) -> Reply:
        sock = self._socket()
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[req.id] = fut
        timeout_s = self._core.timeout_for(req)
        try:
            return await asyncio.wait_for(self._send_and_wait(sock, req, fut), timeout_s)
        except asyncio.TimeoutError:
            raise self._core.timeout_error(req, timeout_s) from None
        finally:
            self._pending.pop(req.id, None)

    async def _send_and_wait(self, sock: LoopSocket, req: Request,
                             fut: asyncio.Future[Reply]) -> Reply:
        await sock.send(self._core.encode(req))
        return await fut

    async def _read_replies(self, sock: LoopSocket) -> None:
        """Route replies to waiting calls until cancelled or the socket dies."""
        try:
            while True:
                id, outcome = self._core.decode((await sock.recv_multipart())[-1])
                self._resolve(id, outcome)
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
