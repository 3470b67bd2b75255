"""The peer (handshake) channel under attack, through real ZMQ sockets: CURVE with
the fleet key, clients with no key or another key, hostile frames, oversize
frames, and the key files themselves."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvsidecar.daemon.peer_auth import PeerKeys, generate_keys, load_keys
from kvsidecar.daemon.peers import control as peer_control
from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.peers.messages import (
    HandshakeError,
    HandshakeFailed,
    HandshakeInfo,
    HandshakeRequest,
    make_handshake_info,
)
from kvsidecar.daemon.peers.server import HandshakeServer
from kvsidecar.ipc.layout import attention_layout

LAYOUT = attention_layout(model="m", num_layers=2, total_kv_heads=2, head_dim=8, block_tokens=4,
                          tp_size=1, num_blocks=8)
INFO = make_handshake_info(engine_id="prefill-0", tp_rank=0, agent_name="agent",
                           agent_metadata=b"secret-metadata", layout=LAYOUT,
                           bases=[4096] * LAYOUT.num_regions, daemon_id="d")


def lookup(engine_id: str, rank: int) -> HandshakeInfo | None:
    return INFO if (engine_id, rank) == ("prefill-0", 0) else None


@pytest.fixture
def keys(tmp_path: Path) -> PeerKeys:
    generate_keys(tmp_path / "fleet")
    return load_keys(tmp_path / "fleet")


@pytest.fixture
async def server(keys: PeerKeys) -> AsyncIterator[HandshakeServer]:
    srv = HandshakeServer("127.0.0.1:0", lookup, keys=keys)
    await srv.start()
    yield srv
    await srv.stop()


async def _until(cond: object, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.02)


async def test_a_fleet_member_gets_the_info(server: HandshakeServer, keys: PeerKeys) -> None:
    cli = HandshakeClient(timeout_s=10, keys=keys)
    try:
        assert await cli.fetch(server.address or "", "prefill-0", 0) == INFO
    finally:
        await cli.close()


async def test_a_client_without_a_key_learns_nothing(server: HandshakeServer) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://{server.address}")
    try:
        await sock.send(msgspec.msgpack.encode(HandshakeRequest("prefill-0", 0)))
        assert await sock.poll(3000) == 0  # not a byte back: no metadata, no engine list
        assert server.guard is not None
        await _until(lambda: server.guard.handshake_failures >= 1)  # counted (and logged)
        assert server.requests_received == 0  # nothing reached the request handler
    finally:
        sock.close(0)
        ctx.term()
    cli = HandshakeClient(timeout_s=1.0)  # the daemon's own client, without keys
    try:
        with pytest.raises(HandshakeFailed, match="no answer"):
            await cli.fetch(server.address or "", "prefill-0", 0)
    finally:
        await cli.close()


async def test_a_client_with_another_key_learns_nothing(server: HandshakeServer, keys: PeerKeys,
                                                        tmp_path: Path) -> None:
    generate_keys(tmp_path / "other")
    other = load_keys(tmp_path / "other")
    # The attacker even knows the fleet's public key (it is not a secret).
    thief = PeerKeys(other.public, other.secret, other.authorized)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.curve_secretkey, sock.curve_publickey = thief.secret, thief.public
    sock.curve_serverkey = keys.public
    sock.connect(f"tcp://{server.address}")
    try:
        await sock.send(msgspec.msgpack.encode(HandshakeRequest("prefill-0", 0)))
        assert await sock.poll(3000) == 0
        await _until(lambda: server.refused_keys >= 1)
        assert server.requests_received == 0
    finally:
        sock.close(0)
        ctx.term()


async def test_authorized_directory_admits_a_second_key(keys: PeerKeys, tmp_path: Path) -> None:
    generate_keys(tmp_path / "new")
    new = load_keys(tmp_path / "new")
    (tmp_path / "fleet" / "authorized" / "new.key").write_bytes(
        (tmp_path / "new" / "sidecar.key").read_bytes())
    admitted = load_keys(tmp_path / "fleet")
    assert admitted.authorized == {keys.public, new.public}


def test_key_files(tmp_path: Path) -> None:
    secret = generate_keys(tmp_path / "k")
    assert (secret.stat().st_mode & 0o777) == 0o600
    with pytest.raises(FileExistsError):
        generate_keys(tmp_path / "k")
    os.chmod(secret, 0o644)
    with pytest.raises(ValueError, match="readable by others"):
        load_keys(tmp_path / "k")
    with pytest.raises(ValueError, match="kvsidecar keys"):
        load_keys(tmp_path / "missing")


@pytest.fixture
async def plain_server() -> AsyncIterator[HandshakeServer]:
    srv = HandshakeServer("127.0.0.1:0", lookup, max_message_bytes=64 << 10)
    await srv.start()
    yield srv
    await srv.stop()


@pytest.mark.parametrize("frame", [
    b"\x82\xa9engine_id\xa2\xff\xfe\xa7tp_rank\x00",  # a non-UTF-8 id (UnicodeDecodeError)
    b"\x84\xa9engine_id\xa2\xff\xfe\xa7tp_rank\x00\xa1v\x01\xa6req_id\x07",
    b"\xc1",
    b"",
    msgspec.msgpack.encode({"engine_id": "x" * 50_000, "tp_rank": 0, "req_id": 3}),
])
async def test_hostile_frames_get_one_bounded_error(plain_server: HandshakeServer,
                                                    frame: bytes) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://{plain_server.address}")
    dec = msgspec.msgpack.Decoder(HandshakeError)
    try:
        await sock.send(frame)
        assert await sock.poll(10_000)
        err = dec.decode(await sock.recv())
        assert err.code in ("bad_message", "unknown_engine") and len(err.message) < 400
        assert "prefill-0" not in err.message  # never the list of engines
        assert await sock.poll(300) == 0  # exactly one reply
    finally:
        sock.close(0)
        ctx.term()


async def test_an_oversize_request_is_dropped_and_others_are_served(
        plain_server: HandshakeServer) -> None:
    ctx = zmq.asyncio.Context()
    big = ctx.socket(zmq.DEALER)
    big.connect(f"tcp://{plain_server.address}")
    cli = HandshakeClient(timeout_s=10)
    try:
        await big.send(b"\x00" * (1 << 20))
        assert await cli.fetch(plain_server.address or "", "prefill-0", 0) == INFO
        assert plain_server.requests_received == 1  # the oversize frame never arrived
    finally:
        big.close(0)
        ctx.term()
        await cli.close()


async def test_a_request_over_the_limit_is_refused_counted_and_answered() -> None:
    """Over the limit, under libzmq's cap (twice it): one bad_message naming the limit,
    counted as refused 'too_large'; the connection stays and is served."""
    refused: list[str] = []
    srv = HandshakeServer("127.0.0.1:0", lookup, max_message_bytes=64 << 10,
                          on_refuse=refused.append)
    await srv.start()
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://{srv.address}")
    dec = msgspec.msgpack.Decoder(HandshakeError)
    try:
        await sock.send(b"\x00" * (100 << 10))
        assert await sock.poll(10_000)
        err = dec.decode(await sock.recv())
        assert err.code == "bad_message" and "over this sidecar's limit of 65536" in err.message
        assert await sock.poll(300) == 0
        assert refused == ["too_large"] and srv.size_limit.refused == 1
        await sock.send(msgspec.msgpack.encode(HandshakeRequest("prefill-0", 0, req_id=9)))
        assert await sock.poll(10_000)
        assert msgspec.msgpack.decode(await sock.recv())["type"] == "reply"
    finally:
        sock.close(0)
        ctx.term()
        await srv.stop()


@pytest.mark.parametrize("frame", [
    b"\x81\xa2op\xa2\xff\xfe",  # a non-UTF-8 op
    b"\x83\xa2op\xa5claim\xa9engine_id\xa2\xff\xfe\xa6req_id\x05",  # a non-UTF-8 id in a claim
    b"\x82\xa2op\xa7abandon\xa6reason\xa2\xff\xfe",
])
def test_undecodable_control_messages_are_bad_control_not_a_crash(frame: bytes) -> None:
    """Found by the peer fuzzer: msgspec raises UnicodeDecodeError (not DecodeError)
    for a str field that is not UTF-8, which reached the server as an internal error."""
    from kvsidecar.daemon.peers import control

    op = control.op_of(frame)
    assert op in ("", "claim", "abandon")
    with pytest.raises(control.BadControl):
        control.decode_request(frame)
    assert control.request_id_of(frame) in (0, 5)


async def test_member_keys_dial_the_key_an_address_names_if_admitted(tmp_path: Path) -> None:
    """Each member its own keypair: a reader dials the key in P's address
    (``host:port/<hex>``) and nothing else; an address naming a key that is
    not admitted is not even dialled. The server tags the connection with the
    client's key: it reaches the control handler as the member."""
    import shutil

    for n in ("p", "d", "stranger"):
        generate_keys(tmp_path / n)
    shutil.copy(tmp_path / "d" / "sidecar.key", tmp_path / "p" / "authorized" / "d.key")
    shutil.copy(tmp_path / "p" / "sidecar.key", tmp_path / "d" / "authorized" / "p.key")
    p, d = load_keys(tmp_path / "p"), load_keys(tmp_path / "d")
    assert not p.shared and load_keys(tmp_path / "stranger").shared
    members: list[bytes] = []

    def answer(frame: bytes, member: bytes) -> bytes:
        members.append(member)
        return msgspec.msgpack.encode({"type": "control", "granted": False, "reason": "seen"})

    srv = HandshakeServer("127.0.0.1:0", lookup, keys=p, control=answer)
    addr = await srv.start()
    cli = HandshakeClient(timeout_s=10, keys=d)
    try:
        assert await cli.fetch(addr + p.address_tag, "prefill-0", 0) == INFO
        stranger = load_keys(tmp_path / "stranger").address_tag
        with pytest.raises(HandshakeFailed, match="no admitted fleet member's"):
            await cli.fetch(addr + stranger, "prefill-0", 0)
        bare = HandshakeClient(timeout_s=2, keys=d)
        try:  # an address naming no key: dialled with d's own key, which P does not serve
            with pytest.raises(HandshakeFailed, match="no answer"):
                await bare.fetch(addr, "prefill-0", 0)
        finally:
            await bare.close()
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = (
            d.public, d.secret, p.public)
        sock.connect(f"tcp://{addr}")
        try:
            await sock.send(peer_control.encode(peer_control.Claim(
                engine_id="prefill-0", tp_rank=0, agent_name="agent", request_id="r",
                reader_engine="D", reader_rank=0, reader_tp=1)))
            assert await asyncio.wait_for(sock.recv(), 10)
        finally:
            sock.close(0)
            ctx.term()
    finally:
        await cli.close()
        await srv.stop()
    assert members == [zmq.utils.z85.decode(d.public)]  # the claim came as member d
