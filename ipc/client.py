"""The engine's side of the sidecar: a thin client over a Unix socket.

Every call is one short round trip: the daemon accepts or refuses a request
and answers at once; transfers finish later and are collected with
:meth:`SidecarClient.poll`. Nothing here waits on a transfer.

Two faces with the same methods over one core: :class:`SidecarClient`
(blocking, one call at a time, one per thread) and :class:`AsyncSidecarClient`
(coroutines, several calls outstanding, replies matched by id). Each call is
written once, in :class:`ClientCore`, as a generator that yields requests and
receives replies; a face only moves bytes and waits.

The channel is an ``AF_UNIX`` ``SOCK_SEQPACKET`` connection (framing in
:mod:`kvsidecar.ipc.seqpacket`): the blocking client sends and receives on
it directly, one system call each way and no I/O thread; the async client
reads it from a loop reader callback. No daemon yet (no socket, nobody
listening) is waited for, up to the call's timeout; a connection the daemon
closed (it restarted) is replaced by a new one on the next call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import itertools
import logging
import operator
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, TypeAlias, TypeVar

import msgspec
import numpy as np

from .layout import Layout
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
    DrainMode,
    Error,
    Held,
    Hold,
    Keep,
    KeepItem,
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
    Status,
    StatusReport,
    decode_reply,
    decode_reply_unchecked,
    encode_request,
)
from .regions import Region
from .seqpacket import (
    MAX_PACKET,
    RECV_BYTES,
    Assembler,
    Buffer,
    FramingError,
    MessageTooLong,
    new_socket,
    packets,
    peer_closed,
)

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


#: The protocol minor from which a sidecar honours ``Read.verify``: an older one
#: decodes the field as unknown and reads without verifying.
VERIFY_MINOR: Final = 7


def _can_verify(minor: int) -> None:
    """Unavailable unless a sidecar of protocol ``minor`` verifies what it is asked to."""
    if minor < VERIFY_MINOR:
        raise Unavailable(UNAVAILABLE, (
            f"byte verification (verify=True) needs a sidecar of protocol minor "
            f"{VERIFY_MINOR} or later; this one speaks minor {minor} and would read without "
            "verifying: nothing was sent"))


def _expect(reply: Reply, kind: type[R]) -> R:
    """``reply`` if it is a ``kind``; else the error it is (or is not: a reply of
    another kind is a :class:`BadMessage`) raised. The expected kind is tested
    first: ``isinstance`` of the exact class is immediate, while a miss on a
    msgspec Struct costs ~2 µs on a cold cache."""
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, Error):
        raise error_from_reply(reply)
    got = type(reply).__name__
    raise BadMessage(BAD_MESSAGE, f"expected a {kind.__name__} reply, got {got}")


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
    #: the rank's hold key (ipc/hold_token.py): lets the engine issue its own hold
    #: tokens, as the vLLM scheduler does; as secret as the KV memory itself
    hold_key: bytes = b""


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
    #: verify its bytes (see :meth:`SidecarClient.read`)
    verify: bool = False
    #: the hold token each remote rank's hold issued (``Held.token``), in rank order
    remote_tokens: Sequence[str] = ()


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
    if type(reply) is Error:
        return error_from_reply(reply)
    return reply if type(reply) is Held else None


def block_id_lists(groups: BlockIdsLike) -> list[list[int]]:
    """Plain ``list[list[int]]`` for the wire; rejects floats, bools and flat lists."""
    if type(groups) is list:
        # What engines pass most: lists of plain ints, sent as they are once each
        # id's type is checked. Every read pays this twice and every hold once, so
        # the cheapest check: a plain loop, faster than
        # frozenset.issuperset(map(type, g)) at every length measured (16 ids: 2.9
        # against 4.5 µs on a cold cache, 0.5 against 0.7 warm; 4096 ids: 72
        # against 83 µs warm), itself a third of msgspec.convert's cost.
        for g in groups:
            if type(g) is not list:
                break
            for b in g:
                if type(b) is not int:
                    break
            else:
                continue  # this group is plain ints: check the next
            break  # an id that is not a plain int
        else:
            return groups
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
            result.append([_block_id(b) for b in g])
        else:
            raise TypeError(
                f"block ids: expected one sequence per KV-cache group, got {type(g).__name__}"
            )
    return result


def _block_id(b: Any) -> int:
    """One id of a group given as a sequence: any integer (``operator.index``:
    numpy's too), but not a bool, which is one too in Python: a mask passed for
    ids would read blocks 0 and 1 (a numpy bool array is refused by dtype)."""
    if isinstance(b, (bool, np.bool_)):
        raise TypeError(f"block ids: expected integers, got a bool ({b!r})")
    return operator.index(b)


def _check_int_dtype(a: np.ndarray[Any, Any]) -> None:
    if a.dtype.kind not in "iu":
        raise TypeError(f"block ids: expected an integer array, got dtype {a.dtype}")


#: Replies after which a call maps memory (blocking: fd fetches, mmap).
_MAPS_MEMORY: Final = (Registered, Reserved)


def _registration(reply: Registered, regions: Sequence[Region] | None) -> Registration:
    """Map allocate-mode regions (fetching fds from the sidecar's fd socket for
    memfd / CUDA VMM kinds); the caller deregisters if this raises."""
    mapped: list[Region] = (list(regions) if regions is not None
                            else map_refs(reply.regions, reply.fd_socket))
    return Registration(reply.engine_id, reply.handshake_address, reply.agent_name, mapped,
                        reply.hold_key)


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


def _socket_path(socket_path: str) -> str:
    """The engine socket's path (an ``ipc://`` prefix, as earlier ZMQ versions
    took, is dropped)."""
    path = socket_path.removeprefix("ipc://")
    if "://" in path:
        raise ValueError(f"the engine socket is a Unix socket path, not {socket_path!r}")
    return path


#: A sanity bound on one reply (the daemon's replies are far smaller).
MAX_REPLY_BYTES = 1 << 30
#: Retries while no daemon listens yet: from this pause, doubling up to the next.
_CONNECT_PAUSE_S = (0.002, 0.05)
#: Connection errors that mean "no daemon (yet)": wait for one within the timeout.
_NOT_YET = (FileNotFoundError, ConnectionRefusedError, BlockingIOError, InterruptedError)
_timeval = struct.Struct("@ll")
#: The requests :meth:`ClientCore.timeout_for` gives more than the client's
#: timeout (a face asks it only for these: one frame less on other calls).
_WAIT_LONGER: Final[frozenset[type]] = frozenset({Register, Poll})
#: A poll of an engine this client has not polled yet acknowledges nothing.
_NO_ACK: Final = ("", 0)
_NOSIGNAL: Final = socket.MSG_NOSIGNAL
_TRUNC: Final = socket.MSG_TRUNC
#: Forks this process descends through (a child's clients must not use their
#: parent's connections); a counter, so a call checks it without a getpid().
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


# --------------------------------------------------------------------------
# The core shared by both clients: every call as a generator (sans I/O)
# --------------------------------------------------------------------------

Ask: TypeAlias = tuple[Request, type[R]]
"""A call that is one request, answered by a reply of one kind: the request
and that kind. A face sends the request and hands the reply to
:func:`_expect` with the kind (and a poll's to :meth:`ClientCore.polled`).
The engine's calls between model steps (read, hold, release, poll) are asks:
no generator, no frame between the face and the socket but the core's
builder, because on a cold cache every frame and object a call touches costs
it a microsecond or more (a generator round, ~10 µs a call here)."""

Call: TypeAlias = Generator[Request, Reply, T]
"""A call with more to it, without I/O: it yields each request it needs
answered and receives the reply (or has the transport's exception thrown in);
its return value is the call's result (registration, which undoes itself if
the engine cannot use it, and batches). Both clients run the same generators
and send the same asks, so request building, reply checking, error mapping and
acknowledgement bookkeeping exist once; the clients only move bytes."""


class ClientCore:
    """What both clients share: ids, calls (asks and generators), decoding and
    correlation of replies, error mapping and the per-engine poll
    acknowledgements."""

    def __init__(self, socket_path: str, timeout_s: float) -> None:
        self.path = _socket_path(socket_path)
        self.endpoint = self.path  # what error messages name
        self.timeout_s = timeout_s
        self.acks: dict[str, tuple[str, int]] = {}
        self._ids = itertools.count(1)
        #: the receive buffer (one connection at a time per client) and its framing state
        self.buf = bytearray(RECV_BYTES)
        self.view = memoryview(self.buf)
        self.assembler = Assembler(MAX_REPLY_BYTES)

    # ---- calls

    def register(self, engine_id: str, tp_rank: int, layout: Layout,
                 regions: Sequence[Region] | None, allocate: bool,
                 keep_on_exit: bool, memory: MemoryKind = "memfd") -> Call[Registration]:
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
                undo, kind = self.deregister(engine_id)
                _expect((yield undo), kind)
            except SidecarError as e:
                log.warning("could not deregister %s after a failed registration: %s",
                            engine_id, e)
            raise

    def deregister(self, engine_id: str, mode: DrainMode = "drop") -> Ask[Ok]:
        return Deregister(engine_id, mode, id=next(self._ids)), Ok

    def reserve(self, engine_id: str, nbytes: int, memory: MemoryKind) -> Call[Region]:
        reply = _expect((yield Reserve(engine_id, nbytes, memory, id=self._next_id())),
                        Reserved)
        (region,) = map_refs([reply.region], reply.fd_socket)
        return region

    def read(self, engine_id: str, request_id: str, local_block_ids: BlockIdsLike,
             remote: RemoteEngine, remote_block_ids: BlockIdsLike,
             remote_request_id: str | None, skip_tokens: int | None,
             num_tokens: int | None, verify: bool = False,
             remote_tokens: Sequence[str] = ()) -> Ask[Ok]:
        return Read(engine_id, request_id, block_id_lists(local_block_ids), remote,
                    block_id_lists(remote_block_ids), remote_request_id, skip_tokens,
                    num_tokens, verify, list(remote_tokens), id=next(self._ids)), Ok

    def hold(self, engine_id: str, request_id: str, block_ids: BlockIdsLike, readers: int,
             timeout_s: float | None) -> Ask[Held]:
        return Hold(engine_id, request_id, block_id_lists(block_ids), readers, timeout_s,
                    id=next(self._ids)), Held

    def release(self, engine_id: str, request_id: str) -> Ask[Ok]:
        return Release(engine_id, request_id, id=next(self._ids)), Ok

    def read_many(self, engine_id: str, specs: Sequence[ReadSpec]
                  ) -> Call[list[SidecarError | None]]:
        reqs: list[Read | Hold | Release] = [
            Read(engine_id, s.request_id, block_id_lists(s.local_block_ids), s.remote,
                 block_id_lists(s.remote_block_ids), s.remote_request_id, s.skip_tokens,
                 s.num_tokens, s.verify, list(s.remote_tokens), id=self._next_id())
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

    def poll(self, engine_id: str, wait_s: float = 0.0) -> Ask[Completions]:
        """Completions since the last poll; one that was lost to a timeout comes
        again, because each poll acknowledges only what this client received
        (:meth:`polled`). With ``wait_s`` an empty poll waits that long for one
        (protocol minor 4; an older sidecar answers at once)."""
        epoch, ack = self.acks.get(engine_id, _NO_ACK)
        return Poll(engine_id, ack, epoch, wait_s, id=next(self._ids)), Completions

    def polled(self, engine_id: str, reply: Completions) -> list[Completion]:
        """A poll's answer: its items, acknowledged by the engine's next poll."""
        self.acks[engine_id] = (reply.epoch, reply.last)
        return reply.items

    def ping(self, engines: Sequence[str] = ()) -> Ask[Pong]:
        return Ping(engines=list(engines), id=next(self._ids)), Pong

    def keep(self, engine_id: str, items: Sequence[KeepItem]) -> Ask[Ok]:
        return Keep(engine_id, list(items), id=next(self._ids)), Ok

    def status(self) -> Ask[StatusReport]:
        return Status(id=next(self._ids)), StatusReport

    # ---- wire

    def decode(self, data: Buffer) -> tuple[int, Reply | SidecarError]:
        """The reply's id and the reply, or the error an undecodable reply means."""
        try:
            reply = decode_reply(data)
        except ProtocolError as e:
            return e.id, BadMessage(e.code, f"undecodable reply: {e}")
        return reply.id, reply

    def received(self, n: int) -> tuple[int, Reply | SidecarError] | None:
        """The packet of ``n`` bytes just received into :attr:`buf`: the reply it
        completes (its id and outcome), or None while a long reply is arriving."""
        try:
            message = self.assembler.feed(self.view[:n])
        except (FramingError, MessageTooLong) as e:
            return -1, BadMessage(BAD_MESSAGE, f"unreadable reply: {e}")
        return None if message is None else self.decode(message)

    def new_connection(self) -> socket.socket:
        """A connected non-blocking socket, or raises: one of ``_NOT_YET`` while no
        daemon listens, :class:`SidecarError` for what waiting cannot fix."""
        sock = new_socket()
        sock.setblocking(False)
        try:
            sock.connect(self.path)
        except _NOT_YET:
            sock.close()
            raise
        except PermissionError as e:
            sock.close()
            raise Forbidden(FORBIDDEN, f"cannot connect to {self.path}: {e} (the socket's "
                                       "mode lets in the sidecar's own uid and those its "
                                       "--allow-uid/--allow-gid name)") from None
        except OSError as e:
            sock.close()
            hint = (" (a stream socket, not the sidecar's SOCK_SEQPACKET one: an older, "
                    "ZMQ-based sidecar, or another program?)"
                    if e.errno == errno.EPROTOTYPE else "")
            raise Unavailable(UNAVAILABLE, f"cannot connect to {self.path}: {e}{hint}"
                              ) from None
        self.assembler = Assembler(MAX_REPLY_BYTES)  # nothing half-received carries over
        return sock

    def closed_error(self, what: str) -> SidecarTimeout:
        """The daemon closed the connection after reading a request it did not
        answer: as after a timeout, whether it was carried out is unknown."""
        return SidecarTimeout(f"the sidecar at {self.path} closed the connection before "
                              f"answering {what} (it stopped or restarted)")

    def timeout_for(self, req: Request) -> float:
        """How long to wait for the reply to ``req``: registration creates (or maps
        and NIXL-registers) every byte of the cache, about 0.9 s per GB here, so
        its wait grows with the layout's size (with a 2x margin for a loaded
        machine); everything else is one short round trip. (``type(req) is``, not
        ``isinstance``: a miss of ``isinstance`` on a msgspec Struct walks the
        metaclass's ``__instancecheck__``, ~2 µs on a cold cache.)"""
        if type(req) is Register:
            nbytes = req.layout.num_regions * req.layout.region_bytes
            return self.timeout_s + REGISTER_S_PER_GB * nbytes / 1e9
        if type(req) is Poll:
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


class _Done:
    """A call's result, carried out of an executor (StopIteration cannot be)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _step(call: Call[T], outcome: Reply | SidecarError | None) -> Request | _Done:
    """:func:`_advance`, with the result as a :class:`_Done` instead of StopIteration."""
    try:
        return _advance(call, outcome)
    except StopIteration as stop:
        return _Done(stop.value)


# --------------------------------------------------------------------------
# Blocking face
# --------------------------------------------------------------------------


class SidecarClient:
    """Blocking client; one call in flight at a time, not thread-safe: use one per
    thread.

    Each call is one blocking send and one blocking receive on the client's
    own socket, bounded by ``SO_SNDTIMEO``/``SO_RCVTIMEO`` (set only when the
    timeout changes), in the calling thread: no I/O thread, no poller.
    After a timeout the socket is replaced, so a reply that arrives late
    cannot be taken for the next call's.
    """

    def __init__(self, socket_path: str, timeout_s: float = 10.0) -> None:
        self._core = ClientCore(socket_path, timeout_s)
        self._sock: socket.socket | None = None
        self._timeo = -1.0  # SO_RCVTIMEO/SO_SNDTIMEO as last set on _sock
        self._forks = 0  # _forks when _sock was opened

    @property
    def timeout_s(self) -> float:
        return self._core.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._core.timeout_s = value

    def register(self, engine_id: str, tp_rank: int, layout: Layout, *,
                 regions: Sequence[Region] | None = None, allocate: bool = False,
                 keep_on_exit: bool = False, memory: MemoryKind = "memfd") -> Registration:
        """``memory`` (allocate mode): what the sidecar allocates, ``shm``/``memfd``
        host memory or ``cuda_malloc``/``cuda_vmm`` on its GPU."""
        return self._run(self._core.register(engine_id, tp_rank, layout, regions, allocate,
                                             keep_on_exit, memory))

    def deregister(self, engine_id: str, mode: DrainMode = "drop") -> None:
        """Forget the engine. ``mode="drain"``: its open holds are still served
        (memory kept) until they end, then freed; ``"drop"``: ended and freed now
        (see :class:`~kvsidecar.ipc.protocol.Deregister`)."""
        req, kind = self._core.deregister(engine_id, mode)
        _expect(self._exchange(req), kind)

    def reserve(self, engine_id: str, nbytes: int, memory: MemoryKind = "memfd") -> Region:
        """Have the sidecar allocate one region of ``nbytes`` for ``engine_id`` and
        map it here; register ``RegionView``s into it later (attach mode). For
        engines that learn their layout from their own allocation (vLLM: see
        :mod:`kvsidecar.ipc.kv_pool`). ``deregister(engine_id)`` drops it."""
        return self._run(self._core.reserve(engine_id, nbytes, memory))

    def read(self, engine_id: str, request_id: str, local_block_ids: BlockIdsLike,
             remote: RemoteEngine, remote_block_ids: BlockIdsLike, *,
             remote_request_id: str | None = None, skip_tokens: int | None = None,
             num_tokens: int | None = None, verify: bool = False,
             remote_tokens: Sequence[str] = ()) -> None:
        """Ask the sidecar to pull ``remote_block_ids`` of ``remote`` into local blocks.

        ``remote_tokens``: the token each remote rank's ``hold`` issued
        (``Held.token``; vLLM: ``kv_transfer_params["remote_tokens"]``), one per
        remote rank in rank order. Required: a hold is a capability, and a read
        without its tokens (or with a token for other blocks, another request
        or engine, or expired) moves no byte and fails naming what is wrong.

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
        ``verify``: prove the bytes (as ``--verify-bytes`` does for every read):
        P's sidecar digests exactly what this read's plan takes from it, this
        sidecar what landed, and a difference makes the read ``failed`` (its
        blocks invalid), never ``received``. Host memory only (refused here
        for GPU memory). A sidecar of protocol minor < 7 would ignore it, so a
        verified read asks the sidecar's minor first (one ping) and raises
        :class:`Unavailable` there, sending nothing.
        """
        if verify:
            _can_verify(self.ping().minor)
        req, kind = self._core.read(engine_id, request_id, local_block_ids, remote,
                                    remote_block_ids, remote_request_id, skip_tokens, num_tokens,
                                    verify, remote_tokens)
        _expect(self._exchange(req), kind)

    def hold(self, engine_id: str, request_id: str, block_ids: BlockIdsLike, *,
             readers: int = 1, timeout_s: float | None = None) -> Held:
        """Keep blocks for readers; the reply's lease and ``token`` travel to them with
        the request (a reader presents the token: nothing moves without it)."""
        req, kind = self._core.hold(engine_id, request_id, block_ids, readers, timeout_s)
        return _expect(self._exchange(req), kind)

    def release(self, engine_id: str, request_id: str) -> None:
        req, kind = self._core.release(engine_id, request_id)
        _expect(self._exchange(req), kind)

    def read_many(self, engine_id: str, specs: Sequence[ReadSpec]
                  ) -> list[SidecarError | None]:
        """Start several reads in one message (protocol minor 5): what a
        scheduler step starts at once costs one round trip. Returns, per read
        and in order, None (accepted: its completion comes through poll) or
        the error it was refused with; the others are unaffected. With a verified
        read among them, as :meth:`read`: Unavailable from a sidecar that would
        ignore ``verify``, and nothing sent."""
        if any(s.verify for s in specs):
            _can_verify(self.ping().minor)
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
        core = self._core
        req, kind = core.poll(engine_id, wait_s)
        return core.polled(engine_id, _expect(self._exchange(req), kind))

    def keep(self, engine_id: str, items: Sequence[KeepItem]) -> None:
        """Keep P's holds of requests this engine admitted and reads later
        (protocol minor 10; see :class:`~kvsidecar.ipc.protocol.Keep`)."""
        req, kind = self._core.keep(engine_id, items)
        _expect(self._exchange(req), kind)

    def ping(self, engines: Sequence[str] = ()) -> Pong:
        """Version and this uid's registered engines; ``engines`` (protocol minor
        6) also renews their liveness lease (see :mod:`kvsidecar.ipc.keepalive`)."""
        req, kind = self._core.ping(engines)
        return _expect(self._exchange(req), kind)

    def status(self) -> StatusReport:
        """The sidecar's state for operators (``kvsidecar status``; protocol minor 6)."""
        req, kind = self._core.status()
        return _expect(self._exchange(req), kind)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
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

    def _connect(self, req: Request, timeout_s: float, deadline: float) -> socket.socket:
        """A connection to the daemon, waiting (until ``deadline``) for one to listen."""
        pause, most = _CONNECT_PAUSE_S
        while True:
            try:
                sock = self._core.new_connection()
            except _NOT_YET:
                if time.monotonic() + pause >= deadline:
                    raise self._core.timeout_error(req, timeout_s) from None
                time.sleep(pause)
                pause = min(2 * pause, most)
                continue
            sock.setblocking(True)
            self._sock, self._timeo, self._forks = sock, -1.0, _forks
            return sock

    def _exchange(self, req: Request) -> Reply:
        """Send ``req`` and return its reply (or raise what the transport means).

        The common case, and all of it in this frame: an open socket with this
        timeout set, one packet out, one packet back that decodes and carries
        this request's id. Anything else (no connection yet, a forked child,
        another timeout, a long request or reply, an error from either system
        call, a stale or undecodable reply) goes to :meth:`_exchange_slow`
        with what happened so far, and is handled there as it always was."""
        core = self._core
        data = encode_request(req)
        started = time.monotonic()
        sock = self._sock
        if (sock is None or self._forks != _forks or self._timeo != core.timeout_s
                or len(data) > MAX_PACKET
                or (type(req) in _WAIT_LONGER and core.timeout_for(req) != self._timeo)):
            return self._exchange_slow(req, data, started)
        try:
            sock.send(data, _NOSIGNAL)
        except OSError as e:
            return self._exchange_slow(req, data, started, e)
        try:
            n = sock.recv_into(core.buf, 0, _TRUNC)
        except OSError as e:
            return self._exchange_slow(req, data, started, received=e)
        if 0 < n <= MAX_PACKET and not core.assembler.announced:
            try:
                reply = decode_reply_unchecked(core.view[:n])
            except Exception:  # undecodable: _receive says what is wrong
                pass
            else:
                if reply.id == req.id:
                    return reply
        return self._exchange_slow(req, data, started, received=n)

    def _exchange_slow(self, req: Request, data: bytes, started: float,
                       sent: OSError | None = None,
                       received: int | OSError | None = None) -> Reply:
        """:meth:`_exchange` for every case, from the start or from where it left
        off: its send raised ``sent``, or its receive returned or raised
        ``received`` (the request is on its way: it is not sent again)."""
        core = self._core
        timeout_s = core.timeout_for(req)
        deadline = started + timeout_s
        resends = 0
        while True:
            sock = self._sock
            if sock is None or self._forks != _forks:
                sock = self._reconnect(req, timeout_s, deadline, resends)
            if timeout_s != self._timeo:
                self._set_timeout(sock, timeout_s)
            try:
                if received is not None:
                    pass  # sent by _exchange, on this socket
                elif sent is not None:
                    e, sent = sent, None
                    raise e
                elif len(data) <= MAX_PACKET:
                    sock.send(data, _NOSIGNAL)
                else:
                    for packet in packets(data):
                        sock.send(packet, _NOSIGNAL)
            except BlockingIOError:  # SO_SNDTIMEO: the daemon reads nothing
                self.close()
                raise core.timeout_error(req, timeout_s) from None
            except OSError:
                # The daemon closed this connection (it restarted, or refused this
                # process): what it said first is still queued; else the request never
                # reached it, so it goes again on a new connection.
                got = self._leftover(sock)
                if got is None:
                    self.close()
                    if time.monotonic() >= deadline:
                        raise core.timeout_error(req, timeout_s) from None
                    resends += 1
                    continue
                reply = self._settle(req, *got)
            else:
                first, received = received, None
                reply = self._receive(sock, req, timeout_s, deadline, first)
            if reply is not None:
                return reply
            if time.monotonic() >= deadline:
                raise core.timeout_error(req, timeout_s)
            resends += 1

    def _reconnect(self, req: Request, timeout_s: float, deadline: float,
                   resends: int) -> socket.socket:
        """A new connection: the first, or after the daemon closed one (``resends``
        times for this call), or a forked child's own."""
        if self._sock is not None:
            self.close()  # a forked child: the connection is its parent's (closed here only)
        if resends:  # a daemon that keeps closing on us is not hammered
            time.sleep(min(_CONNECT_PAUSE_S[1], _CONNECT_PAUSE_S[0] * resends))
        return self._connect(req, timeout_s, deadline)

    def _set_timeout(self, sock: socket.socket, timeout_s: float) -> None:
        # A zero timeval means "block forever": the shortest wait is 1 µs.
        usec = max(1, int(timeout_s * 1e6))
        tv = _timeval.pack(usec // 1_000_000, usec % 1_000_000)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self._timeo = timeout_s

    def _receive(self, sock: socket.socket, req: Request, timeout_s: float,
                 deadline: float, first: int | OSError | None = None) -> Reply | None:
        """The reply to ``req``; None when it must be sent again (the daemon closed
        the connection with it unread). ``first``: what the receive :meth:`_exchange`
        made already returned (a packet's length) or raised."""
        core = self._core
        while True:
            try:
                if first is None:
                    n = sock.recv_into(core.buf, 0, socket.MSG_TRUNC)
                elif isinstance(first, OSError):
                    e, first = first, None
                    raise e
                else:
                    n, first = first, None
            except BlockingIOError:  # SO_RCVTIMEO
                self.close()  # a fresh socket next time: a late reply dies with this one
                raise core.timeout_error(req, timeout_s) from None
            except ConnectionResetError:
                # Closed with data of ours unread (one call in flight: this request),
                # maybe after a refusal it queued for us.
                got = self._leftover(sock)
                if got is None:
                    self.close()
                    return None
            else:
                if n == 0 and peer_closed(sock):
                    self.close()
                    raise core.closed_error(type(req).__name__)
                got = core.received(n)
                if got is None:
                    continue  # a chunk of a long reply
            reply = self._settle(req, *got)
            if reply is not None:
                return reply
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close()
                raise core.timeout_error(req, timeout_s)
            self._set_timeout(sock, remaining)

    def _settle(self, req: Request, id: int, outcome: Reply | SidecarError) -> Reply | None:
        """``outcome`` if it answers ``req`` (raised if an error), else None (stale)."""
        # With one call in flight, an error without an id (the daemon could not
        # read ours, or refused the connection) is still this call's.
        if id == req.id or (id == -1 and isinstance(outcome, (Error, SidecarError))):
            if isinstance(outcome, SidecarError):
                raise outcome
            return outcome
        log.debug("dropping a stale reply with id %d", id)
        return None

    def _leftover(self, sock: socket.socket) -> tuple[int, Reply | SidecarError] | None:
        """A message still queued on a connection the daemon closed (a SEQPACKET
        socket reports the reset once, before what is queued)."""
        for _ in range(2):
            try:
                n = sock.recv_into(self._core.buf, 0, socket.MSG_DONTWAIT | socket.MSG_TRUNC)
            except ConnectionResetError:
                continue
            except OSError:
                return None
            if n == 0:
                return None
            return self._core.received(n)
        return None


# --------------------------------------------------------------------------
# asyncio face
# --------------------------------------------------------------------------


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
        _expect(await self._exchange(req), kind)

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
            _can_verify((await self.ping()).minor)
        req, kind = self._core.read(engine_id, request_id, local_block_ids, remote,
                                    remote_block_ids, remote_request_id, skip_tokens, num_tokens,
                                    verify, remote_tokens)
        _expect(await self._exchange(req), kind)

    async def hold(self, engine_id: str, request_id: str, block_ids: BlockIdsLike, *,
                   readers: int = 1, timeout_s: float | None = None) -> Held:
        req, kind = self._core.hold(engine_id, request_id, block_ids, readers, timeout_s)
        return _expect(await self._exchange(req), kind)

    async def release(self, engine_id: str, request_id: str) -> None:
        req, kind = self._core.release(engine_id, request_id)
        _expect(await self._exchange(req), kind)

    async def read_many(self, engine_id: str, specs: Sequence[ReadSpec]
                        ) -> list[SidecarError | None]:
        """As :meth:`SidecarClient.read_many`."""
        if any(s.verify for s in specs):
            _can_verify((await self.ping()).minor)
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
            return core.polled(engine_id, _expect(await self._exchange(req), kind))

    async def ping(self, engines: Sequence[str] = ()) -> Pong:
        """As :meth:`SidecarClient.ping`."""
        req, kind = self._core.ping(engines)
        return _expect(await self._exchange(req), kind)

    async def status(self) -> StatusReport:
        """The sidecar's state for operators (``kvsidecar status``; protocol minor 6)."""
        req, kind = self._core.status()
        return _expect(await self._exchange(req), kind)

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
                if type(outcome) in _MAPS_MEMORY:
                    # The next step maps the regions, fetching their fds from the
                    # sidecar's fd socket: off this loop (it may be the sidecar's own).
                    step = await asyncio.get_running_loop().run_in_executor(
                        None, _step, call, outcome)
                    if isinstance(step, _Done):
                        return step.value  # type: ignore[no-any-return]
                    req = step
                else:
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

    async def _exchange(self, req: Request) -> Reply:
        loop = asyncio.get_running_loop()
        core = self._core
        data = encode_request(req)
        timeout_s = core.timeout_for(req)
        fut: asyncio.Future[Reply] = loop.create_future()
        timer = loop.call_later(timeout_s, _expire, fut, core, req, timeout_s)
        conn: _AsyncConnection | None = None
        resends = 0
        try:
            while not fut.done():
                if resends:  # a daemon that keeps closing on us is not hammered
                    await asyncio.sleep(min(_CONNECT_PAUSE_S[1], _CONNECT_PAUSE_S[0] * resends))
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
        pause, most = _CONNECT_PAUSE_S
        while self._conn is None:
            try:
                sock = self._core.new_connection()
            except _NOT_YET:
                await asyncio.sleep(pause)
                if fut.done():
                    return None
                pause = min(2 * pause, most)
                continue
            if self._conn is None:
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
