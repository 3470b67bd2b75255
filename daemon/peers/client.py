"""D side of the handshake: fetch (and cache) a peer rank's info over one DEALER per address.

The same DEALER carries D's control messages (lease claims, renewals,
abandons; see :mod:`~kvsidecar.daemon.peers.control`). Those bound for one
address at about the same time are coalesced into batches by a per-address
:class:`~kvsidecar.daemon.peers.coalesce.Outbox` (no timers: a lone claim
leaves on the loop's next turn), but only to a peer whose handshake info
advertised ``control_batch_items``; to any other peer each goes alone.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec
import zmq
import zmq.asyncio

from kvsidecar.daemon.eager import start_now
from kvsidecar.daemon.peer_auth import PeerKeys
from kvsidecar.daemon.peers import control
from kvsidecar.daemon.peers.addresses import ipv6, normalise, split_address, split_key
from kvsidecar.daemon.peers.coalesce import Outbox
from kvsidecar.daemon.peers.control import (
    BATCH_OVERHEAD_BYTES,
    MAX_BATCH_BYTES,
    MAX_BATCH_ITEMS,
    ControlBatchReply,
    ControlReply,
    ControlRequest,
    Digest,
)
from kvsidecar.daemon.peers.messages import (
    HANDSHAKE_VERSION,
    AnyReply,
    HandshakeError,
    HandshakeFailed,
    HandshakeInfo,
    HandshakeRequest,
    Reader,
    decode_info,
    decode_reply,
    encode,
    salvage,
)
from kvsidecar.ipc.loop_socket import LoopSocket

log = logging.getLogger(__name__)

#: Cached handshake answers (one per peer address, engine, rank and local reader).
MAX_CACHED = 4096
#: Open DEALER sockets, one per peer address; idle ones beyond this are closed.
MAX_CONNECTIONS = 256
#: The most handshakes one local engine may have waiting for answers at once, as
#: a share of ``max_connections`` (at least 8): a read naming thousands of dead
#: addresses fills its own share, never the connections other engines need.
ENGINE_SHARE = 4

#: Replies carry agent metadata and a layout; anything larger drops the connection.
MAX_REPLY_BYTES = 64 << 20

#: An encoded info larger than this is decoded off the event loop: 65,536
#: explicitly named regions and their bases are ~0.5 MB and ~3 ms of decoding
#: (docs/performance.md, "A handshake's checks"); 32 KiB is ~0.2 ms.
OFF_LOOP_INFO_BYTES = 32 << 10

__all__ = ["ControlAnswer", "HandshakeClient"]


def _decode_info(addr: str, raw: msgspec.Raw) -> HandshakeInfo:
    """``raw`` decoded (pure: on a thread for a large one); undecodable raises."""
    try:
        return decode_info(raw)
    except Exception as e:  # DecodeError, UnicodeDecodeError
        raise HandshakeFailed(addr, f"malformed handshake info: {e}") from None


class ControlAnswer(NamedTuple):
    """P's answer to one control item, and when (this side's monotonic clock) the
    message that carried it was sent: a lease granted for ``lease_s`` is valid
    here until ``sent_at + lease_s`` (see :mod:`~kvsidecar.daemon.leases`)."""

    reply: ControlReply
    sent_at: float


@dataclass(eq=False)
class _Item:
    """One control request waiting in an outbox: encoded once, with its own req_id
    (which the peer echoes whether it travels alone or in a batch)."""

    what: str
    req_id: int
    frame: bytes
    future: asyncio.Future[ControlAnswer]
    owner: str = ""

    def settle(self, answer: ControlAnswer | HandshakeFailed) -> None:
        if self.future.done():  # its caller gave up (cancelled) meanwhile
            return
        if isinstance(answer, HandshakeFailed):
            self.future.set_exception(answer)
        else:
            self.future.set_result(answer)


_Key = tuple[str, str, int, Reader | None]  # (address, engine_id, tp_rank, declared reader)


@dataclass(eq=False)
class _Connection:
    """One DEALER to one peer address, shared by every request to it.

    A connection, not a :class:`~kvsidecar.daemon.peers.links.Peer` (a linked remote rank).
    """

    address: str
    sock: LoopSocket
    pending: dict[int, asyncio.Future[AnyReply]] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None
    #: the local engine it was opened for ('' for none)
    owner: str = ""
    #: the peer has answered on it (then it counts in nobody's share)
    answered: bool = False


class HandshakeClient:
    """Fetches (and caches) peers' :class:`HandshakeInfo`.

    Concurrent fetches of one (address, engine, rank) share one request so a
    burst of requests for a new P engine costs it one handshake. Successes are
    cached until :meth:`forget`; failures are not, so a retry really retries.

    Shared fairly: a connection is opened for one local engine (the reader a
    handshake declares, the reader of a claim or abandon), and each engine may
    have at most :attr:`engine_share` connections that never answered and have
    requests waiting; opening one more for it fails at once
    (``on_evict("engine_share")``), so a read naming thousands of dead
    addresses uses its own share, never the connections other engines need. A
    fetch whose every caller gave up (cancelled: its read failed) is
    cancelled, and its connection becomes idle, so evictable.
    """

    def __init__(self, timeout_s: float = 5.0, *, ctx: zmq.asyncio.Context | None = None,
                 max_cached: int = MAX_CACHED, max_connections: int = MAX_CONNECTIONS,
                 on_evict: Callable[[str], None] | None = None,
                 keys: PeerKeys | None = None,
                 on_control_sent: Callable[[int], None] | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_cached < 1 or max_connections < 1:
            raise ValueError("max_cached and max_connections must be >= 1")
        #: Bounds on what peers' answers can make this client hold. Past them the
        #: least recently used entry goes (a cached answer is fetched again when next
        #: needed; an idle connection is reopened), and ``on_evict("handshake" |
        #: "connection")`` is told, for a metric.
        self.max_cached = max_cached
        self.max_connections = max_connections
        self.engine_share = max(8, max_connections // ENGINE_SHARE)
        #: callers awaiting each fetch in flight
        self._waiters: dict[_Key, int] = {}
        self._on_evict = on_evict
        #: told the number of items of every control message sent (a metric)
        self._on_control_sent = on_control_sent
        self.timeout_s = timeout_s
        self._keys = keys
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self._conns: OrderedDict[str, _Connection] = OrderedDict()
        self._cache: OrderedDict[_Key, HandshakeInfo] = OrderedDict()
        self._inflight: dict[_Key, asyncio.Task[HandshakeInfo]] = {}
        self._ids = itertools.count(1)
        self._closed = False
        #: per address: the most control items its sidecar takes in one batch, as
        #: its last handshake info said (absent or < 2: single messages only)
        self._batching: OrderedDict[str, int] = OrderedDict()
        self._outboxes: dict[str, Outbox[_Item]] = {}
        self._flushes: set[asyncio.Future[None]] = set()

    async def fetch(self, address: str, engine_id: str, tp_rank: int,
                    reader: Reader | None = None) -> HandshakeInfo:
        """The info of ``engine_id`` rank ``tp_rank`` served at ``address`` (``host:port``).

        Raises :class:`HandshakeFailed`; never waits longer than ``timeout_s``
        for the request it sends.
        """
        addr = normalise(address)
        if self._closed:
            raise HandshakeFailed(addr, "handshake client is closed")
        key = (addr, engine_id, tp_rank, reader)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
        if hit is not None:
            return hit
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.create_task(self._fetch_once(key), name=f"handshake-{key}")
            self._inflight[key] = task
            task.add_done_callback(lambda t: self._request_done(key, t))
        # Shielded: a caller that gives up must not cancel the request others await;
        # when the last one gives up, nobody needs it (see _give_up).
        self._waiters[key] = self._waiters.get(key, 0) + 1
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._give_up(key, task)
            raise
        finally:
            left = self._waiters.get(key, 1) - 1
            if left > 0:
                self._waiters[key] = left
            else:
                self._waiters.pop(key, None)

    def _give_up(self, key: _Key, task: asyncio.Task[HandshakeInfo]) -> None:
        """A caller of ``task`` was cancelled: if it was the last one waiting, cancel
        the fetch (its pending reply is dropped, so its connection is idle)."""
        if self._waiters.get(key, 0) <= 1 and not task.done():
            task.cancel()

    def forget(self, address: str, engine_id: str | None = None) -> None:
        """Drop what is cached for ``address`` (one engine, or all), e.g. after the
        peer's ``daemon_id`` changed. A request already in flight still answers
        its callers but no longer fills the cache."""
        addr = normalise(address)

        def match(k: _Key) -> bool:
            return k[0] == addr and (engine_id is None or k[1] == engine_id)

        for k in [k for k in self._cache if match(k)]:
            del self._cache[k]
        for k in [k for k in self._inflight if match(k)]:
            del self._inflight[k]

    async def close(self) -> None:
        """Fail whatever is in flight and release every socket."""
        if self._closed:
            return
        self._closed = True
        tasks = list(self._inflight.values())
        self._inflight.clear()
        # Failing the pending replies ends the requests with HandshakeFailed, which
        # is what their callers expect; cancelling would look like their own cancel.
        for addr in list(self._conns):
            self._drop_conn(addr, HandshakeFailed(addr, "handshake client closed"))
        for flush in list(self._flushes):
            flush.cancel()
        await asyncio.gather(*self._flushes, return_exceptions=True)
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=self.timeout_s)
            for t in stuck:
                t.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        self._cache.clear()
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    def _evicted(self, what: str) -> None:
        if self._on_evict is not None:
            self._on_evict(what)

    def _request_done(self, key: _Key, task: asyncio.Task[HandshakeInfo]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved here so an unawaited failure is not logged as lost

    async def _fetch_once(self, key: _Key) -> HandshakeInfo:
        addr, engine_id, tp_rank, reader = key
        try:
            reply = await asyncio.wait_for(
                self._roundtrip(addr, engine_id, tp_rank, reader), timeout=self.timeout_s
            )
        except asyncio.TimeoutError:
            err = HandshakeFailed(addr, f"no answer from {addr} within {self.timeout_s} s")
            # A dead or wedged peer: start the next attempt on a fresh socket and
            # fail the requests queued behind this one instead of letting them wait.
            self._drop_conn(addr, err)
            raise err from None
        raw = self._raw_info(addr, reply)
        if len(raw) > OFF_LOOP_INFO_BYTES:  # a large layout: decoded on a thread
            info = await asyncio.get_running_loop().run_in_executor(None, _decode_info,
                                                                    addr, raw)
        else:
            info = _decode_info(addr, raw)
        self._check_info(addr, engine_id, tp_rank, info)
        if self._inflight.get(key) is asyncio.current_task():  # not forgotten meanwhile
            self._cache[key] = info
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
                self._evicted("handshake")
        return info

    async def control(self, address: str, msg: ControlRequest | Digest) -> ControlAnswer:
        """One control request (claim, abandon) to the sidecar at ``address``.

        Requests to one address that meet in its outbox travel as one batch when
        that sidecar advertised batches; each still gets its own answer.
        Raises :class:`HandshakeFailed` when no valid reply comes: within
        ``timeout_s`` of its message's send (the connection is then replaced, as
        for a handshake), after at most ``timeout_s`` waiting behind earlier
        messages to the same address. A :class:`Digest` always travels alone.
        """
        addr, what, req_id, frame = self._encode_control(address, msg)
        if self._batching.get(addr, 0) < 2 or type(msg) is Digest:
            return await self._control_one(addr, what, req_id, frame, msg.reader_engine)
        return await self._enqueue(addr, what, req_id, frame, msg.reader_engine)

    def control_soon(self, address: str, msg: ControlRequest, *,
                     now: bool = False) -> asyncio.Future[ControlAnswer]:
        """:meth:`control` started now: queued (or, to a peer that takes no
        batches, under way) when this returns; the future resolves as
        :meth:`control` would return or raise. Why: a read issues its claim
        before it hands its planning to the planning thread, so the claim's
        message is the first thing of the next loop iteration, ahead of the
        planning job and its thread's wake-up.

        ``now``: sent before this returns (the send run on the spot,
        :func:`~kvsidecar.daemon.eager.start_now`) when nothing to that peer
        is in flight or queued; otherwise it waits in the outbox and goes
        with the next batch, exactly as without ``now``."""
        try:
            addr, what, req_id, frame = self._encode_control(address, msg)
        except HandshakeFailed as e:
            failed: asyncio.Future[ControlAnswer] = asyncio.get_running_loop().create_future()
            failed.set_exception(e)
            return failed
        if self._batching.get(addr, 0) < 2:
            one = self._control_one(addr, what, req_id, frame, msg.reader_engine)
            return start_now(one) if now else asyncio.ensure_future(one)
        return self._enqueue(addr, what, req_id, frame, msg.reader_engine, now=now)

    def _encode_control(self, address: str, msg: ControlRequest | Digest
                        ) -> tuple[str, str, int, bytes]:
        """(address, what, req_id, frame) of one control request."""
        addr = normalise(address)
        if self._closed:
            raise HandshakeFailed(addr, "handshake client is closed")
        req_id = next(self._ids)
        frame = control.encode(msgspec.structs.replace(msg, req_id=req_id))
        return addr, type(msg).__name__.lower(), req_id, frame

    def _enqueue(self, addr: str, what: str, req_id: int, frame: bytes,
                 owner: str = "", *, now: bool = False) -> asyncio.Future[ControlAnswer]:
        """Put one item in ``addr``'s outbox (starting its flush if none runs;
        ``now``: its first send on the spot)."""
        box = self._outboxes.get(addr)
        if box is None:
            limit = self._batching.get(addr, 0)
            box = self._outboxes[addr] = Outbox(min(limit, MAX_BATCH_ITEMS), MAX_BATCH_BYTES,
                                                BATCH_OVERHEAD_BYTES)
        item = _Item(what, req_id, frame, asyncio.get_running_loop().create_future(), owner)
        if box.add(item, len(frame), time.monotonic()):
            flush = (start_now(self._flush(addr, box)) if now else
                     asyncio.create_task(self._flush(addr, box), name=f"control-flush-{addr}"))
            self._flushes.add(flush)
            flush.add_done_callback(self._flushes.discard)
        return item.future

    async def _control_one(self, addr: str, what: str, req_id: int,
                           frame: bytes, owner: str = "") -> ControlAnswer:
        """Send one control request alone and wait for its reply."""
        if self._on_control_sent is not None:
            self._on_control_sent(1)
        sent_at = time.monotonic()
        reply = await self._send_timed(addr, req_id, frame, what, owner)
        if isinstance(reply, HandshakeError):
            raise HandshakeFailed(addr, f"peer rejected the {what} ({reply.code}): "
                                        f"{reply.message}")
        if not isinstance(reply, ControlReply):
            raise HandshakeFailed(addr, f"peer answered a {what} with a "
                                        f"{type(reply).__name__}")
        return ControlAnswer(reply, sent_at)

    async def _flush(self, addr: str, box: Outbox[_Item]) -> None:
        """Send what ``box`` holds, one message at a time, until it is empty."""
        live: list[_Item] = []
        try:
            while True:
                taken = box.take(time.monotonic(), self.timeout_s)
                for item in taken.expired:
                    item.settle(HandshakeFailed(
                        addr, f"no answer to {item.what} from {addr}: it waited "
                              f"{self.timeout_s} s behind earlier control messages"))
                if not taken.items:
                    return
                live = [item for item in taken.items if not item.future.done()]
                if live:
                    await self._send_items(addr, live)
                live = []
        finally:
            # Cancelled (the client is closing) or a bug: nobody may wait forever.
            err = HandshakeFailed(addr, "handshake client closed")
            for item in live:
                item.settle(err)
            if not box.idle:
                while box.waiting:
                    box.waiting.popleft().item.settle(err)
                box.busy = False
            if self._outboxes.get(addr) is box:
                del self._outboxes[addr]

    async def _send_items(self, addr: str, items: list[_Item]) -> None:
        """Send ``items`` as one message (a batch if more than one) and settle each."""
        if len(items) > 1 and self._batching.get(addr, 0) < 2:  # no longer batching
            await asyncio.gather(*(self._send_items(addr, [item]) for item in items))
            return
        if len(items) == 1:
            (item,) = items
            try:
                item.settle(await self._control_one(addr, item.what, item.req_id, item.frame,
                                                    item.owner))
            except HandshakeFailed as e:
                item.settle(e)
            return
        req_id = next(self._ids)
        frame = control.encode_batch([item.frame for item in items], req_id)
        if self._on_control_sent is not None:
            self._on_control_sent(len(items))
        sent_at = time.monotonic()
        try:
            reply = await self._send_timed(addr, req_id, frame,
                                           f"a batch of {len(items)} control messages")
        except HandshakeFailed as e:
            for item in items:
                item.settle(e)
            return
        if isinstance(reply, ControlBatchReply) and len(reply.replies) == len(items):
            for item, one in zip(items, reply.replies):
                item.settle(ControlAnswer(one, sent_at))
        elif isinstance(reply, ControlReply):
            # The peer did not take the batch (an older sidecar took the address
            # since its last handshake): single messages from now on, these too.
            log.warning("peer %s answered a control batch with a single reply (%s): "
                        "sending it single control messages", addr, reply.reason[:200])
            self._batching.pop(addr, None)
            await self._send_items(addr, items)
        else:
            got = (f"{len(reply.replies)} answers" if isinstance(reply, ControlBatchReply)
                   else f"a {type(reply).__name__}")
            err = HandshakeFailed(addr, f"peer answered a batch of {len(items)} control "
                                        f"messages with {got}")
            for item in items:
                item.settle(err)

    async def _roundtrip(self, addr: str, engine_id: str, tp_rank: int,
                         reader: Reader | None) -> AnyReply:
        req_id = next(self._ids)
        if reader is None:
            req = HandshakeRequest(engine_id, tp_rank, HANDSHAKE_VERSION, req_id)
        else:
            req = HandshakeRequest(engine_id, tp_rank, HANDSHAKE_VERSION, req_id,
                                   reader.engine_id, reader.tp_rank, reader.agent)
        return await self._send(addr, req_id, encode(req),
                                reader.engine_id if reader is not None else "")

    async def _send_timed(self, addr: str, req_id: int, frame: bytes, what: str,
                          owner: str = "") -> AnyReply:
        """:meth:`_send` within ``timeout_s``; no answer in time drops the
        connection (the next request gets a fresh one) and raises HandshakeFailed.

        A timer rather than ``asyncio.wait_for``, which (Python 3.11) runs the
        send as a task of its own: one more loop iteration each way of every
        lease claim, the largest part of a small read's latency."""
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.timeout_s, self._send_timed_out, addr, req_id, what)
        try:
            return await self._send(addr, req_id, frame, owner)
        finally:
            timer.cancel()

    def _send_timed_out(self, addr: str, req_id: int, what: str) -> None:
        """No answer to ``req_id`` in time: fail it (and what else waits on that
        connection) and drop the connection."""
        conn = self._conns.get(addr)
        if conn is None or req_id not in conn.pending:
            return
        self._drop_conn(addr, HandshakeFailed(addr, f"no answer to {what} from {addr} within "
                                                    f"{self.timeout_s} s"))

    async def _send(self, addr: str, req_id: int, msg: bytes, owner: str = "") -> AnyReply:
        if self._closed:
            raise HandshakeFailed(addr, "handshake client closed")
        conn = self._conn(addr, owner)
        fut: asyncio.Future[AnyReply] = asyncio.get_running_loop().create_future()
        conn.pending[req_id] = fut
        try:
            try:
                await conn.sock.send(msg)
            except zmq.ZMQError as e:
                if fut.done() and not fut.cancelled():  # timed out while parked: say so
                    fut.result()
                raise HandshakeFailed(addr, f"cannot send the request: {e}") from None
            return await fut
        finally:
            conn.pending.pop(req_id, None)

    def _raw_info(self, addr: str, reply: AnyReply) -> msgspec.Raw:
        """The encoded info of a handshake reply; an error reply, a control reply
        or another protocol version raises :class:`HandshakeFailed`."""
        if isinstance(reply, (ControlReply, ControlBatchReply)):
            raise HandshakeFailed(addr, "peer answered a handshake with a control reply")
        if isinstance(reply, HandshakeError):
            if reply.code == "version":
                raise HandshakeFailed(addr, f"protocol version mismatch: {reply.message}",
                                      field="protocol")
            if reply.code == "unknown_engine":
                raise HandshakeFailed(addr, reply.message, field="engine_id")
            raise HandshakeFailed(addr, f"peer rejected the request ({reply.code}): "
                                        f"{reply.message}")
        if reply.v != HANDSHAKE_VERSION:
            raise HandshakeFailed(
                addr,
                f"protocol version mismatch: peer speaks v{reply.v}, we speak v{HANDSHAKE_VERSION}",
                field="protocol",
            )
        return reply.info

    def _check_info(self, addr: str, engine_id: str, tp_rank: int, info: HandshakeInfo) -> None:
        """``info`` answers what was asked, in our protocol version."""
        if info.protocol != HANDSHAKE_VERSION:
            raise HandshakeFailed(
                addr,
                f"protocol version mismatch: peer info is v{info.protocol}, "
                f"we speak v{HANDSHAKE_VERSION}",
                field="protocol",
            )
        if info.engine_id != engine_id or info.tp_rank != tp_rank:
            raise HandshakeFailed(
                addr,
                f"engine id mismatch: asked for {engine_id!r} rank {tp_rank}, "
                f"peer answered {info.engine_id!r} rank {info.tp_rank}",
                field="engine_id",
            )
        self._note_batching(addr, info.control_batch_items)

    def _note_batching(self, addr: str, items: int) -> None:
        """Remember what ``addr``'s sidecar advertised (bounded like the cache)."""
        if items >= 2:
            self._batching[addr] = items
            self._batching.move_to_end(addr)
            while len(self._batching) > self.max_cached:
                self._batching.popitem(last=False)
        else:
            self._batching.pop(addr, None)

    def _unanswered(self, owner: str) -> int:
        """Connections opened for ``owner`` that never answered and have requests waiting."""
        return sum(1 for c in self._conns.values()
                   if c.owner == owner and not c.answered and c.pending)

    def _conn(self, addr: str, owner: str = "") -> _Connection:
        conn = self._conns.get(addr)
        if conn is not None:
            self._conns.move_to_end(addr)
        if conn is not None:
            return conn
        try:
            host, _ = split_address(addr)
            plain, server = split_key(addr)
        except ValueError as e:
            raise HandshakeFailed(addr[:300], f"cannot dial it: {e}") from None
        if owner and self._unanswered(owner) >= self.engine_share:
            self._evicted("engine_share")
            raise HandshakeFailed(addr, f"engine {owner[:200]!r} already has "
                                        f"{self.engine_share} peer connections waiting for "
                                        "a first answer, its share of this sidecar's; try "
                                        "again once they are answered or time out")
        if server is not None:
            server = zmq.utils.z85.encode(server)
        if server is not None and self._keys is not None and server not in self._keys.admitted():
            raise HandshakeFailed(addr[:300], "its CURVE key is no admitted fleet member's "
                                              "(not in the authorized keys): not dialled")
        if len(self._conns) >= self.max_connections:
            # Room first: idle connections go, least recently used first. Those
            # waiting for an answer stay, and past the bound no socket is made:
            # a read naming thousands of dead addresses (its own P ranks' and
            # their abandons) once opened one socket each, until the daemon ran
            # out of fds ('Too many open files') and failed everyone's reads.
            idle = [a for a, c in self._conns.items() if not c.pending]
            for a in idle[: len(self._conns) - self.max_connections + 1]:
                self._drop_conn(a, HandshakeFailed(a, "connection closed (too many peers)"))
                self._evicted("connection")
            if len(self._conns) >= self.max_connections:
                self._evicted("connection_refused")
                raise HandshakeFailed(addr, f"{len(self._conns)} peer connections are waiting "
                                            f"for answers, the bound ({self.max_connections}); "
                                            "try again once they are answered or time out")
        try:
            sock = LoopSocket.of(self._ctx, zmq.DEALER)
        except zmq.ZMQError as e:
            raise HandshakeFailed(addr, f"cannot open a socket: {e.strerror}") from None
        try:
            sock.sock.setsockopt(zmq.LINGER, 0)
            sock.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
            if self._keys is not None:
                self._keys.dial_with(sock.sock, server)
            if ipv6(host):
                sock.sock.setsockopt(zmq.IPV6, 1)
            sock.sock.connect(f"tcp://{plain.removeprefix('tcp://')}")
        except zmq.ZMQError as e:
            # An address from an engine's read that libzmq refuses (a port that is
            # not a number, say): the socket is closed here, or it would be leaked
            # and the context's term() at shutdown would wait for it forever.
            sock.close(linger=0)
            raise HandshakeFailed(addr, f"cannot dial it: {e.strerror}") from None
        conn = _Connection(addr, sock, owner=owner)
        conn.reader = asyncio.create_task(self._read(conn), name=f"handshake-reader-{addr}")
        self._conns[addr] = conn
        return conn

    def _drop_conn(self, addr: str, exc: HandshakeFailed) -> None:
        conn = self._conns.pop(addr, None)
        if conn is None:
            return
        if conn.reader is not None:
            conn.reader.cancel()
        conn.sock.close(linger=0)
        for fut in conn.pending.values():
            if not fut.done():
                fut.set_exception(HandshakeFailed(addr, exc.reason, field=exc.field))
        conn.pending.clear()

    async def _read(self, conn: _Connection) -> None:
        while True:
            try:
                frames = await conn.sock.recv_multipart()
            except zmq.ZMQError as e:
                if e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.warning("handshake reply from %s not received: %s", conn.address, e)
                continue
            frame = frames[-1]
            try:
                reply = decode_reply(frame)
            except Exception as e:  # DecodeError, UnicodeDecodeError
                env = salvage(frame)
                if env.v not in (-1, HANDSHAKE_VERSION):
                    err = HandshakeFailed(
                        conn.address,
                        f"protocol version mismatch: peer speaks v{env.v}, "
                        f"we speak v{HANDSHAKE_VERSION}",
                        field="protocol",
                    )
                else:
                    err = HandshakeFailed(conn.address, f"undecodable reply: {e}")
                bad = conn.pending.get(env.req_id)
                if bad is None:
                    log.warning("dropping undecodable handshake reply from %s: %s",
                                conn.address, e)
                elif not bad.done():
                    bad.set_exception(err)
                continue
            conn.answered = True
            fut = conn.pending.get(reply.req_id)
            if fut is None:
                log.debug("dropping handshake reply %d from %s: nobody waits for it",
                          reply.req_id, conn.address)
            elif not fut.done():
                fut.set_result(reply)
