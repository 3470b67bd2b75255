"""The engine socket's own defences, attacked through real sockets: file modes
under any umask, kernel peer credentials, a second server, bounded replies and
a connection flood.

The engine server runs in this process with a stand-in handler; what the
handler would do is the service's business (tests/e2e/test_security.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvsidecar.daemon.engine_access import (
    AccessPolicy,
    PeerCred,
    SocketInUse,
    current_peer,
    parse_peer_address,
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


def test_peer_address_parsing() -> None:
    assert parse_peer_address("localhost:1000:100:4242") == PeerCred(1000, 100, 4242)
    for bad in (None, "", "127.0.0.1", "localhost:x:1:2"):
        assert parse_peer_address(bad) is None
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
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.endpoint)
    try:
        # The handler quotes the id ten times (2,560 characters): the reply is cut.
        await sock.send(encode_request(Poll(id=1, engine_id="y" * 256)))
        r = decode_reply(await asyncio.wait_for(sock.recv(), 10))
        assert isinstance(r, Error) and r.id == 1 and r.message.endswith("characters cut)")
        assert len(r.message) <= MAX_ERROR_CHARS + 40
        # A 1 MB engine id is refused by the protocol (ids are bounded), unquoted.
        await sock.send(msgspec.msgpack.encode(
            {"op": "poll", "id": 9, "v": 1, "engine_id": "w" * 1_000_000}))
        r = decode_reply(await asyncio.wait_for(sock.recv(), 10))
        assert isinstance(r, Error) and r.code == "bad_message" and r.id == 9
        assert "www" not in r.message and len(r.message) <= MAX_ERROR_CHARS + 40
    finally:
        sock.close(0)
        ctx.term()


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


async def test_oversized_messages_never_reach_python(tmp_path: Path, handler: Handler) -> None:
    s = EngineServer(str(tmp_path / "e.sock"), handler, max_message_bytes=64 << 10)
    await s.start()
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(s.endpoint)
    try:
        await sock.send(b"\x00" * (1 << 20))  # dropped by libzmq with the connection
        async with AsyncSidecarClient(s.socket_path, timeout_s=10) as c:
            assert isinstance(await c.ping(), Pong)  # everyone else is served
        assert s.messages == 1  # only the ping was ever received
    finally:
        sock.close(0)
        ctx.term()
        await s.stop()


async def test_a_message_over_the_limit_is_refused_counted_and_answered(
        tmp_path: Path, handler: Handler) -> None:
    """Over the limit but under libzmq's cap (twice the limit): one bad_message reply
    with the request's id, counted as refused 'too_large', the sender still served."""
    refused: list[str] = []
    s = EngineServer(str(tmp_path / "e.sock"), handler, max_message_bytes=64 << 10,
                     on_refuse=refused.append)
    await s.start()
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(s.endpoint)
    try:
        big = msgspec.msgpack.encode({"op": "ping", "id": 42, "v": 1, "pad": "x" * (100 << 10)})
        await sock.send(big)
        assert await sock.poll(10_000)
        err = msgspec.msgpack.decode(await sock.recv())
        assert err["op"] == "error" and err["code"] == "bad_message" and err["id"] == 42
        assert f"message of {len(big)} bytes is over this sidecar's limit of 65536" \
            in err["message"]
        assert await sock.poll(300) == 0  # exactly one reply
        assert refused == ["too_large"] and s.size_limit.refused == 1
        await sock.send(msgspec.msgpack.encode({"op": "ping", "id": 43, "v": 1}))
        assert await sock.poll(10_000)  # the same connection is still served
        assert msgspec.msgpack.decode(await sock.recv())["op"] == "pong"
    finally:
        sock.close(0)
        ctx.term()
        await s.stop()


async def test_connections_beyond_the_limit_are_shut_and_the_first_stay(
        tmp_path: Path, handler: Handler) -> None:
    s = EngineServer(str(tmp_path / "e.sock"), handler, max_connections=4)
    await s.start()
    assert s.guard is not None
    flood: list[socket.socket] = []
    try:
        async with AsyncSidecarClient(s.socket_path, timeout_s=30) as engine:
            await engine.ping()  # a registered engine's connection, first in
            for _ in range(40):
                f = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                f.connect(s.socket_path)
                flood.append(f)
            while s.guard.refused < 37:  # 40 + the engine, 4 kept
                await asyncio.sleep(0.05)
            last = flood[-1]  # refused: libzmq's greeting, then the end
            last.settimeout(30)
            while last.recv(1024):
                pass
            assert s.guard.connections == 4 and s.guard.refused == 37
            assert isinstance(await engine.ping(), Pong)  # still served
    finally:
        for f in flood:
            f.close()
        await s.stop()
