"""The sidecar-to-sidecar handshake: who a peer rank is and what its KV memory looks like.

A D sidecar must learn a P rank's NIXL agent metadata, layout and region base
addresses before it can read from it. That exchange is one small request/reply
over ZMQ TCP, kept separate from the transfer path so that a slow or dead peer
costs a bounded wait (the client's timeout) and nothing else.

Wire protocol (msgpack via msgspec, one frame each way)::

    DEALER -> ROUTER   HandshakeRequest{engine_id, tp_rank, v, req_id}
    ROUTER -> DEALER   {"type": "reply", info, req_id, v}          (HandshakeReply)
                     | {"type": "error", code, message, req_id, v}  (HandshakeError)

``req_id`` lets one DEALER per peer address carry many concurrent requests;
``v`` is checked before anything else so that a version skew is reported as
such instead of as an undecodable message.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import zmq
import zmq.asyncio

from kvsidecar.ipc.layout import IncompatibleLayout, Layout, check_compatible, fingerprint

log = logging.getLogger(__name__)

HANDSHAKE_VERSION = 1

ErrorCode = Literal["unknown_engine", "bad_message", "version", "internal"]

__all__ = [
    "HANDSHAKE_VERSION",
    "ErrorCode",
    "HandshakeClient",
    "HandshakeError",
    "HandshakeFailed",
    "HandshakeInfo",
    "HandshakeReply",
    "HandshakeRequest",
    "HandshakeServer",
    "IncompatibleLayout",
    "check_peer",
    "make_handshake_info",
    "new_daemon_id",
]


# --------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------


class HandshakeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a peer needs to read this rank's KV memory with NIXL.

    Keyword-only so the field order can follow meaning rather than defaults.
    ``bases[r]`` is the base address of region ``r``; ``fingerprint`` is
    ``fingerprint(layout)``, sent so a peer can compare models without
    rebuilding the fields. ``daemon_id`` changes on every daemon start, which is
    how a client notices that the addresses it cached are stale.
    """

    engine_id: str
    tp_rank: int
    tp_size: int
    agent_name: str
    agent_metadata: bytes
    layout: Layout
    bases: list[int]
    mem_type: str = "DRAM"
    dev_id: int = 0
    fingerprint: str
    protocol: int = HANDSHAKE_VERSION
    daemon_id: str


class HandshakeRequest(msgspec.Struct, frozen=True):
    """Ask a sidecar for one rank's :class:`HandshakeInfo`."""

    engine_id: str
    tp_rank: int
    v: int = HANDSHAKE_VERSION
    req_id: int = 0


class HandshakeReply(msgspec.Struct, frozen=True, tag="reply"):
    """The success branch of the reply union."""

    info: HandshakeInfo
    req_id: int = 0
    v: int = HANDSHAKE_VERSION


class HandshakeError(msgspec.Struct, frozen=True, tag="error"):
    """The failure branch of the reply union; ``message`` is meant for humans."""

    code: ErrorCode
    message: str
    req_id: int = 0
    v: int = HANDSHAKE_VERSION


class _RawReply(msgspec.Struct, frozen=True, tag="reply"):
    """:class:`HandshakeReply` with ``info`` left encoded.

    Same tag and fields, hence the same bytes: the server splices in its cached
    encoding of the info, and the client checks ``v`` and ``req_id`` before
    trusting the info's schema.
    """

    info: msgspec.Raw
    req_id: int = 0
    v: int = HANDSHAKE_VERSION


class _Envelope(msgspec.Struct):
    """Whatever can be salvaged from a message that failed to decode, to route the error."""

    req_id: int = 0
    v: int = -1


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(HandshakeRequest)
_reply_decoder = msgspec.msgpack.Decoder(_RawReply | HandshakeError)
_info_decoder = msgspec.msgpack.Decoder(HandshakeInfo)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


def _salvage(frame: bytes) -> _Envelope:
    try:
        return _envelope_decoder.decode(frame)
    except msgspec.DecodeError:
        return _Envelope()


def new_daemon_id() -> str:
    """A fresh random id for one daemon start."""
    return secrets.token_hex(8)


def make_handshake_info(
    *,
    engine_id: str,
    tp_rank: int,
    agent_name: str,
    agent_metadata: bytes,
    layout: Layout,
    bases: list[int],
    daemon_id: str,
    mem_type: str = "DRAM",
    dev_id: int = 0,
) -> HandshakeInfo:
    """Build a :class:`HandshakeInfo` whose ``tp_size`` and ``fingerprint`` come
    from ``layout``, so they cannot drift from the layout actually sent."""
    return HandshakeInfo(
        engine_id=engine_id,
        tp_rank=tp_rank,
        tp_size=layout.tp_size,
        agent_name=agent_name,
        agent_metadata=agent_metadata,
        layout=layout,
        bases=list(bases),
        mem_type=mem_type,
        dev_id=dev_id,
        fingerprint=fingerprint(layout),
        daemon_id=daemon_id,
    )


# --------------------------------------------------------------------------
# Errors and validation
# --------------------------------------------------------------------------


class HandshakeFailed(RuntimeError):
    """A handshake could not produce a usable peer; ``reason`` says why.

    ``field`` names the mismatching field when the peer answered but does not
    fit (engine_id, tp_size, bases...), so callers can report it precisely.
    """

    def __init__(self, address: str, reason: str, *, field: str | None = None) -> None:
        where = f"handshake with {address} failed" if address else "handshake failed"
        super().__init__(f"{where}: {reason}")
        self.address = address
        self.reason = reason
        self.field = field


def check_peer(
    info: HandshakeInfo,
    expected_engine_id: str,
    expected_tp_size: int,
    local_layout: Layout,
    *,
    address: str = "",
) -> None:
    """Refuse a peer that is not the engine we were told about, or holds another model.

    Called once per peer rank, before any NIXL setup, because a mismatch found
    later shows up as silently wrong KV bytes rather than an error.
    """

    def fail(fld: str, reason: str) -> HandshakeFailed:
        return HandshakeFailed(address, f"{fld} mismatch: {reason}", field=fld)

    if info.protocol != HANDSHAKE_VERSION:
        raise fail("protocol", f"peer speaks v{info.protocol}, we speak v{HANDSHAKE_VERSION}")
    if info.engine_id != expected_engine_id:
        raise fail("engine_id", f"expected {expected_engine_id!r}, peer is {info.engine_id!r}")
    if info.tp_size != expected_tp_size:
        raise fail(
            "tp_size",
            f"engine {expected_engine_id!r} was announced with tp_size {expected_tp_size}, "
            f"the peer reports tp_size {info.tp_size}",
        )
    if info.layout.tp_size != info.tp_size:
        raise fail(
            "tp_size",
            f"peer reports tp_size {info.tp_size} but its layout says {info.layout.tp_size}",
        )
    if not 0 <= info.tp_rank < info.tp_size:
        raise fail("tp_rank", f"rank {info.tp_rank} outside tp_size {info.tp_size}")
    remote_fp = fingerprint(info.layout)
    if info.fingerprint != remote_fp:
        raise fail(
            "fingerprint",
            f"peer sent fingerprint {info.fingerprint} but its layout hashes to {remote_fp}",
        )
    # check_compatible names the field; it also checks tp divisibility, which
    # the fingerprint deliberately leaves out, so it runs even on a match.
    check_compatible(local_layout, info.layout)
    local_fp = fingerprint(local_layout)
    if local_fp != remote_fp:  # pragma: no cover - only if the two functions disagree
        raise IncompatibleLayout("fingerprint", local_fp, remote_fp)
    if len(info.bases) != info.layout.num_regions:
        raise fail(
            "bases",
            f"{len(info.bases)} base addresses for {info.layout.num_regions} regions",
        )


# --------------------------------------------------------------------------
# Addresses
# --------------------------------------------------------------------------


def _split_address(address: str) -> tuple[str, str]:
    """``host:port`` or ``tcp://host:port`` -> (host, port); IPv6 hosts in brackets."""
    addr = address.removeprefix("tcp://")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"expected host:port, got {address!r}")
    return host, port


def _normalise(address: str) -> str:
    host, port = _split_address(address)
    return f"{host}:{port}"


def _ipv6(host: str) -> bool:
    return host.startswith("[")


# --------------------------------------------------------------------------
# Server
# --------------------------------------------------------------------------


class HandshakeServer:
    """Answers handshake requests for the engine ranks this sidecar serves.

    ``lookup(engine_id, tp_rank)`` returns the rank's info or None; ``engines``
    (optional) lists the registered engine ids so an unknown-engine error can
    say what does exist. Replies are built from a per-rank cache of encoded
    info because decode instances handshake on every (re)connect and the info
    (agent metadata especially) is the expensive part to encode.
    """

    def __init__(
        self,
        bind: str,
        lookup: Callable[[str, int], HandshakeInfo | None],
        *,
        engines: Callable[[], Iterable[str]] | None = None,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self._host, self._port = _split_address(bind)
        self._lookup = lookup
        self._engines = engines
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._cache: dict[tuple[str, int], bytes] = {}
        self.address: str | None = None
        #: Messages received, good or bad; lets tests and metrics see cache effects.
        self.requests_received = 0

    async def start(self) -> str:
        """Bind and start serving; returns the bound ``host:port`` (port 0 picks one)."""
        if self._sock is not None:
            raise RuntimeError("handshake server already started")
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if _ipv6(self._host):
            sock.setsockopt(zmq.IPV6, 1)
        port = "*" if self._port in ("0", "*") else self._port
        try:
            sock.bind(f"tcp://{self._host}:{port}")
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise OSError(f"handshake server cannot bind {self._host}:{self._port}: {e}") from e
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        self.address = _normalise(endpoint.decode())
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
        if sock is not None:
            sock.close(linger=0)
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    def invalidate(self, engine_id: str | None = None) -> None:
        """Drop cached replies of ``engine_id`` (all engines when None), e.g. after
        it re-registered memory: the next request calls ``lookup`` again."""
        if engine_id is None:
            self._cache.clear()
            return
        for key in [k for k in self._cache if k[0] == engine_id]:
            del self._cache[key]

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart()
            except zmq.ZMQError as e:
                if e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.warning("handshake server receive failed: %s", e)
                continue
            self.requests_received += 1
            try:
                out = self._handle(frames)
            except Exception:  # one bad request must not take the server down
                log.exception("handshake server failed to handle a request")
                continue
            if out is None:
                continue
            try:
                await sock.send_multipart(out)
            except zmq.ZMQError as e:
                if e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.warning("handshake server reply failed: %s", e)

    def _handle(self, frames: list[bytes]) -> list[bytes] | None:
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
        return [*envelope, self._answer(body[0])]

    def _answer(self, frame: bytes) -> bytes:
        try:
            req = _request_decoder.decode(frame)
        except msgspec.DecodeError as e:
            env = _salvage(frame)
            if env.v not in (-1, HANDSHAKE_VERSION):
                return self._version_error(env.req_id, env.v)
            return self._error(env.req_id, "bad_message", f"undecodable handshake request: {e}")
        if req.v != HANDSHAKE_VERSION:
            return self._version_error(req.req_id, req.v)
        key = (req.engine_id, req.tp_rank)
        cached = self._cache.get(key)
        if cached is None:
            try:
                info = self._lookup(req.engine_id, req.tp_rank)
            except Exception as e:
                log.exception("handshake lookup of %r rank %d failed", *key)
                return self._error(req.req_id, "internal", f"lookup failed: {e!r}")
            if info is None:
                return self._error(req.req_id, "unknown_engine", self._unknown(*key))
            cached = self._cache[key] = _encoder.encode(info)
        return _encoder.encode(_RawReply(msgspec.Raw(cached), req.req_id))

    def _unknown(self, engine_id: str, tp_rank: int) -> str:
        if self._engines is not None:
            try:
                known = sorted(set(self._engines()))
            except Exception as e:
                known_s = f"(engine list unavailable: {e!r})"
            else:
                if engine_id in known:
                    return f"engine {engine_id!r} has no rank {tp_rank} registered here"
                known_s = str(known)
        else:
            known_s = f"{sorted({e for e, _ in self._cache})} (served so far)"
        return f"no engine {engine_id!r} (rank {tp_rank}) registered here; engines: {known_s}"

    @staticmethod
    def _error(req_id: int, code: ErrorCode, message: str) -> bytes:
        return _encoder.encode(HandshakeError(code, message, req_id))

    def _version_error(self, req_id: int, v: int) -> bytes:
        return self._error(
            req_id, "version", f"client speaks handshake v{v}, this server v{HANDSHAKE_VERSION}"
        )


# --------------------------------------------------------------------------
# Client
# --------------------------------------------------------------------------

_Key = tuple[str, str, int]  # (address, engine_id, tp_rank)


@dataclass(eq=False)
class _Peer:
    """One DEALER to one address, shared by every request to it."""

    address: str
    sock: zmq.asyncio.Socket
    pending: dict[int, asyncio.Future[_RawReply | HandshakeError]] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None


class HandshakeClient:
    """Fetches (and caches) peers' :class:`HandshakeInfo`.

    Concurrent fetches of one (address, engine, rank) share one request so a
    burst of requests for a new P engine costs it one handshake. Successes are
    cached until :meth:`forget`; failures are not, so a retry really retries.
    """

    def __init__(self, timeout_s: float = 5.0, *, ctx: zmq.asyncio.Context | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self._peers: dict[str, _Peer] = {}
        self._cache: dict[_Key, HandshakeInfo] = {}
        self._inflight: dict[_Key, asyncio.Task[HandshakeInfo]] = {}
        self._ids = itertools.count(1)
        self._closed = False

    async def fetch(self, address: str, engine_id: str, tp_rank: int) -> HandshakeInfo:
        """The info of ``engine_id`` rank ``tp_rank`` served at ``address`` (``host:port``).

        Raises :class:`HandshakeFailed`; never waits longer than ``timeout_s``
        for the request it sends.
        """
        addr = _normalise(address)
        if self._closed:
            raise HandshakeFailed(addr, "handshake client is closed")
        key = (addr, engine_id, tp_rank)
        hit = self._cache.get(key)
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
        addr = _normalise(address)

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
        for addr in list(self._peers):
            self._drop_peer(addr, HandshakeFailed(addr, "handshake client closed"))
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=self.timeout_s)
            for t in stuck:
                t.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        self._cache.clear()
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    def _request_done(self, key: _Key, task: asyncio.Task[HandshakeInfo]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved here so an unawaited failure is not logged as lost

    async def _fetch_once(self, key: _Key) -> HandshakeInfo:
        addr, engine_id, tp_rank = key
        try:
            reply = await asyncio.wait_for(
                self._roundtrip(addr, engine_id, tp_rank), timeout=self.timeout_s
            )
        except asyncio.TimeoutError:
            err = HandshakeFailed(addr, f"no answer from {addr} within {self.timeout_s} s")
            # A dead or wedged peer: start the next attempt on a fresh socket and
            # fail the requests queued behind this one instead of letting them wait.
            self._drop_peer(addr, err)
            raise err from None
        info = self._check_reply(addr, engine_id, tp_rank, reply)
        if self._inflight.get(key) is asyncio.current_task():  # not forgotten meanwhile
            self._cache[key] = info
        return info

    async def _roundtrip(
        self, addr: str, engine_id: str, tp_rank: int
    ) -> _RawReply | HandshakeError:
        if self._closed:
            raise HandshakeFailed(addr, "handshake client closed")
        peer = self._peer(addr)
        req_id = next(self._ids)
        fut: asyncio.Future[_RawReply | HandshakeError] = (
            asyncio.get_running_loop().create_future()
        )
        peer.pending[req_id] = fut
        try:
            msg = _encoder.encode(HandshakeRequest(engine_id, tp_rank, HANDSHAKE_VERSION, req_id))
            try:
                await peer.sock.send(msg)
            except zmq.ZMQError as e:
                raise HandshakeFailed(addr, f"cannot send the request: {e}") from None
            return await fut
        finally:
            peer.pending.pop(req_id, None)

    def _check_reply(
        self, addr: str, engine_id: str, tp_rank: int, reply: _RawReply | HandshakeError
    ) -> HandshakeInfo:
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
            info = _info_decoder.decode(reply.info)
        except msgspec.DecodeError as e:
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

    def _peer(self, addr: str) -> _Peer:
        peer = self._peers.get(addr)
        if peer is not None:
            return peer
        host, _ = _split_address(addr)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if _ipv6(host):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(f"tcp://{addr}")
        peer = _Peer(addr, sock)
        peer.reader = asyncio.create_task(self._read(peer), name=f"handshake-reader-{addr}")
        self._peers[addr] = peer
        return peer

    def _drop_peer(self, addr: str, exc: HandshakeFailed) -> None:
        peer = self._peers.pop(addr, None)
        if peer is None:
            return
        if peer.reader is not None:
            peer.reader.cancel()
        peer.sock.close(linger=0)
        for fut in peer.pending.values():
            if not fut.done():
                fut.set_exception(HandshakeFailed(addr, exc.reason, field=exc.field))
        peer.pending.clear()

    async def _read(self, peer: _Peer) -> None:
        while True:
            try:
                frames = await peer.sock.recv_multipart()
            except zmq.ZMQError as e:
                if e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.warning("handshake reply from %s not received: %s", peer.address, e)
                continue
            frame = frames[-1]
            try:
                reply = _reply_decoder.decode(frame)
            except msgspec.DecodeError as e:
                env = _salvage(frame)
                if env.v not in (-1, HANDSHAKE_VERSION):
                    err = HandshakeFailed(
                        peer.address,
                        f"protocol version mismatch: peer speaks v{env.v}, "
                        f"we speak v{HANDSHAKE_VERSION}",
                        field="protocol",
                    )
                else:
                    err = HandshakeFailed(peer.address, f"undecodable reply: {e}")
                bad = peer.pending.get(env.req_id)
                if bad is None:
                    log.warning("dropping undecodable handshake reply from %s: %s",
                                peer.address, e)
                elif not bad.done():
                    bad.set_exception(err)
                continue
            fut = peer.pending.get(reply.req_id)
            if fut is None:
                log.debug("dropping handshake reply %d from %s: nobody waits for it",
                          reply.req_id, peer.address)
            elif not fut.done():
                fut.set_result(reply)
