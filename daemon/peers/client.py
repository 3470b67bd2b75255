"""D side of the handshake: fetch (and cache) a peer rank's info over one DEALER per address."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from kvsidecar.daemon.peer_auth import PeerKeys
from kvsidecar.daemon.peers import control
from kvsidecar.daemon.peers.addresses import ipv6, normalise, split_address
from kvsidecar.daemon.peers.control import ControlReply, ControlRequest
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

log = logging.getLogger(__name__)

#: Cached handshake answers (one per peer address, engine, rank and local reader).
MAX_CACHED = 4096
#: Open DEALER sockets, one per peer address; idle ones beyond this are closed.
MAX_CONNECTIONS = 256

#: Replies carry agent metadata and a layout; anything larger drops the connection.
MAX_REPLY_BYTES = 64 << 20

__all__ = ["HandshakeClient"]


_Key = tuple[str, str, int, Reader | None]  # (address, engine_id, tp_rank, declared reader)


@dataclass(eq=False)
class _Connection:
    """One DEALER to one peer address, shared by every request to it.

    A connection, not a :class:`~kvsidecar.daemon.peers.links.Peer` (a linked remote rank).
    """

    address: str
    sock: zmq.asyncio.Socket
    pending: dict[int, asyncio.Future[AnyReply]] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None


class HandshakeClient:
    """Fetches (and caches) peers' :class:`HandshakeInfo`.

    Concurrent fetches of one (address, engine, rank) share one request so a
    burst of requests for a new P engine costs it one handshake. Successes are
    cached until :meth:`forget`; failures are not, so a retry really retries.
    """

    def __init__(self, timeout_s: float = 5.0, *, ctx: zmq.asyncio.Context | None = None,
                 max_cached: int = MAX_CACHED, max_connections: int = MAX_CONNECTIONS,
                 on_evict: Callable[[str], None] | None = None,
                 keys: PeerKeys | None = None) -> None:
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
        self._on_evict = on_evict
        self.timeout_s = timeout_s
        self._keys = keys
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self._conns: OrderedDict[str, _Connection] = OrderedDict()
        self._cache: OrderedDict[_Key, HandshakeInfo] = OrderedDict()
        self._inflight: dict[_Key, asyncio.Task[HandshakeInfo]] = {}
        self._ids = itertools.count(1)
        self._closed = False

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
        # Shielded: a caller that gives up must not cancel the request others await.
        return await asyncio.shield(task)

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
        info = self._check_reply(addr, engine_id, tp_rank, reply)
        if self._inflight.get(key) is asyncio.current_task():  # not forgotten meanwhile
            self._cache[key] = info
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
                self._evicted("handshake")
        return info

    async def control(self, address: str, msg: ControlRequest) -> ControlReply:
        """One control request (claim, abandon) to the sidecar at ``address``.

        Raises :class:`HandshakeFailed` when no valid reply comes within
        ``timeout_s`` (the connection is then replaced, as for a handshake).
        """
        addr = normalise(address)
        if self._closed:
            raise HandshakeFailed(addr, "handshake client is closed")
        req_id = next(self._ids)
        payload = control.encode(msgspec.structs.replace(msg, req_id=req_id))
        what = type(msg).__name__.lower()
        try:
            reply = await asyncio.wait_for(self._send(addr, req_id, payload), self.timeout_s)
        except asyncio.TimeoutError:
            err = HandshakeFailed(addr, f"no answer to {what} from {addr} within "
                                        f"{self.timeout_s} s")
            self._drop_conn(addr, err)
            raise err from None
        if isinstance(reply, HandshakeError):
            raise HandshakeFailed(addr, f"peer rejected the {what} ({reply.code}): "
                                        f"{reply.message}")
        if not isinstance(reply, ControlReply):
            raise HandshakeFailed(addr, f"peer answered a {what} with a handshake reply")
        return reply

    async def _roundtrip(self, addr: str, engine_id: str, tp_rank: int,
                         reader: Reader | None) -> AnyReply:
        req_id = next(self._ids)
        if reader is None:
            req = HandshakeRequest(engine_id, tp_rank, HANDSHAKE_VERSION, req_id)
        else:
            req = HandshakeRequest(engine_id, tp_rank, HANDSHAKE_VERSION, req_id,
                                   reader.engine_id, reader.tp_rank, reader.agent)
        return await self._send(addr, req_id, encode(req))

    async def _send(self, addr: str, req_id: int, msg: bytes) -> AnyReply:
        if self._closed:
            raise HandshakeFailed(addr, "handshake client closed")
        conn = self._conn(addr)
        fut: asyncio.Future[AnyReply] = asyncio.get_running_loop().create_future()
        conn.pending[req_id] = fut
        try:
            try:
                await conn.sock.send(msg)
            except zmq.ZMQError as e:
                raise HandshakeFailed(addr, f"cannot send the request: {e}") from None
            return await fut
        finally:
            conn.pending.pop(req_id, None)

    def _check_reply(
        self, addr: str, engine_id: str, tp_rank: int, reply: AnyReply
    ) -> HandshakeInfo:
        if isinstance(reply, ControlReply):
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
        try:
            info = decode_info(reply.info)
        except Exception as e:  # DecodeError, UnicodeDecodeError
            raise HandshakeFailed(addr, f"malformed handshake info: {e}") from None
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
        return info

    def _conn(self, addr: str) -> _Connection:
        conn = self._conns.get(addr)
        if conn is not None:
            self._conns.move_to_end(addr)
        if conn is not None:
            return conn
        host, _ = split_address(addr)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        if self._keys is not None:
            self._keys.dial_with(sock)
        if ipv6(host):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(f"tcp://{addr}")
        conn = _Connection(addr, sock)
        conn.reader = asyncio.create_task(self._read(conn), name=f"handshake-reader-{addr}")
        self._conns[addr] = conn
        idle = [a for a, c in self._conns.items() if not c.pending and a != addr]
        for a in idle[: max(0, len(self._conns) - self.max_connections)]:
            self._drop_conn(a, HandshakeFailed(a, "connection closed (too many peers)"))
            self._evicted("connection")
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
            fut = conn.pending.get(reply.req_id)
            if fut is None:
                log.debug("dropping handshake reply %d from %s: nobody waits for it",
                          reply.req_id, conn.address)
            elif not fut.done():
                fut.set_result(reply)
