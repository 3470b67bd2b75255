"""The engine client's protocol, without I/O: one core both clients run.

Every call is written once, here, and both faces (:class:`~.client.SidecarClient`,
blocking, and :class:`~.aio_client.AsyncSidecarClient`, asyncio) only move
bytes and wait. A call is either an :data:`Ask` (one request answered by a
reply of one kind) or a :data:`Call` (a generator that yields each request it
needs answered and returns the call's result). :class:`ClientCore` holds what
a client's calls share: request ids, the receive buffer and its framing
state, reply decoding, error mapping, timeouts and each engine's poll
acknowledgements.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import secrets
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias, TypeVar

from .block_ids import BlockIdsLike, block_id_lists
from .errors import BadMessage, SidecarError, SidecarTimeout, Unavailable, error_from_reply, expect
from .layout import Layout
from .mapping import map_refs
from .memory import RegionError
from .posted_requests import PostedRequests
from .protocol import (
    BAD_MESSAGE,
    MAX_BATCH,
    UNAVAILABLE,
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
    decode_request,
    encode_request,
)
from .regions import Region
from .seqpacket import RECV_BYTES, Assembler, Buffer, FramingError, MessageTooLong

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Reply)
T = TypeVar("T")
H = TypeVar("H", Hold, Batch)


#: The protocol minor from which a sidecar honours ``Read.verify``: an older one
#: decodes the field as unknown and reads without verifying.
VERIFY_MINOR: Final = 7


def can_verify(minor: int) -> None:
    """Unavailable unless a sidecar of protocol ``minor`` verifies what it is asked to."""
    if minor < VERIFY_MINOR:
        raise Unavailable(UNAVAILABLE, (
            f"byte verification (verify=True) needs a sidecar of protocol minor "
            f"{VERIFY_MINOR} or later; this one speaks minor {minor} and would read without "
            "verifying: nothing was sent"))


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


#: Replies after which a call maps memory (blocking: fd fetches, mmap).
MAPS_MEMORY: Final = (Registered, Reserved)


def _registration(reply: Registered, regions: Sequence[Region] | None) -> Registration:
    """Map allocate-mode regions (fetching fds from the sidecar's fd socket for
    memfd / CUDA VMM kinds); the caller deregisters if this raises."""
    try:
        mapped: list[Region] = (list(regions) if regions is not None
                                else map_refs(reply.regions, reply.fd_socket))
    except RegionError as e:
        if reply.hold_key:
            raise
        # No hold key: a sidecar of protocol minor 10 or older, which may predate
        # sealed memfds (what this client maps, and nothing else).
        raise RegionError(f"{e}; this sidecar issues no hold key, so it is older than "
                          "this client (protocol minor 10 or older; before sealed memfds "
                          "it sent unsealed ones): that version skew is refused, upgrade "
                          "the sidecar (docs/operations.md, Rolling upgrades)") from e
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
#: The requests :meth:`ClientCore.timeout_for` gives more than the client's
#: timeout (a face asks it only for these: one frame less on other calls).
WAIT_LONGER: Final[frozenset[type]] = frozenset({Register, Poll})
#: A poll of an engine this client has not polled yet acknowledges nothing.
_NO_ACK: Final = ("", 0)
#: How long a parked poll waits at the sidecar. Each one renews the engine's
#: liveness lease (``--engine-lease``, 30 s by default) when it arrives, so an
#: engine that only polls without waiting is not taken for dead while idle.
PARK_S: Final = 1.0


# --------------------------------------------------------------------------
# The core shared by both clients: every call as a generator (sans I/O)
# --------------------------------------------------------------------------

Ask: TypeAlias = tuple[Request, type[R]]
"""A call that is one request, answered by a reply of one kind: the request
and that kind. A face sends the request and hands the reply to
:func:`~.errors.expect` with the kind (and a poll's to :meth:`ClientCore.polled`).
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


def checked(req: Hold | Batch) -> bytes:
    """``req`` encoded, or :class:`BadMessage` for what the sidecar would refuse
    while decoding it (``readers`` < 1, ``timeout_s`` out of range, an id too
    long), raised before anything is sent. A hold refused there, before the
    sidecar knows the engine, is one it cannot record, and an engine that
    issued the hold's token itself relies on the refusal being recorded (a
    reader's claim of the blocks is refused from then on). A batch is checked
    whole, as the sidecar decodes it; the error names the item."""
    data = encode_request(req)
    try:
        decode_request(data)
    except ProtocolError as e:
        if isinstance(req, Hold):
            what = f"hold {req.request_id[:200]!r}"
        else:
            at = _ITEM.search(e.message)
            item = req.requests[int(at.group(1))] if at else None
            what = (f"the batch's hold {item.request_id[:200]!r}"
                    if isinstance(item, Hold) else "a batch")
        raise BadMessage(e.code, f"{what}: {e.message}") from None
    return data


_ITEM: Final = re.compile(r"\$\.requests\[(\d+)\]")


class ClientCore:
    """What both clients share: ids, calls (asks and generators), decoding and
    correlation of replies, error mapping and the per-engine poll
    acknowledgements."""

    def __init__(self, socket_path: str, timeout_s: float) -> None:
        self.path = _socket_path(socket_path)
        self.endpoint = self.path  # what error messages name
        self.timeout_s = timeout_s
        self.acks: dict[str, tuple[str, int]] = {}
        #: by engine: the id of the newest poll whose answer set :attr:`acks`
        self._acked_by: dict[str, int] = {}
        #: reads sent without waiting for their answers (``read_nowait``)
        self.posted = PostedRequests()
        #: the last request checked (:func:`checked`) and its bytes, sent as they are
        self._checked: tuple[Request, bytes] | None = None
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
        reply = expect((yield req), Registered)
        self.posted.forget_polls(engine_id)  # a parked poll's answer is the old one's
        try:
            return _registration(reply, regions)
        except BaseException:
            # The daemon holds a registration this engine cannot use: undo it.
            try:
                undo, kind = self.deregister(engine_id)
                expect((yield undo), kind)
            except SidecarError as e:
                log.warning("could not deregister %s after a failed registration: %s",
                            engine_id, e)
            raise

    def deregister(self, engine_id: str, mode: DrainMode = "drop") -> Ask[Ok]:
        return Deregister(engine_id, mode, id=next(self._ids)), Ok

    def reserve(self, engine_id: str, nbytes: int, memory: MemoryKind) -> Call[Region]:
        reply = expect((yield Reserve(engine_id, nbytes, memory, id=self._next_id())),
                        Reserved)
        (region,) = map_refs([reply.region], reply.fd_socket)
        return region

    def read(self, engine_id: str, request_id: str, local_block_ids: BlockIdsLike,
             remote: RemoteEngine, remote_block_ids: BlockIdsLike,
             remote_request_id: str | None, skip_tokens: int | None,
             num_tokens: int | None, verify: bool = False,
             remote_tokens: Sequence[str] = ()) -> Ask[Ok]:
        return self.read_request(engine_id, request_id, local_block_ids, remote,
                                 remote_block_ids, remote_request_id, skip_tokens, num_tokens,
                                 verify, remote_tokens), Ok

    def read_request(self, engine_id: str, request_id: str, local_block_ids: BlockIdsLike,
                     remote: RemoteEngine, remote_block_ids: BlockIdsLike,
                     remote_request_id: str | None, skip_tokens: int | None,
                     num_tokens: int | None, verify: bool = False,
                     remote_tokens: Sequence[str] = ()) -> Read:
        """The :class:`Read` of :meth:`read` (``read_nowait`` sends it unanswered)."""
        return Read(engine_id, request_id, block_id_lists(local_block_ids), remote,
                    block_id_lists(remote_block_ids), remote_request_id, skip_tokens,
                    num_tokens, verify, list(remote_tokens), id=next(self._ids))

    def hold(self, engine_id: str, request_id: str, block_ids: BlockIdsLike, readers: int,
             timeout_s: float | None) -> Ask[Held]:
        return self.hold_request(engine_id, request_id, block_ids, readers, timeout_s), Held

    def hold_request(self, engine_id: str, request_id: str, block_ids: BlockIdsLike,
                     readers: int, timeout_s: float | None) -> Hold:
        """The :class:`Hold` of :meth:`hold` (``hold_nowait`` sends it unanswered),
        checked (:func:`checked`)."""
        return self._check(Hold(engine_id, request_id, block_id_lists(block_ids), readers,
                                timeout_s, id=next(self._ids)))

    def _check(self, req: H) -> H:
        self._checked = (req, checked(req))
        return req

    def encode(self, req: Request) -> bytes:
        """``req`` on the wire: the bytes its check made (once), else encoded now."""
        done, self._checked = self._checked, None
        if done is not None and done[0] is req:
            return done[1]
        return encode_request(req)

    def release(self, engine_id: str, request_id: str) -> Ask[Ok]:
        return Release(engine_id, request_id, id=next(self._ids)), Ok

    def read_items(self, engine_id: str, specs: Sequence[ReadSpec]) -> list[Read]:
        """The :class:`Read` of each spec, for one batch."""
        return [Read(engine_id, s.request_id, block_id_lists(s.local_block_ids), s.remote,
                     block_id_lists(s.remote_block_ids), s.remote_request_id, s.skip_tokens,
                     s.num_tokens, s.verify, list(s.remote_tokens), id=self._next_id())
                for s in specs]

    def hold_items(self, engine_id: str, specs: Sequence[HoldSpec]) -> list[Hold]:
        """The :class:`Hold` of each spec, for one batch (checked with it:
        :meth:`batch_request`)."""
        return [Hold(engine_id, s.request_id, block_id_lists(s.block_ids), s.readers,
                     s.timeout_s, id=self._next_id())
                for s in specs]

    def read_many(self, engine_id: str, specs: Sequence[ReadSpec]
                  ) -> Call[list[SidecarError | None]]:
        out = yield from self._batch(self.read_items(engine_id, specs))
        return [o if isinstance(o, SidecarError) else None for o in out]

    def hold_many(self, engine_id: str, specs: Sequence[HoldSpec]
                  ) -> Call[list[Held | SidecarError]]:
        out = yield from self._batch(self.hold_items(engine_id, specs))
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

    def _batch(self, reqs: Sequence[Read | Hold | Release]
               ) -> Call[list[Held | SidecarError | None]]:
        """One :class:`Batch` (protocol minor 5; an older sidecar refuses the op
        as a ``bad_message``), answered item by item."""
        if not reqs:
            return []
        out = yield from self.batch_answers(self.batch_request(reqs))
        return out

    def batch_request(self, reqs: Sequence[Read | Hold | Release]) -> Batch:
        """One :class:`Batch` of ``reqs`` (at most MAX_BATCH: ValueError); one of
        holds is checked (:func:`checked`)."""
        if len(reqs) > MAX_BATCH:
            raise ValueError(f"{len(reqs)} requests in one batch; at most {MAX_BATCH}")
        batch = Batch(list(reqs), id=self._next_id())
        return self._check(batch) if reqs and type(reqs[0]) is Hold else batch

    def batch_answers(self, batch: Batch) -> Call[list[Held | SidecarError | None]]:
        """Send ``batch``; each item's outcome, in order."""
        reqs = batch.requests
        reply = expect((yield batch), Replies)
        if len(reply.items) != len(reqs):
            raise BadMessage(BAD_MESSAGE, f"a batch of {len(reqs)} was answered with "
                                          f"{len(reply.items)} replies")
        return [_item_outcome(r) for r in reply.items]

    def poll(self, engine_id: str, wait_s: float = 0.0) -> Ask[Completions]:
        """Completions since the last poll; one that was lost to a timeout comes
        again, because each poll acknowledges only what this client received
        (:meth:`polled`). With ``wait_s`` an empty poll waits that long for one
        (protocol minor 4; an older sidecar answers at once)."""
        return self._poll(engine_id, wait_s), Completions

    def _poll(self, engine_id: str, wait_s: float) -> Poll:
        epoch, ack = self.acks.get(engine_id, _NO_ACK)
        return Poll(engine_id, ack, epoch, wait_s, id=next(self._ids))

    def polled(self, engine_id: str, reply: Completions) -> list[Completion]:
        """A poll's answer: its items not returned before, acknowledged by the
        engine's next poll. (A parked poll's answer and another poll's may
        cover the same completions: a reply holds the sidecar's unacknowledged
        completions, numbered up to its ``last``, so those numbered up to the
        last one returned are dropped here; and an answer to an older poll,
        of another registration than a newer one's, is stale.)"""
        epoch, seen = self.acks.get(engine_id, _NO_ACK)
        newest = self._acked_by.get(engine_id, 0)
        if reply.epoch != epoch or not epoch:  # the first, a new registration's, unnumbered
            if epoch and reply.id < newest:
                return []
            self.acks[engine_id] = (reply.epoch, reply.last)
            self._acked_by[engine_id] = reply.id
            return reply.items
        self.acks[engine_id] = (epoch, max(seen, reply.last))
        self._acked_by[engine_id] = max(newest, reply.id)
        new = reply.last - seen
        if new <= 0:
            return []
        return reply.items[-new:] if new < len(reply.items) else reply.items

    def pushed(self, engine_id: str, now: float) -> list[Completion]:
        """What a poll of ``engine_id`` parked at the sidecar brought (its error
        raised), once; :class:`SidecarTimeout` when, at ``now``, it has gone
        unanswered for :data:`PARK_S` + ``timeout_s`` (the sidecar is stuck: the
        poll is forgotten, a late answer is stale, and the next call parks again)."""
        got = self.posted.take_pushed(engine_id)
        if got is None:
            wait_s = PARK_S + self.timeout_s
            if self.posted.overdue(engine_id, now, wait_s):
                raise SidecarTimeout(f"no answer to a poll parked at {self.endpoint} "
                                     f"within {wait_s:g} s")
            return []
        if isinstance(got, SidecarError):
            raise got
        return self.polled(engine_id, expect(got, Completions))

    def park(self, engine_id: str) -> Poll:
        """A poll to park at the sidecar (``poll_nowait``): answered as soon as
        it has a completion for ``engine_id``, or empty after :data:`PARK_S`."""
        return self._poll(engine_id, PARK_S)

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

    def reset_framing(self) -> None:
        """A new connection: nothing half-received on the last one carries over."""
        self.assembler = Assembler(MAX_REPLY_BYTES)

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


def advance(call: Call[T], outcome: Reply | SidecarError | None) -> Request:
    """Hand ``call`` its reply (or the transport's error) and return the next
    request it needs answered; raises StopIteration carrying the result."""
    if isinstance(outcome, SidecarError):
        return call.throw(outcome)
    return call.send(outcome)  # type: ignore[arg-type]  # None starts the generator


class Done:
    """A call's result, carried out of an executor (StopIteration cannot be)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def step(call: Call[T], outcome: Reply | SidecarError | None) -> Request | Done:
    """:func:`advance`, with the result as a :class:`Done` instead of StopIteration."""
    try:
        return advance(call, outcome)
    except StopIteration as stop:
        return Done(stop.value)

