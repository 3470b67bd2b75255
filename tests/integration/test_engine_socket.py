"""The engine socket's own defences, attacked through real sockets: file modes
under any umask, kernel peer credentials, a second server, bounded replies and
a connection flood.

The engine server runs in this process with a stand-in handler; what the
handler would do is the service's business (tests/e2e/test_security.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import stat
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvsidecar.daemon import engine_access
from kvsidecar.daemon.engine_access import (
    AccessPolicy,
    PeerCred,
    SocketInUse,
    current_peer,
    lock_socket,
    peer_cred,
    prepare_socket_dir,
    unlock_socket,
)
from kvsidecar.daemon.engine_server import ACCEPT_BURST, MAX_ERROR_CHARS, EngineServer
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
from kvsidecar.ipc.seqpacket import MAX_PACKET, Assembler, BlockingChannel, new_socket, packets

from .as_user import NOBODY, run_as
from .loop_turns import LoopTurns, connect_all, until


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


async def test_a_clean_stop_leaves_neither_socket_nor_lock(tmp_path: Path,
                                                           handler: Handler) -> None:
    """What the server made goes with it: the socket and ``<socket>.lock``."""
    s = EngineServer(str(tmp_path / "e.sock"), handler)
    await s.start()
    assert sorted(os.listdir(tmp_path)) == ["e.sock", "e.sock.lock"]
    await s.stop()
    assert os.listdir(tmp_path) == []


async def test_a_lock_file_left_by_a_killed_server_does_not_stop_a_start(
        tmp_path: Path, handler: Handler) -> None:
    """A process killed outright (SIGKILL) while holding the lock leaves the file;
    the kernel dropped its lock, so the next server takes it (and removes it at
    its stop)."""
    path = str(tmp_path / "e.sock")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: takes the lock, then waits to be killed
        try:
            os.close(r)
            lock_socket(path)
            os.write(w, b"locked")
            time.sleep(60)
        finally:
            os._exit(1)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            assert await asyncio.to_thread(f.read, 6) == b"locked"
        with pytest.raises(SocketInUse):  # the child holds it...
            lock_socket(path)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert os.path.exists(path + ".lock")  # ...and left it, killed
    s = EngineServer(path, handler)
    await s.start()
    async with AsyncSidecarClient(s.socket_path, timeout_s=10) as c:
        assert isinstance(await c.ping(), Pong)
    await s.stop()
    assert os.listdir(tmp_path) == []


def test_a_claimer_that_opened_a_lock_file_being_removed_starts_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """B opens the lock file A holds; A stops (removes the file, then releases it)
    and C starts (a new file, locked) before B's flock: B gets the old file's
    lock, finds its name leads elsewhere, opens the name again and is refused
    by C's lock. One holder at every moment."""
    path = str(tmp_path / "e.sock")
    fd_a = lock_socket(path)
    held: list[int] = []
    real_flock = engine_access.fcntl.flock

    def flock(fd: int, op: int) -> None:
        if not held:  # B's first flock: A stops and C starts meanwhile
            held.append(-1)
            unlock_socket(path, fd_a)
            held.append(lock_socket(path))
        real_flock(fd, op)

    monkeypatch.setattr(engine_access.fcntl, "flock", flock)
    with pytest.raises(SocketInUse, match="another sidecar is serving"):
        lock_socket(path)  # B
    monkeypatch.undo()
    fd_c = held[-1]
    assert os.stat(path + ".lock").st_ino == os.fstat(fd_c).st_ino  # C's file, C's lock
    with pytest.raises(SocketInUse):
        lock_socket(path)
    unlock_socket(path, fd_c)
    assert os.listdir(tmp_path) == []


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


async def test_a_flood_of_connects_is_taken_a_burst_per_loop_turn(
        tmp_path: Path, handler: Handler) -> None:
    """Connections waiting in the backlog are accepted (here refused) at most
    ACCEPT_BURST per wake-up of the listener: the loop serves everyone else in
    between. Before, one wake-up took the whole backlog, so a process spinning
    on connect() held the loop for as long as it kept the backlog filled."""
    turns = LoopTurns()
    seen: list[int] = []  # the loop's turn of each refusal
    s = EngineServer(str(tmp_path / "e.sock"), handler, max_connections=1,
                     on_refuse=lambda _reason: seen.append(turns.n))
    await s.start()
    n = 3 * ACCEPT_BURST
    flood: list[socket.socket] = []
    try:
        async with turns:
            flood = connect_all(s.socket_path, n + 1)  # one kept, n refused
            await until(lambda: len(seen) >= n)
    finally:
        for f in flood:
            f.close()
        await s.stop()
    assert len(seen) == n
    # the loop turned between every two bursts: no turn saw more than a burst
    assert max(seen.count(t) for t in set(seen)) <= ACCEPT_BURST, seen


def _ping_as(uid: int, path: str) -> dict[str, str]:
    """Connect to ``path`` from a child running as ``uid`` (gid ``uid``), send one
    ping and return its reply's type and message (or the error met)."""

    def ping() -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as c:
            c.settimeout(10)
            c.connect(path)
            c.send(encode_request(Ping(id=1)))
            reply = decode_reply(c.recv(MAX_PACKET))
        return {"type": type(reply).__name__, "message": getattr(reply, "message", "")}

    got = run_as(uid, ping)
    if "exception" in got:
        return {"type": "exception", "message": got["exception"]}
    return got


async def test_one_uid_cannot_take_every_connection_from_another(handler: Handler) -> None:
    """One admitted uid (this process) holds busy connections until it reaches its
    per-uid cap: the next is refused with one ``unavailable`` naming the uid and
    counted; another admitted uid (nobody, from a child) still gets in and is
    served. Before the cap, the first uid took all 8 slots and nobody was shut out."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the other user (nobody) is made by setuid in a child")
    workdir = Path(tempfile.mkdtemp(prefix="kvs-uid-", dir="/tmp"))
    os.chmod(workdir, 0o755)  # nobody must reach the socket's directory
    refused: list[str] = []
    # idle_grace_s: the connections count as busy (a flood that keeps pinging)
    s = EngineServer(str(workdir / "run" / "e.sock"), handler,
                     access=AccessPolicy.of(uids=[NOBODY]), max_connections=8,
                     max_connections_per_uid=4, idle_grace_s=3600, on_refuse=refused.append)
    await s.start()
    mine: list[socket.socket] = []
    try:
        for _ in range(8):
            c = new_socket()
            c.connect(s.socket_path)
            mine.append(c)
        while s.refused_uid_connections < 4:
            await asyncio.sleep(0.01)
        assert s.connections == 4 and refused == ["uid_connection_limit"] * 4
        last = mine[-1]  # refused: one error that says why, then the end
        last.settimeout(30)
        err = decode_reply(last.recv(4096))
        assert isinstance(err, Error) and err.code == "unavailable"
        assert (f"uid {os.geteuid()} already holds 4 connections to this sidecar, the limit "
                "per uid (--max-engine-connections-per-uid)") in err.message
        assert last.recv(4096) == b""
        got = await asyncio.to_thread(_ping_as, NOBODY, s.socket_path)
        assert got["type"] == "Pong", got
        assert handler.peers[-1] is not None and handler.peers[-1].uid == NOBODY
        assert s.refused_connections == 0 and s.forbidden == 0
    finally:
        for c in mine:
            c.close()
        await s.stop()
        shutil.rmtree(workdir, ignore_errors=True)


async def test_at_its_cap_a_uid_makes_room_from_its_own_idle_connections(
        tmp_path: Path, handler: Handler) -> None:
    """At its cap, a uid's own connection idle longest is closed for its new one
    (counted idle_evicted); nothing of another uid is touched."""
    refused: list[str] = []
    s = EngineServer(str(tmp_path / "e.sock"), handler,
                     access=AccessPolicy.of(uids=[os.geteuid() + 4242]), max_connections=8,
                     max_connections_per_uid=2, idle_grace_s=0.0, on_refuse=refused.append)
    await s.start()
    mine: list[socket.socket] = []
    try:
        for _ in range(3):
            c = new_socket()
            c.connect(s.socket_path)
            mine.append(c)
        while len(refused) < 1:
            await asyncio.sleep(0.01)
        assert refused == ["idle_evicted"] and s.connections == 2
        assert s.refused_uid_connections == 0
        mine[0].settimeout(30)
        assert mine[0].recv(4096) == b""  # the first, idle longest, was closed
    finally:
        for c in mine:
            c.close()
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


def _long_ping(id: int, nbytes: int) -> bytes:
    """A valid ping over one packet (an unknown field pads it; msgspec skips it)."""
    return msgspec.msgpack.encode({"op": "ping", "id": id, "v": 1, "pad": "x" * nbytes})


async def test_a_long_message_not_whole_in_time_is_refused_and_closed(
        tmp_path: Path, handler: Handler) -> None:
    """A slowloris: a header, one chunk, then silence. After the long-message
    timeout: one bad_message reply saying so, the connection closed, the bytes
    it announced given back; others are served all along."""
    refused: list[str] = []
    s = EngineServer(str(tmp_path / "e.sock"), handler, long_message_timeout_s=0.3,
                     on_refuse=refused.append)
    await s.start()
    data = _long_ping(1, 3 * MAX_PACKET)

    def stall() -> dict[str, object]:
        with BlockingChannel(s.socket_path) as chan:
            head, first = packets(data)[:2]
            chan.send(bytes(head))
            chan.send(bytes(first))
            err: dict[str, object] = msgspec.msgpack.decode(chan.recv())
            with pytest.raises(EOFError):
                chan.recv()
            return err

    try:
        stalled = asyncio.ensure_future(asyncio.to_thread(stall))
        while s.assembling_bytes != len(data):
            await asyncio.sleep(0.01)
        async with AsyncSidecarClient(s.socket_path, timeout_s=10) as c:
            assert isinstance(await c.ping(), Pong)  # served while the other stalls
        err = await stalled
        assert err["code"] == "bad_message"
        assert (f"a message of {len(data)} bytes did not arrive whole within 0.3 s of its "
                f"header ({MAX_PACKET} bytes came)") in str(err["message"])
        assert refused == ["slow_message"] and s.slow_messages == 1
        assert s.assembling_bytes == 0 and s.connections == 0
    finally:
        await s.stop()


async def test_long_messages_under_way_are_bounded_together(
        tmp_path: Path, handler: Handler) -> None:
    """Headers may announce at most max_assembling_bytes at once over all
    connections: the next gets one ``unavailable`` reply and is closed; once a
    sender finished or left, long messages are taken again, whole."""
    refused: list[str] = []
    data = _long_ping(5, 2 * MAX_PACKET)
    s = EngineServer(str(tmp_path / "e.sock"), handler, max_assembling_bytes=2 * len(data),
                     on_refuse=refused.append)
    await s.start()

    def attack() -> None:
        stalled = [BlockingChannel(s.socket_path) for _ in range(2)]
        try:
            for chan in stalled:
                chan.send(bytes(packets(data)[0]))  # header only, then silence
            while s.assembling_bytes != 2 * len(data):
                time.sleep(0.01)
            with BlockingChannel(s.socket_path) as third:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    third.send(data)
                err = msgspec.msgpack.decode(third.recv())
                assert err["code"] == "unavailable", err
                assert f"over this sidecar's limit of {2 * len(data)} bytes at once" \
                    in err["message"]
                with pytest.raises(EOFError):
                    third.recv()
            with BlockingChannel(s.socket_path) as short:  # one-packet messages still pass
                short.send(msgspec.msgpack.encode({"op": "ping", "id": 6, "v": 1}))
                assert msgspec.msgpack.decode(short.recv())["op"] == "pong"
        finally:
            for chan in stalled:
                chan.close()

    try:
        await asyncio.to_thread(attack)
        assert refused == ["assembly_limit"] and s.refused_assembling == 1
        while s.assembling_bytes:  # the stalled connections' ends are read
            await asyncio.sleep(0.01)
        with BlockingChannel(s.socket_path) as chan:
            await asyncio.to_thread(chan.send, data)  # the server reads on this thread
            reply = msgspec.msgpack.decode(await asyncio.to_thread(chan.recv))
        assert reply["op"] == "pong" and reply["id"] == 5
    finally:
        await s.stop()


def test_a_long_message_in_one_byte_packets_costs_its_length_not_more() -> None:
    """A sender may chunk a long message as finely as it likes; what the receiver
    holds is the bytes (a list of 1-byte objects would cost 41 bytes each)."""
    length = 200_000
    asm = Assembler(1 << 20)
    assert asm.feed(memoryview(packets(b"\x90" * (MAX_PACKET + 1))[0])) is None
    asm.reset()
    head = memoryview(bytes(packets(b"a" * length)[0]))
    one = memoryview(b"a")
    tracemalloc.start()
    try:
        assert asm.feed(head) is None
        for _ in range(length - 1):
            assert asm.feed(one) is None
        _, peak = tracemalloc.get_traced_memory()
        message = asm.feed(one)
    finally:
        tracemalloc.stop()
    assert message == b"a" * length and not asm.assembling
    assert peak < 2 * length, peak
