"""The engine socket's own defences, attacked through real sockets: file modes
under any umask, kernel peer credentials, a second server, bounded replies and
a connection flood.

The engine server runs in this process with a stand-in handler; what the
handler would do is the service's business (tests/e2e/test_security.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from kvsidecar.daemon.engine_access import (
    AccessPolicy,
    PeerCred,
    SocketInUse,
    current_peer,
    peer_cred,
    prepare_socket_dir,
)
from kvsidecar.daemon.engine_server import MAX_ERROR_CHARS, EngineServer
from kvsidecar.ipc.client import AsyncSidecarClient, Forbidden
from kvsidecar.ipc.protocol import (
    Error,
    Ping,
    Poll,
    Pong,
    Reply,
    Request,
    RequestError,
    decode_reply,
    encode_request,
)
from kvsidecar.ipc.seqpacket import BlockingChannel, new_socket


class Handler:
    """Answers Ping with the caller's uid; everything else is an unknown engine
    quoting the id it was given (as the real service's errors may)."""

    def __init__(self) -> None:
        self.calls = 0
        self.peers: list[PeerCred | None] = []

    async def handle(self, req: Request) -> Reply:
        self.calls += 1
        self.peers.append(current_peer.get())
        if isinstance(req, Ping):
            return Pong(version=1)
        raise RequestError("unknown_engine", f"engine {getattr(req, 'engine_id', '')!r} " * 10)


@pytest.fixture
def handler() -> Handler:
    return Handler()


@pytest.fixture
async def server(tmp_path: Path, handler: Handler) -> AsyncIterator[EngineServer]:
    s = EngineServer(str(tmp_path / "run" / "e.sock"), handler)
    await s.start()
    yield s
    await s.stop()


def test_peer_credentials_and_the_policy() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        assert peer_cred(a) == PeerCred(os.geteuid(), os.getegid(), os.getpid())
    assert peer_cred(a) is None  # closed: unknown, and refused below
    policy = AccessPolicy(frozenset({5}), frozenset({7}))
    assert policy.allows(PeerCred(5, 0, 1)) and policy.allows(PeerCred(9, 7, 1))
    assert not policy.allows(PeerCred(9, 8, 1)) and not policy.allows(None)


async def test_socket_and_directory_modes_ignore_the_umask(tmp_path: Path,
                                                          handler: Handler) -> None:
    old = os.umask(0)  # the attack: a sidecar started with umask 000
    try:
        s = EngineServer(str(tmp_path / "run" / "e.sock"), handler)
        await s.start()
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o700
        assert stat.S_IMODE(os.stat(s.socket_path).st_mode) == 0o600
    finally:
        await s.stop()


async def test_every_request_carries_the_senders_kernel_credentials(
        server: EngineServer, handler: Handler) -> None:
    async with AsyncSidecarClient(server.socket_path, timeout_s=10) as c:
        await c.ping()
    assert handler.peers == [PeerCred(os.geteuid(), os.getegid(), os.getpid())]


async def test_a_sender_outside_the_policy_gets_one_forbidden_reply(tmp_path: Path,
                                                                   handler: Handler) -> None:
    s = EngineServer(str(tmp_path / "e.sock"), handler,
                     access=AccessPolicy(frozenset({os.geteuid() + 4242})))
    await s.start()
    try:
        async with AsyncSidecarClient(s.socket_path, timeout_s=10) as c:
            with pytest.raises(Forbidden, match=f"uid {os.geteuid()} .*may not use"):
                await c.ping()
            with pytest.raises(Forbidden):
                await c.poll("victim")
        assert handler.calls == 0  # nothing was decoded, nothing reached the handler
        assert s.forbidden == 2
    finally:
        await s.stop()


async def test_error_replies_never_grow_with_the_input(server: EngineServer) -> None:
    def exchange(chan: BlockingChannel, data: bytes) -> Reply:
        chan.send(data)
        return decode_reply(chan.recv())

    with BlockingChannel(server.socket_path) as chan:
        # The handler quotes the id ten times (2,560 characters): the reply is cut.
        r = await asyncio.to_thread(exchange, chan, encode_request(Poll(id=1,
                                                                        engine_id="y" * 256)))
        assert isinstance(r, Error) and r.id == 1 and r.message.endswith("characters cut)")
        assert len(r.message) <= MAX_ERROR_CHARS + 40
        # A 1 MB engine id is refused by the protocol (ids are bounded), unquoted.
        r = await asyncio.to_thread(exchange, chan, msgspec.msgpack.encode(
            {"op": "poll", "id": 9, "v": 1, "engine_id": "w" * 1_000_000}))
        assert isinstance(r, Error) and r.code == "bad_message" and r.id == 9
        assert "www" not in r.message and len(r.message) <= MAX_ERROR_CHARS + 40


async def test_a_second_server_on_a_live_socket_leaves_it_alone(server: EngineServer,
                                                                handler: Handler) -> None:
    with pytest.raises(SocketInUse):
        await EngineServer(server.socket_path, handler).start()
    assert Path(server.socket_path).exists()
    async with AsyncSidecarClient(server.socket_path, timeout_s=10) as c:
        assert isinstance(await c.ping(), Pong)


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(PermissionError, match="writable by others"):
        prepare_socket_dir(str(d), shared=False)


async def test_a_message_over_twice_the_limit_is_refused_and_its_connection_closed(
        tmp_path: Path, handler: Handler) -> None:
    """Announced at over twice the limit: refused from its header alone (never
    buffered), counted, answered once, and the connection closed; everyone else
    is served."""
    refused: list[str] = []
    s = EngineServer(str(tmp_path / "e.sock"), handler, max_message_bytes=64 << 10,
                     on_refuse=refused.append)
    await s.start()

    def send_huge() -> tuple[dict[str, object], BlockingChannel]:
        chan = BlockingChannel(s.socket_path)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            chan.send(b"\x00" * (1 << 20))  # the server closes after the header
        err = msgspec.msgpack.decode(chan.recv())
        return err, chan

    try:
        err, chan = await asyncio.to_thread(send_huge)
        with chan:
            assert err["op"] == "error" and err["code"] == "bad_message"
            assert "over this sidecar's limit of 65536" in err["message"]
            with pytest.raises(EOFError):
                await asyncio.to_thread(chan.recv)
        assert refused == ["too_large"] and s.size_limit.refused == 1
        async with AsyncSidecarClient(s.socket_path, timeout_s=10) as c:
            assert isinstance(await c.ping(), Pong)  # everyone else is served
        assert handler.calls == 1  # only the ping reached the handler
    finally:
        await s.stop()


async def test_a_message_over_the_limit_is_refused_counted_and_answered(
        tmp_path: Path, handler: Handler) -> None:
    """Over the limit but under twice it: one bad_message reply with the request's
    id, counted as refused 'too_large', the sender still served."""
    refused: list[str] = []
    s = EngineServer(str(tmp_path / "e.sock"), handler, max_message_bytes=64 << 10,
                     on_refuse=refused.append)
    await s.start()
    big = msgspec.msgpack.encode({"op": "ping", "id": 42, "v": 1, "pad": "x" * (100 << 10)})

    def exchange(chan: BlockingChannel) -> None:
        chan.send(big)
        err = msgspec.msgpack.decode(chan.recv())
        assert err["op"] == "error" and err["code"] == "bad_message" and err["id"] == 42
        assert f"message of {len(big)} bytes is over this sidecar's limit of 65536" \
            in err["message"]
        assert not chan.readable(0.3)  # exactly one reply
        chan.send(msgspec.msgpack.encode({"op": "ping", "id": 43, "v": 1}))
        # the same connection is still served
        assert msgspec.msgpack.decode(chan.recv())["op"] == "pong"

    try:
        with BlockingChannel(s.socket_path) as chan:
            await asyncio.to_thread(exchange, chan)
        assert refused == ["too_large"] and s.size_limit.refused == 1
    finally:
        await s.stop()


async def test_connections_beyond_the_limit_are_shut_and_the_first_stay(
        tmp_path: Path, handler: Handler) -> None:
    refused: list[str] = []
    s = EngineServer(str(tmp_path / "e.sock"), handler, max_connections=4,
                     on_refuse=refused.append)
    await s.start()
    flood: list[socket.socket] = []
    try:
        async with AsyncSidecarClient(s.socket_path, timeout_s=30) as engine:
            await engine.ping()  # a registered engine's connection, first in
            for _ in range(40):
                f = new_socket()
                f.connect(s.socket_path)
                flood.append(f)
            while s.refused_connections < 37:  # 40 + the engine, 4 kept
                await asyncio.sleep(0.05)
            last = flood[-1]  # refused: one error that says why, then the end
            last.settimeout(30)
            err = decode_reply(last.recv(4096))
            assert isinstance(err, Error) and err.code == "unavailable"
            assert "4 engine connections, its limit" in err.message
            assert last.recv(4096) == b""
            assert s.connections == 4 and s.refused_connections == 37
            assert refused == ["connection_limit"] * 37
            assert isinstance(await engine.ping(), Pong)  # still served
    finally:
        for f in flood:
            f.close()
        await s.stop()


async def test_requests_in_flight_on_one_connection_are_bounded(tmp_path: Path) -> None:
    """Past ``max_in_flight`` unanswered requests, each further one gets a clear
    error at once; the connection keeps working once replies went out."""
    gate = asyncio.Event()

    class Slow:
        async def handle(self, req: Request) -> Reply:
            await gate.wait()
            return Pong(version=1)

    refused: list[str] = []
    s = EngineServer(str(tmp_path / "e.sock"), Slow(), max_in_flight=3,
                     on_refuse=refused.append)
    await s.start()
    try:
        async with AsyncSidecarClient(s.socket_path, timeout_s=30) as c:
            calls = [asyncio.ensure_future(c.ping()) for _ in range(5)]
            while s.refused_in_flight < 2:
                await asyncio.sleep(0.01)
            gate.set()
            out = await asyncio.gather(*calls, return_exceptions=True)
            errors = [o for o in out if isinstance(o, Exception)]
            assert len(errors) == 2 and all("3 requests are in flight on this connection"
                                            in str(e) for e in errors)
            assert refused == ["in_flight_limit"] * 2
            assert isinstance(await c.ping(), Pong)
    finally:
        await s.stop()
