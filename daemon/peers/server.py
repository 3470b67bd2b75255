"""P side of the handshake: answer "what does rank r of engine E look like" from a cache.

Replies are built from a per-rank cache of encoded info because decode
instances handshake on every (re)connect and the info (agent metadata
especially) is the expensive part to encode.

With :class:`~kvsidecar.daemon.peer_auth.PeerKeys` the port speaks CURVE and
admits only authorized keys (the daemon's default); without, it is plain ZMQ
(unit tests, ``--insecure-peers``). Either way requests are bounded
(``max_message_bytes``: a larger one gets a ``bad_message`` reply and is
counted; libzmq drops the connection of one over twice that, see
:mod:`~kvsidecar.daemon.message_limit`), connections
are capped, any undecodable input gets one ``bad_message`` reply, and error
replies name neither other engines nor more of the input than a short prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvsidecar.daemon.conn_guard import ConnectionGuard
from kvsidecar.daemon.message_limit import SizeLimit
from kvsidecar.daemon.peer_auth import PeerKeys, ZapHandler
from kvsidecar.daemon.peers import control
from kvsidecar.daemon.peers.addresses import ipv6, normalise, split_address
from kvsidecar.daemon.peers.messages import (
    HANDSHAKE_VERSION,
    ErrorCode,
    HandshakeError,
    HandshakeInfo,
    RawReply,
    Reader,
    decode_request,
    encode,
    salvage,
    short,
)
from kvsidecar.ipc.loop_socket import LoopSocket

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_CONNECTIONS", "MAX_REQUEST_BYTES", "HandshakeServer"]

#: Requests and control messages are a few hundred bytes (ids are bounded:
#: control messages stay under 4 KiB).
MAX_REQUEST_BYTES = 64 << 10
DEFAULT_MAX_CONNECTIONS = 1024
#: libzmq drops a connection whose ZMTP/CURVE handshake is not done this soon
#: (its default, 30 s, let 1,024 idle TCP connections hold every slot for 30 s,
#: and a fleet member's handshake got no reply). A CURVE handshake takes a few
#: round trips: milliseconds in a data centre, well under a second across one.
HANDSHAKE_IVL_MS = 3000
#: Connections kept from one remote address, as a share of the connection cap
#: (at least 16): one host cannot take every slot from the fleet's others.
PER_SOURCE_SHARE = 4




class HandshakeServer:
    """Answers handshake requests for the engine ranks this sidecar serves.

    ``lookup(engine_id, tp_rank)`` returns the rank's info or None.
    ``engines`` is accepted for compatibility and unused: an unknown-engine
    error never lists what does exist (other tenants' business). Replies are
    built from a per-rank cache of encoded info because decode instances
    handshake on every (re)connect and the info (agent metadata especially)
    is the expensive part to encode.
    """

    def __init__(
        self,
        bind: str,
        lookup: Callable[[str, int], HandshakeInfo | None],
        *,
        on_reader: Callable[[str, Reader, bytes], None] | None = None,
        engines: Callable[[], Iterable[str]] | None = None,
        ctx: zmq.asyncio.Context | None = None,
        keys: PeerKeys | None = None,
        max_message_bytes: int = MAX_REQUEST_BYTES,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        on_refuse: Callable[[str], None] | None = None,
        control: Callable[[bytes, bytes], bytes | Awaitable[bytes]] | None = None,
    ) -> None:
        self._host, self._port = split_address(bind)
        self._lookup = lookup
        #: told (target engine, reader, member) for every request that declares its
        #: reader; ``member`` is the sender's CURVE public key (b"" without CURVE)
        self._on_reader = on_reader
        self._keys = keys
        self.size_limit = SizeLimit("handshake", max_message_bytes, on_refuse)
        self._max_connections = max_connections
        self._on_refuse = on_refuse
        self._zap: ZapHandler | None = None
        self.guard: ConnectionGuard | None = None
        #: answers control messages (claims, abandons, digests; see peers/control.py)
        #: given the sender's CURVE public key, which ZAP authenticated (b"" without
        #: CURVE): at once, or later (a digest is hashed on a thread; its reply
        #: goes when done)
        self._control = control
        self._later: set[asyncio.Task[None]] = set()
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self._sock: LoopSocket | None = None
        self._task: asyncio.Task[None] | None = None
        self._cache: dict[tuple[str, int], bytes] = {}
        self.address: str | None = None
        #: Messages received, good or bad; lets tests and metrics see cache effects.
        self.requests_received = 0

    async def start(self) -> str:
        """Bind and start serving; returns the bound ``host:port`` (port 0 picks one)."""
        if self._sock is not None:
            raise RuntimeError("handshake server already started")
        sock = LoopSocket.of(self._ctx, zmq.ROUTER)
        sock.sock.setsockopt(zmq.LINGER, 0)
        sock.sock.setsockopt(zmq.MAXMSGSIZE, self.size_limit.zmq_cap)
        sock.sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        if ipv6(self._host):
            sock.sock.setsockopt(zmq.IPV6, 1)
        if self._keys is not None:
            self._zap = ZapHandler(self._ctx, self._keys.admitted, on_refuse=self._on_refuse)
            self._zap.start()
            self._keys.serve_with(sock.sock)
        port = "*" if self._port in ("0", "*") else self._port
        try:
            sock.sock.bind(f"tcp://{self._host}:{port}")
            endpoint = sock.sock.getsockopt(zmq.LAST_ENDPOINT)
            assert isinstance(endpoint, bytes)
            self.address = normalise(endpoint.decode())
            refuse = self._on_refuse
            self.guard = ConnectionGuard(
                sock.sock, "handshake", self._max_connections,
                local=int(split_address(self.address)[1]),
                on_refuse=(lambda: refuse("connection_limit")) if refuse is not None else None,
                on_handshake_failure=(lambda kind: refuse(f"handshake_{kind}"))
                if refuse is not None else None,
                per_source=max(16, self._max_connections // PER_SOURCE_SHARE),
                on_source_refuse=(lambda: refuse("source_connection_limit"))
                if refuse is not None else None,
            )
        except zmq.ZMQError as e:
            sock.close(linger=0)
            await self._stop_zap()
            raise OSError(f"handshake server cannot bind {self._host}:{self._port}: {e}") from e
        self._sock = sock
        self._task = asyncio.create_task(self._serve(sock), name=f"handshake-server-{self.address}")
        log.info("handshake server listening on %s", self.address)
        return self.address

    async def stop(self) -> None:
        """Stop serving and release the port; safe to call twice."""
        task, sock = self._task, self._sock
        self._task = self._sock = None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for later in list(self._later):
            later.cancel()
        guard, self.guard = self.guard, None
        if guard is not None:
            guard.stop()
        if sock is not None:
            sock.close(linger=0)
        await self._stop_zap()
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    async def _stop_zap(self) -> None:
        zap, self._zap = self._zap, None
        if zap is not None:
            await zap.stop()

    @property
    def refused_keys(self) -> int:
        """Connections refused for a missing or unknown CURVE key."""
        return self._zap.refused if self._zap is not None else 0

    def invalidate(self, engine_id: str | None = None) -> None:
        """Drop cached replies of ``engine_id`` (all engines when None), e.g. after
        it re-registered memory: the next request calls ``lookup`` again."""
        if engine_id is None:
            self._cache.clear()
            return
        for key in [k for k in self._cache if k[0] == engine_id]:
            del self._cache[key]

    async def _serve(self, sock: LoopSocket) -> None:
        while True:
            try:
                raw = await sock.recv_multipart(copy=False)
            except zmq.ZMQError as e:
                if e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.warning("handshake server receive failed: %s", e)
                continue
            self.requests_received += 1
            frames = [f.bytes for f in raw]
            try:
                out = self._handle(frames, _member(raw[-1]) if self._keys is not None else b"")
            except Exception as e:  # one bad request must not take the server down
                log.exception("handshake server failed to handle a request")
                out = [frames[0], self._error(0, "internal", type(e).__name__)]
            if out is None:
                continue
            if not isinstance(out[-1], bytes):
                task = asyncio.ensure_future(self._reply_later(sock, out[:-1], out[-1]))
                self._later.add(task)
                task.add_done_callback(self._later.discard)
                continue
            try:
                await sock.send_multipart(out)
            except zmq.ZMQError as e:
                if e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.warning("handshake server reply failed: %s", e)

    async def _reply_later(self, sock: LoopSocket, envelope: list[bytes],
                           answer: Awaitable[bytes]) -> None:
        """Send an answer that was not ready at once (its awaitable never raises)."""
        body = await answer
        try:
            await sock.send_multipart([*envelope, body])
        except zmq.ZMQError as e:
            if e.errno not in (zmq.ETERM, zmq.ENOTSOCK):
                log.warning("handshake server reply failed: %s", e)

    def _handle(self, frames: list[bytes], member: bytes = b"") -> list[Any] | None:
        # ROUTER prepends the peer identity; a REQ peer adds an empty delimiter
        # we must echo. Everything after that is the payload.
        if len(frames) < 2:
            return None
        envelope, body = frames[:1], frames[1:]
        if len(body) > 1 and body[0] == b"":
            envelope.append(b"")
            body = body[1:]
        if len(body) != 1:
            return [*envelope, self._error(0, "bad_message", f"expected 1 frame, got {len(body)}")]
        too_large = self.size_limit.check(body)
        if too_large is not None:
            return [*envelope, self._error(0, "bad_message", too_large)]
        return [*envelope, self._answer(body[0], member)]

    def _answer(self, frame: bytes, member: bytes = b"") -> bytes | Awaitable[bytes]:
        if self._control is not None and control.op_of(frame):
            return self._control(frame, member)
        try:
            req = decode_request(frame)
        except Exception as e:  # DecodeError, and UnicodeDecodeError for non-UTF-8 strings
            env = salvage(frame)
            if env.v not in (-1, HANDSHAKE_VERSION):
                return self._version_error(env.req_id, env.v)
            return self._error(env.req_id, "bad_message",
                               f"undecodable handshake request: {str(e)[:200]}")
        if req.v != HANDSHAKE_VERSION:
            return self._version_error(req.req_id, req.v)
        key = (req.engine_id, req.tp_rank)
        if req.reader_agent and self._on_reader is not None:
            self._on_reader(req.engine_id, Reader(req.reader_engine, req.reader_rank,
                                                  req.reader_agent), member)
        cached = self._cache.get(key)
        if cached is None:
            try:
                info = self._lookup(req.engine_id, req.tp_rank)
            except Exception as e:
                log.exception("handshake lookup of %s rank %d failed", short(key[0]), key[1])
                return self._error(req.req_id, "internal", f"lookup failed: {type(e).__name__}")
            if info is None:
                return self._error(req.req_id, "unknown_engine", self._unknown(*key))
            cached = self._cache[key] = encode(info)
        return encode(RawReply(msgspec.Raw(cached), req.req_id))

    @staticmethod
    def _unknown(engine_id: str, tp_rank: int) -> str:
        return f"no engine {short(engine_id)} rank {tp_rank} registered here"

    @staticmethod
    def _error(req_id: int, code: ErrorCode, message: str) -> bytes:
        return encode(HandshakeError(code, message, req_id))

    def _version_error(self, req_id: int, v: int) -> bytes:
        return self._error(
            req_id, "version", f"client speaks handshake v{v}, this server v{HANDSHAKE_VERSION}"
        )


#: distinct peer keys whose raw form is kept (a fleet has far fewer members)
MAX_KEYS_CACHED = 1024


def _member(frame: zmq.Frame) -> bytes:
    """The CURVE public key ZAP authenticated for the connection ``frame``
    came over (the ZAP reply's User-Id: the key in Z85), raw 32 bytes."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return b""
    return _raw_key(user) if isinstance(user, str) and len(user) == 40 else b""


@functools.lru_cache(maxsize=MAX_KEYS_CACHED)
def _raw_key(user: str) -> bytes:
    """``user`` (a Z85 key) decoded, once per key: pyzmq's Z85 decoder is pure
    Python (about 20 us), paid on every lease claim otherwise. Only keys ZAP
    admitted reach it (the fleet's members), and the cache is bounded."""
    return zmq.utils.z85.decode(user)
