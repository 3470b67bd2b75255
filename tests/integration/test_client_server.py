"""Engine clients against the engine server over real Unix (SEQPACKET) sockets,
with a test double standing in for the daemon's request handler."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvsidecar.daemon.engine_access import SocketInUse
from kvsidecar.daemon.engine_server import EngineServer, RequestError
from kvsidecar.ipc.client import (
    AsyncSidecarClient,
    BadMessage,
    BadRequest,
    Duplicate,
    Forbidden,
    HoldSpec,
    InternalError,
    ReadSpec,
    SidecarClient,
    SidecarError,
    SidecarTimeout,
    Unavailable,
    UnknownEngine,
    block_id_lists,
)
from kvsidecar.ipc.layout import attention_layout
from kvsidecar.ipc.memory import RegionError, ShmRegion, allocate_for_layout
from kvsidecar.ipc.protocol import (
    BAD_MESSAGE,
    BAD_REQUEST,
    DUPLICATE,
    FORBIDDEN,
    PROTOCOL_VERSION,
    UNKNOWN_ENGINE,
    VERSION,
    Batch,
    Completion,
    Completions,
    Deregister,
    Error,
    Held,
    Hold,
    Ok,
    Ping,
    Poll,
    Pong,
    Read,
    Register,
    Registered,
    RemoteEngine,
    Reply,
    Request,
    ShmRef,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)
from kvsidecar.ipc.seqpacket import MAX_PACKET, BlockingChannel, new_socket, packets

LAYOUT = attention_layout(model="m", num_layers=2, total_kv_heads=2, head_dim=8, block_tokens=4,
                          tp_size=1, num_blocks=4)
REMOTE = RemoteEngine("p0", 1, ["127.0.0.1:7000"])


class HandlerDouble:
    """A test double of the daemon's request handler: records every request and
    answers like a tiny daemon; special request ids trigger failures."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.engines: dict[str, Register] = {}
        self.allocated: dict[str, list[ShmRegion]] = {}
        self.pending: dict[str, list[Completion]] = {}
        self.slow_s = 0.0
        self.bogus_refs = False

    async def handle(self, req: Request) -> Reply:
        self.requests.append(req)
        if isinstance(req, Ping):
            return Pong(PROTOCOL_VERSION, sorted(self.engines))
        if isinstance(req, Register):
            return self._register(req)
        if isinstance(req, Batch):  # as a sidecar older than minor 5
            raise RequestError(BAD_MESSAGE, "unknown op 'batch'")
        if req.engine_id not in self.engines:
            raise RequestError(UNKNOWN_ENGINE, f"engine {req.engine_id!r} is not registered")
        if isinstance(req, Deregister):
            del self.engines[req.engine_id]
            for r in self.allocated.pop(req.engine_id, []):
                r.close()
                r.unlink()
            return Ok()
        if isinstance(req, Poll):
            return Completions(self.pending.pop(req.engine_id, []))
        if isinstance(req, Read):
            return await self._read(req)
        if isinstance(req, Hold) and any(b >= LAYOUT.num_blocks for g in req.block_ids
                                         for b in g):
            raise RequestError(BAD_REQUEST, "held block id out of range")
        kind = "sent" if isinstance(req, Hold) else "aborted"
        self.pending.setdefault(req.engine_id, []).append(Completion(req.request_id, kind))
        return Held(10.0, req.timeout_s or 120.0) if isinstance(req, Hold) else Ok()

    def _register(self, req: Register) -> Reply:
        if req.engine_id in self.engines:
            raise RequestError(DUPLICATE, f"engine {req.engine_id!r} is already registered")
        self.engines[req.engine_id] = req
        refs: list[ShmRef] = []
        if req.mode == "allocate":
            regions = allocate_for_layout(req.layout, "kvtest")
            self.allocated[req.engine_id] = regions
            refs = [r.ref() for r in regions]
            if self.bogus_refs:
                refs[-1] = ShmRef("kvtest-never-created", 64)
        return Registered(req.engine_id, "127.0.0.1:7100", f"agent-{req.engine_id}", refs)

    async def _read(self, req: Read) -> Reply:
        if req.request_id == "boom":
            raise RuntimeError("boom in the handler")
        if req.request_id == "not-a-reply":
            return "ok"  # type: ignore[return-value]
        if req.request_id == "unencodable":
            return Pong(object())  # type: ignore[arg-type]
        if req.request_id.startswith("slow"):
            await asyncio.sleep(self.slow_s)
        if any(b >= LAYOUT.num_blocks for g in req.local_block_ids for b in g):
            raise RequestError(BAD_REQUEST, "local block id out of range")
        nbytes = sum(map(len, req.local_block_ids)) * LAYOUT.page_bytes
        self.pending.setdefault(req.engine_id, []).append(
            Completion(req.request_id, "received", nbytes=nbytes))
        return Ok()

    def cleanup(self) -> None:
        for regions in self.allocated.values():
            for r in regions:
                r.close()
                r.unlink()


class ServerThread:
    """The engine server on its own event loop thread, as the sync client sees a daemon."""

    def __init__(self, path: str, handler: HandlerDouble) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = EngineServer(path, handler)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "run" / "sidecar.sock")  # parent does not exist yet


@pytest.fixture
def handler() -> Iterator[HandlerDouble]:
    h = HandlerDouble()
    yield h
    h.cleanup()


@pytest.fixture
def threaded(path: str, handler: HandlerDouble) -> Iterator[ServerThread]:
    st = ServerThread(path, handler)
    st.start()
    yield st
    st.stop()


@pytest.fixture
def client(path: str, threaded: ServerThread) -> Iterator[SidecarClient]:
    with SidecarClient(path, timeout_s=5.0) as c:
        yield c


@pytest.fixture
async def server(path: str, handler: HandlerDouble) -> AsyncIterator[EngineServer]:
    s = EngineServer(path, handler)
    await s.start()
    yield s
    await s.stop()


@pytest.fixture
async def aclient(path: str, server: EngineServer) -> AsyncIterator[AsyncSidecarClient]:
    async with AsyncSidecarClient(path, timeout_s=5.0) as c:
        yield c


# --------------------------------------------------------------------------
# Synchronous client
# --------------------------------------------------------------------------


def test_sync_round_trip_of_every_call(client: SidecarClient, handler: HandlerDouble) -> None:
    engine_regions = allocate_for_layout(LAYOUT, "kvtest")
    try:
        reg = client.register("d0", 0, LAYOUT, regions=engine_regions)
        assert (reg.engine_id, reg.handshake_address, reg.agent_name) == (
            "d0", "127.0.0.1:7100", "agent-d0")
        assert reg.regions == engine_regions
        sent = handler.requests[-1]
        assert isinstance(sent, Register) and sent.mode == "attach"
        assert sent.regions == [r.ref() for r in engine_regions] and sent.pid == os.getpid()

        client.read("d0", "r1", [[0, 1]], REMOTE, [[2, 3]], remote_request_id="p-r1",
                    skip_tokens=4)
        read = handler.requests[-1]
        assert isinstance(read, Read)
        assert (read.local_block_ids, read.remote_block_ids) == ([[0, 1]], [[2, 3]])
        assert (read.remote, read.remote_request_id, read.skip_tokens) == (REMOTE, "p-r1", 4)

        client.hold("d0", "h1", [[3]], readers=2, timeout_s=1.5)
        hold = handler.requests[-1]
        assert isinstance(hold, Hold) and (hold.readers, hold.timeout_s) == (2, 1.5)
        client.release("d0", "h1")

        assert [(c.request_id, c.kind) for c in client.poll("d0")] == [
            ("r1", "received"), ("h1", "sent"), ("h1", "aborted")]
        assert client.poll("d0") == []
        pong = client.ping()
        assert pong.version == PROTOCOL_VERSION and pong.engines == ["d0"]
        client.deregister("d0")
        assert client.ping().engines == []
        ids = [r.id for r in handler.requests]
        assert len(set(ids)) == len(ids)  # one id per call
    finally:
        for r in engine_regions:
            r.close()
            r.unlink()


def test_sync_allocate_mode_maps_the_daemons_regions(client: SidecarClient,
                                                      handler: HandlerDouble) -> None:
    reg = client.register("d0", 0, LAYOUT, allocate=True, keep_on_exit=True)
    sent = handler.requests[-1]
    assert isinstance(sent, Register) and sent.mode == "allocate" and sent.keep_on_exit
    daemon_side = handler.allocated["d0"]
    assert [r.ref() for r in reg.regions] == [r.ref() for r in daemon_side]
    for i, (mine, theirs) in enumerate(zip(reg.regions, daemon_side)):
        assert not mine.owner and mine.address != theirs.address
        theirs.numpy()[:8] = i + 1  # the daemon writes (as a NIXL read would) ...
        assert list(mine.numpy()[:8]) == [i + 1] * 8  # ... the engine sees it, no copy
        mine.close()


def test_sync_allocate_mode_unmappable_refs_deregister(client: SidecarClient,
                                                        handler: HandlerDouble) -> None:
    handler.bogus_refs = True
    with pytest.raises(RegionError, match="does not exist"):
        client.register("d0", 0, LAYOUT, allocate=True)
    assert isinstance(handler.requests[-1], Deregister)
    assert "d0" not in handler.engines


def test_register_needs_exactly_one_mode(client: SidecarClient) -> None:
    with pytest.raises(ValueError, match="either"):
        client.register("d0", 0, LAYOUT)
    with pytest.raises(ValueError, match="either"):
        client.register("d0", 0, LAYOUT, regions=[], allocate=True)


def test_sync_typed_errors(client: SidecarClient, handler: HandlerDouble) -> None:
    with pytest.raises(UnknownEngine, match="not registered") as info:
        client.poll("nobody")
    assert info.value.code == UNKNOWN_ENGINE
    client.register("d0", 0, LAYOUT, allocate=True)
    with pytest.raises(Duplicate):
        client.register("d0", 0, LAYOUT, allocate=True)
    with pytest.raises(BadRequest, match="out of range"):
        client.read("d0", "r", [[99]], REMOTE, [[0]])
    with pytest.raises(InternalError, match="RuntimeError: boom in the handler"):
        client.read("d0", "boom", [[0]], REMOTE, [[0]])
    with pytest.raises(InternalError, match="not a reply"):
        client.read("d0", "not-a-reply", [[0]], REMOTE, [[0]])
    with pytest.raises(InternalError, match="unencodable"):
        client.read("d0", "unencodable", [[0]], REMOTE, [[0]])
    assert client.ping().engines == ["d0"]  # still serving


def test_server_counters(client: SidecarClient, threaded: ServerThread) -> None:
    client.ping()
    with pytest.raises(SidecarError):
        client.poll("nobody")
    client.register("d0", 0, LAYOUT, allocate=True)
    with pytest.raises(InternalError):
        client.read("d0", "boom", [[0]], REMOTE, [[0]])
    s = threaded.server
    assert (s.messages, s.errors, s.internal_errors, s.bad_messages) == (4, 2, 1, 0)


def test_numpy_block_ids(client: SidecarClient, handler: HandlerDouble) -> None:
    client.register("d0", 0, LAYOUT, allocate=True)
    client.read("d0", "r", np.array([[0, 1], [2, 3]], dtype=np.int32), REMOTE,
                [np.array([1, 2], dtype=np.uint64), np.arange(2)])
    read = handler.requests[-1]
    assert isinstance(read, Read)
    assert read.local_block_ids == [[0, 1], [2, 3]] and read.remote_block_ids == [[1, 2], [0, 1]]
    assert all(type(b) is int for g in read.local_block_ids for b in g)
    client.hold("d0", "h", (range(2), [np.int64(3)]))
    hold = handler.requests[-1]
    assert isinstance(hold, Hold) and hold.block_ids == [[0, 1], [3]]


def test_block_id_conversion_rejects_what_is_not_ids() -> None:
    with pytest.raises(TypeError, match="integer"):
        block_id_lists(np.zeros((1, 2)))
    with pytest.raises(TypeError, match="2-D"):
        block_id_lists(np.arange(3))
    with pytest.raises(TypeError, match="one sequence per"):
        block_id_lists([1, 2])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        block_id_lists([[1.5]])  # type: ignore[list-item]
    # bools are ints in Python, but ids never: a mask passed for ids is refused
    # as a numpy bool array is
    for mask in ([[True, False]], [[1, True]], [[np.True_]], [np.array([True])]):
        with pytest.raises(TypeError, match="bool"):
            block_id_lists(mask)  # type: ignore[arg-type]


def test_sync_timeout_without_server(tmp_path: Path) -> None:
    with SidecarClient(str(tmp_path / "nobody.sock"), timeout_s=0.2) as c:
        t0 = time.monotonic()
        with pytest.raises(SidecarTimeout, match=r"within 0\.2 s") as info:
            c.ping()
        assert 0.15 < time.monotonic() - t0 < 2.0
        assert info.value.code == "timeout" and isinstance(info.value, SidecarError)


def test_a_stream_socket_at_the_path_is_named_not_waited_for(tmp_path: Path) -> None:
    """A SOCK_STREAM listener at the path (an older, ZMQ-based sidecar): the
    kernel refuses the connect (EPROTOTYPE) and the client says so at once, for
    both clients, instead of waiting out the timeout."""
    path = str(tmp_path / "old.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    with listener, SidecarClient(path, timeout_s=30) as c:
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="a stream socket, not the sidecar's SOCK_SEQPACKET"):
            c.ping()
        assert time.monotonic() - t0 < 10

        async def ping() -> None:
            async with AsyncSidecarClient(path, timeout_s=30) as a:
                await a.ping()

        with pytest.raises(Unavailable, match="a stream socket, not the sidecar's SOCK_SEQPACKET"):
            asyncio.run(ping())


def test_sync_client_reaches_a_daemon_started_after_a_timeout(path: str,
                                                              handler: HandlerDouble) -> None:
    with SidecarClient(path, timeout_s=0.2) as c:
        with pytest.raises(SidecarTimeout):
            c.ping()
        st = ServerThread(path, handler)
        st.start()
        try:
            c.timeout_s = 5.0
            assert c.ping().version == PROTOCOL_VERSION
            assert len(handler.requests) == 1  # the timed-out ping was dropped with its socket
        finally:
            st.stop()


def test_sync_late_reply_is_not_taken_for_the_next_call(client: SidecarClient,
                                                        handler: HandlerDouble,
                                                        path: str) -> None:
    client.register("d0", 0, LAYOUT, allocate=True)
    handler.slow_s = 0.6
    with SidecarClient(path, timeout_s=0.3) as impatient:
        with pytest.raises(SidecarTimeout):
            impatient.read("d0", "slow-1", [[0]], REMOTE, [[0]])
        time.sleep(0.5)  # the late Ok for slow-1 is sent meanwhile
        assert impatient.poll("d0") == [Completion("slow-1", "received",
                                                   nbytes=LAYOUT.page_bytes)]


# --------------------------------------------------------------------------
# Malformed input over raw sockets: answered, and the server keeps serving
# --------------------------------------------------------------------------


def _channel(path: str) -> BlockingChannel:
    return BlockingChannel(path, timeout_s=5.0)


def _exchange(chan: BlockingChannel, payload: bytes) -> Reply:
    chan.send(payload)
    return decode_reply(chan.recv())


@pytest.mark.parametrize(
    ("payload", "code", "id", "needle"),
    [
        (b"\xc1garbage", BAD_MESSAGE, -1, "malformed"),
        (b"", BAD_MESSAGE, -1, "undecodable"),
        (msgspec.msgpack.encode([1, 2]), BAD_MESSAGE, -1, "object"),
        (msgspec.msgpack.encode({"op": "explode", "id": 8, "v": 1}), BAD_MESSAGE, 8, "explode"),
        (msgspec.msgpack.encode({"op": "poll", "id": 9, "v": 1, "engine_id": ["x"]}),
         BAD_MESSAGE, 9, "$.engine_id"),
        (msgspec.msgpack.encode({"op": "poll", "id": 10, "v": 1}), BAD_MESSAGE, 10,
         "engine_id"),
        (msgspec.msgpack.encode({"op": "ping", "id": 11, "v": 99}), VERSION, 11, "v=99"),
    ],
    ids=["garbage", "empty", "array", "unknown-op", "wrong-type", "missing-field", "version"],
)
def test_malformed_requests(threaded: ServerThread, path: str, payload: bytes, code: str,
                            id: int, needle: str) -> None:
    with _channel(path) as bad, _channel(path) as good:
        err = _exchange(bad, payload)
        assert isinstance(err, Error) and err.code == code and err.id == id
        assert needle in err.message
        if code == VERSION:
            assert f"v={PROTOCOL_VERSION}" in err.message
        # The same client and another one are still served.
        assert _exchange(bad, encode_request(Ping(id=1))) == Pong(PROTOCOL_VERSION, [], id=1)
        assert _exchange(good, encode_request(Ping(id=2))) == Pong(PROTOCOL_VERSION, [], id=2)
    assert threaded.server.bad_messages == 1


def test_a_message_longer_than_its_header_said_closes_the_connection(
        threaded: ServerThread, path: str) -> None:
    """Chunks past the announced length: one bad_message reply, then the end (the
    connection is out of step); others are still served."""
    header = packets(b"x" * (MAX_PACKET + 10))[0]
    with _channel(path) as s, _channel(path) as good:
        s.send(header)
        s.send(b"y" * MAX_PACKET)
        s.send(b"y" * 100)
        err = decode_reply(s.recv())
        assert isinstance(err, Error) and err.code == BAD_MESSAGE and "announced" in err.message
        with pytest.raises(EOFError):
            s.recv()
        assert isinstance(_exchange(good, encode_request(Ping(id=4))), Pong)


def test_a_long_message_arrives_whole(threaded: ServerThread, path: str) -> None:
    """A request over one packet goes in chunks and is read whole: its id and
    the field at its end are found (an over-long epoch, refused by name)."""
    with _channel(path) as s:
        data = encode_request(Poll(id=7, engine_id="e", epoch="z" * (MAX_PACKET + 100)))
        assert len(packets(data)) == 3
        err = _exchange(s, data)
        assert isinstance(err, Error) and err.id == 7 and "epoch" in err.message


def _fake_daemon(path: str, *answers: Callable[[socket.socket], None]) -> threading.Thread:
    """A bare listener at ``path`` whose connections, one after another, are
    handled by ``answers`` in turn (in a thread): what a daemon could send that
    the real one does not."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    listener = new_socket()
    listener.bind(path)
    listener.listen()

    def run() -> None:
        with listener:
            for answer in answers:
                conn, _ = listener.accept()
                with conn:
                    answer(conn)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_sync_client_error_without_id(tmp_path: Path) -> None:
    """A daemon that cannot read our id still answers this (single) call."""
    fake = str(tmp_path / "fake.sock")

    def answer(conn: socket.socket) -> None:
        conn.recv(MAX_PACKET)
        conn.send(encode_reply(Error(BAD_MESSAGE, "what?")))

    t = _fake_daemon(fake, answer)
    with SidecarClient(fake, timeout_s=5.0) as c:
        with pytest.raises(SidecarError, match=r"what\?") as info:
            c.ping()
        assert info.value.code == BAD_MESSAGE
    t.join()


def test_sync_client_a_long_reply(tmp_path: Path) -> None:
    """A reply over one packet (many completions) arrives in chunks and whole."""
    fake = str(tmp_path / "fake.sock")
    items = [Completion(f"r{i:06d}" + "x" * 40, "received") for i in range(3000)]

    def answer(conn: socket.socket) -> None:
        req = decode_request(conn.recv(MAX_PACKET))
        for p in packets(encode_reply(Completions(items, id=req.id))):
            conn.send(p)

    t = _fake_daemon(fake, answer)
    with SidecarClient(fake, timeout_s=5.0) as c:
        assert c.poll("d0") == items
    t.join()


def test_sync_client_a_daemon_that_closes_without_answering(tmp_path: Path) -> None:
    """The request was read, no reply came: as after a timeout, its fate is unknown."""
    fake = str(tmp_path / "fake.sock")
    t = _fake_daemon(fake, lambda conn: conn.recv(MAX_PACKET) and None)
    with SidecarClient(fake, timeout_s=5.0) as c, \
            pytest.raises(SidecarTimeout, match="closed the connection before answering"):
        c.ping()
    t.join()


def _unusual(what: str, more: list[bytes]) -> Callable[[socket.socket], None]:
    """A fake daemon that answers the connection's first request (a ping: it
    opens the connection and sets its timeout, so the next call takes the sync
    client's common path) and the second one unusually (``what``); then it
    keeps what else the client sends until it closes in ``more``."""
    def answer(conn: socket.socket) -> None:
        first = decode_request(conn.recv(MAX_PACKET))
        conn.send(encode_reply(Pong(PROTOCOL_VERSION, id=first.id)))
        req = decode_request(conn.recv(MAX_PACKET))
        if what == "stale":
            conn.send(encode_reply(Pong(PROTOCOL_VERSION, id=req.id + 100)))  # not ours
            conn.send(encode_reply(Pong(PROTOCOL_VERSION, engines=["right"], id=req.id)))
        elif what == "long":
            items = [Completion(f"r{i:06d}" + "x" * 40, "received") for i in range(3000)]
            for p in packets(encode_reply(Completions(items, last=3000, id=req.id))):
                conn.send(p)
        elif what == "no-id":
            conn.send(encode_reply(Error(BAD_MESSAGE, "what?")))
        elif what == "garbage":
            conn.send(b"\x92\x01")  # msgpack, but no reply
        elif what == "close":
            return
        while data := conn.recv(MAX_PACKET):  # "silence": until the client gives up
            more.append(data)
    return answer


@pytest.mark.parametrize(("what", "expect"), [
    ("stale", "right"),
    ("long", 3000),
    ("no-id", (SidecarError, r"what\?")),
    ("garbage", (SidecarError, "undecodable reply")),
    ("close", (SidecarTimeout, "closed the connection before answering")),
    ("silence", (SidecarTimeout, "no reply to Ping within 0.5 s")),
])
def test_sync_client_on_an_open_connection_every_unusual_reply(
        tmp_path: Path, what: str, expect: object) -> None:
    """The unusual replies above, on a connection already open: the sync
    client's common path hands each to the general one, which handles it as on
    a new connection and does not send the request again."""
    fake, more = str(tmp_path / "fake.sock"), list[bytes]()
    t = _fake_daemon(fake, _unusual(what, more))
    # Only "silence" waits out the timeout; the others must not depend on speed
    # (a 3,000-completion reply on a loaded machine can take longer than 0.5 s).
    with SidecarClient(fake, timeout_s=0.5 if what == "silence" else 30.0) as c:
        assert isinstance(c.ping(), Pong)
        if isinstance(expect, tuple):
            kind, match = expect
            with pytest.raises(kind, match=match):
                c.ping()
        elif what == "long":
            assert len(c.poll("d0")) == expect
        else:
            assert c.ping().engines == [expect]
    t.join(5)
    assert not t.is_alive() and more == []


def test_sync_client_in_a_forked_child_gets_its_own_connection(client: SidecarClient,
                                                              handler: HandlerDouble) -> None:
    """A child forked after the first call must not read its parent's replies."""
    assert client.ping().version == PROTOCOL_VERSION
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            code = 0 if client.ping().version == PROTOCOL_VERSION else 1
        finally:
            os._exit(code)
    assert client.ping().version == PROTOCOL_VERSION
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client.ping().version == PROTOCOL_VERSION
    assert len(handler.requests) == 4


def test_sync_client_survives_a_daemon_restart(path: str, handler: HandlerDouble) -> None:
    """A connection the old daemon closed is replaced on the next call."""
    with SidecarClient(path, timeout_s=5.0) as c:
        for _ in range(2):
            st = ServerThread(path, handler)
            st.start()
            try:
                assert c.ping().version == PROTOCOL_VERSION
            finally:
                st.stop()
    assert len(handler.requests) == 2


# --------------------------------------------------------------------------
# Server lifecycle
# --------------------------------------------------------------------------


async def test_server_creates_dir_and_removes_socket_on_stop(path: str,
                                                             handler: HandlerDouble) -> None:
    s = EngineServer(path, handler)
    await s.start()
    assert Path(path).is_socket()
    with pytest.raises(RuntimeError, match="already started"):
        await s.start()
    await s.stop()
    assert not Path(path).exists()
    await s.stop()  # idempotent


async def test_server_replaces_a_stale_socket(path: str, handler: HandlerDouble) -> None:
    Path(path).parent.mkdir(parents=True)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays, nobody listens: what a crashed daemon leaves
    s = EngineServer(path, handler)
    await s.start()
    async with AsyncSidecarClient(path, timeout_s=5.0) as c:
        assert isinstance(await c.ping(), Pong)
    await s.stop()


async def test_server_refuses_a_live_socket(server: EngineServer, path: str,
                                            handler: HandlerDouble) -> None:
    with pytest.raises(SocketInUse, match="another sidecar is serving"):
        await EngineServer(path, handler).start()
    async with AsyncSidecarClient(path, timeout_s=5.0) as c:
        assert isinstance(await c.ping(), Pong)  # the first server is untouched


async def test_server_refuses_a_socket_another_process_serves(path: str,
                                                              handler: HandlerDouble) -> None:
    Path(path).parent.mkdir(parents=True, mode=0o700)
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(path)
    live.listen()  # not a sidecar (no lock), but it answers: never remove it
    try:
        with pytest.raises(SocketInUse, match="another process is serving"):
            await EngineServer(path, handler).start()
        assert Path(path).exists()
    finally:
        live.close()


async def test_server_refuses_to_replace_a_regular_file(tmp_path: Path,
                                                        handler: HandlerDouble) -> None:
    f = tmp_path / "precious"
    f.write_text("data")
    with pytest.raises(FileExistsError):
        await EngineServer(str(f), handler).start()
    assert f.read_text() == "data"


async def test_server_rejects_an_overlong_path(tmp_path: Path, handler: HandlerDouble) -> None:
    with pytest.raises(ValueError, match="longer than"):
        await EngineServer(str(tmp_path / ("x" * 120)), handler).start()


# --------------------------------------------------------------------------
# asyncio client
# --------------------------------------------------------------------------


async def test_async_round_trip_of_every_call(aclient: AsyncSidecarClient,
                                              handler: HandlerDouble) -> None:
    reg = await aclient.register("d0", 1, LAYOUT, allocate=True)
    assert reg.agent_name == "agent-d0" and len(reg.regions) == LAYOUT.num_regions
    handler.allocated["d0"][0].numpy()[0] = 77
    assert reg.regions[0].numpy()[0] == 77
    for r in reg.regions:
        r.close()
    await aclient.read("d0", "r1", np.array([[0, 1]]), REMOTE, [[2, 3]], skip_tokens=0)
    await aclient.hold("d0", "h1", [[2]], readers=3)
    await aclient.release("d0", "h1")
    assert [c.kind for c in await aclient.poll("d0")] == ["received", "sent", "aborted"]
    assert (await aclient.ping()).engines == ["d0"]
    await aclient.deregister("d0")
    assert [type(r).__name__ for r in handler.requests] == [
        "Register", "Read", "Hold", "Release", "Poll", "Ping", "Deregister"]


async def test_async_typed_errors_and_still_serving(aclient: AsyncSidecarClient) -> None:
    with pytest.raises(UnknownEngine):
        await aclient.deregister("ghost")
    await aclient.register("d0", 0, LAYOUT, allocate=True)
    with pytest.raises(InternalError, match="boom"):
        await aclient.read("d0", "boom", [[0]], REMOTE, [[0]])
    with pytest.raises(BadRequest):
        await aclient.read("d0", "r", [[7]], REMOTE, [[0]])
    assert (await aclient.ping()).engines == ["d0"]


async def test_async_many_outstanding_calls(path: str, server: EngineServer,
                                            aclient: AsyncSidecarClient) -> None:
    await aclient.register("d0", 0, LAYOUT, allocate=True)
    results = await asyncio.gather(*(
        aclient.read("d0", f"r{i}", [[i % 4]], REMOTE, [[0]]) if i % 3 else aclient.ping()
        for i in range(30)
    ))
    assert all(r is None or isinstance(r, Pong) for r in results)
    assert [isinstance(r, Pong) for r in results] == [i % 3 == 0 for i in range(30)]
    done = await aclient.poll("d0")
    assert sorted(c.request_id for c in done) == sorted(f"r{i}" for i in range(30) if i % 3)
    # Two clients at once, interleaved.
    async with AsyncSidecarClient(path) as other:
        a, b = await asyncio.gather(aclient.ping(), other.ping())
        assert a.engines == b.engines == ["d0"] and (a.id, b.id) == (33, 1)


async def test_async_replies_out_of_order_are_matched_by_id(path: str) -> None:
    """A fake daemon answers three calls in reverse order."""

    def answer(conn: socket.socket) -> None:
        got = [decode_request(conn.recv(MAX_PACKET)) for _ in range(3)]
        for req in reversed(got):
            assert isinstance(req, Poll)
            item = Completion(req.engine_id, "received")
            conn.send(encode_reply(Completions([item], id=req.id)))

    t = _fake_daemon(path, answer)
    async with AsyncSidecarClient(path, timeout_s=5.0) as c:
        out = await asyncio.gather(c.poll("a"), c.poll("b"), c.poll("c"))
    assert [items[0].request_id for items in out] == ["a", "b", "c"]
    t.join()


async def test_async_client_survives_a_daemon_restart(path: str,
                                                      handler: HandlerDouble) -> None:
    async with AsyncSidecarClient(path, timeout_s=5.0) as c:
        for _ in range(2):
            s = EngineServer(path, handler)
            await s.start()
            try:
                assert isinstance(await c.ping(), Pong)
            finally:
                await s.stop()
        assert len(handler.requests) == 2


async def test_async_timeout_without_server(tmp_path: Path) -> None:
    async with AsyncSidecarClient(str(tmp_path / "nobody.sock"), timeout_s=0.2) as c:
        t0 = time.monotonic()
        results = await asyncio.gather(c.ping(), c.poll("x"), return_exceptions=True)
        assert all(isinstance(r, SidecarTimeout) for r in results)
        assert time.monotonic() - t0 < 2.0


async def test_async_timeout_then_late_reply_is_dropped(path: str, server: EngineServer,
                                                        handler: HandlerDouble) -> None:
    async with AsyncSidecarClient(path, timeout_s=0.2) as c:
        await c.register("d0", 0, LAYOUT, allocate=True)
        handler.slow_s = 0.4
        with pytest.raises(SidecarTimeout):
            await c.read("d0", "slow-1", [[0]], REMOTE, [[0]])
        await asyncio.sleep(0.4)  # the late Ok arrives and finds no waiter
        assert isinstance(await c.ping(), Pong)
        assert [x.request_id for x in await c.poll("d0")] == ["slow-1"]


async def test_async_close_fails_nothing_and_can_reopen(aclient: AsyncSidecarClient) -> None:
    assert isinstance(await aclient.ping(), Pong)
    await aclient.close()
    assert isinstance(await aclient.ping(), Pong)  # a fresh socket on next use


def test_register_waits_longer_for_larger_caches() -> None:
    """Creating shared memory costs about 0.9 s per GB: a fixed timeout would fail
    a large registration that the daemon completes."""
    from kvsidecar.ipc.client import ClientCore

    core = ClientCore("/tmp/x.sock", timeout_s=10.0)
    big = attention_layout(model="m", num_layers=64, total_kv_heads=8, head_dim=128,
                           block_tokens=16, tp_size=1, num_blocks=20_000)
    nbytes = big.num_regions * big.region_bytes
    assert nbytes > 20e9
    reg = Register("e", 0, big, "allocate", id=1)
    assert core.timeout_for(reg) >= 10.0 + 0.9 * nbytes / 1e9
    assert core.timeout_for(Ping(id=2)) == 10.0


# --------------------------------------------------------------------------
# Reads sent without waiting (read_nowait)
# --------------------------------------------------------------------------


def _registered(client: SidecarClient) -> list[ShmRegion]:
    regions = allocate_for_layout(LAYOUT, "kvtest")
    client.register("d0", 0, LAYOUT, regions=regions)
    return regions


def _unlink(regions: list[ShmRegion]) -> None:
    for r in regions:
        r.close()
        r.unlink()


def test_read_nowait_refusals_come_as_failed_completions(client: SidecarClient,
                                                         handler: HandlerDouble) -> None:
    """An accepted read completes as ever; a refused one is a ``failed``
    completion of its request id from the next poll, ahead of the sidecar's
    own, once; the call itself raised nothing."""
    regions = _registered(client)
    try:
        client.read_nowait("d0", "ok1", [[0]], REMOTE, [[2]])
        client.read_nowait("d0", "bad", [[9]], REMOTE, [[2]])  # out of range: refused
        client.read_nowait("d0", "ok2", [[1]], REMOTE, [[3]], num_tokens=4)
        got = client.poll("d0")
        assert [(c.request_id, c.kind) for c in got] == [
            ("bad", "failed"), ("ok1", "received"), ("ok2", "received")]
        assert got[0].reason == ("refused by the sidecar (bad_request): local block id out "
                                 "of range") and got[0].invalid_block_ids == []
        assert client.poll("d0") == []
        reads = [r for r in handler.requests if isinstance(r, Read)]
        assert [r.request_id for r in reads] == ["ok1", "bad", "ok2"]
        assert reads[2].num_tokens == 4
        assert len(client._core.posted) == 0
    finally:
        _unlink(regions)


def test_a_waiting_poll_is_not_held_up_by_a_refusal(client: SidecarClient,
                                                     handler: HandlerDouble) -> None:
    """The refusal is known before the poll leaves: the poll it sends does not
    ask the sidecar to wait (an engine asking to wait 4 s)."""
    regions = _registered(client)
    try:
        client.read_nowait("d0", "bad", [[9]], REMOTE, [[2]])
        got = client.poll("d0", wait_s=4.0)
        assert [(c.request_id, c.kind) for c in got] == [("bad", "failed")]
        polls = [r for r in handler.requests if isinstance(r, Poll)]
        assert [p.wait_s for p in polls] == [0.0]
        client.poll("d0", wait_s=0.5)  # nothing to report: this one may wait
        assert [r.wait_s for r in handler.requests if isinstance(r, Poll)] == [0.0, 0.5]
    finally:
        _unlink(regions)


def test_read_nowait_of_an_unknown_engine_is_reported_once_it_polls(
        client: SidecarClient) -> None:
    client.read_nowait("later", "r1", [[0]], REMOTE, [[2]])
    with pytest.raises(UnknownEngine):
        client.poll("later")  # unknown: the engine registers, then polls
    regions = allocate_for_layout(LAYOUT, "kvtest")
    try:
        client.register("later", 0, LAYOUT, regions=regions)
        got = client.poll("later")
        assert [(c.request_id, c.kind) for c in got] == [("r1", "failed")]
        assert "unknown_engine" in got[0].reason
    finally:
        _unlink(regions)


def test_read_nowait_bounds_what_awaits_answers_and_polls(client: SidecarClient,
                                                          handler: HandlerDouble) -> None:
    """At most 64 reads await their answers; at most ``max_refused`` refusals
    await a poll (then Unavailable, with nothing sent, until the engine polls)."""
    regions = _registered(client)
    posted = client._core.posted
    try:
        most = 0
        for i in range(200):
            client.read_nowait("d0", f"r{i}", [[i % LAYOUT.num_blocks]], REMOTE, [[0]])
            most = max(most, len(posted))
        assert most == 64
        got = client.poll("d0")
        assert sorted(c.request_id for c in got) == sorted(f"r{i}" for i in range(200))
        assert {c.kind for c in got} == {"received"}

        posted.max_refused = 3
        for i in range(3):
            client.read_nowait("d0", f"bad{i}", [[9]], REMOTE, [[0]])
        client.ping()  # takes the answers
        sent = len(handler.requests)
        with pytest.raises(Unavailable,
                           match="3 reads or holds of engine 'd0' sent without waiting "
                                 "were refused"):
            client.read_nowait("d0", "one-more", [[0]], REMOTE, [[0]])
        assert len(handler.requests) == sent  # nothing sent
        assert [c.request_id for c in client.poll("d0")] == ["bad0", "bad1", "bad2"]
        client.read_nowait("d0", "one-more", [[0]], REMOTE, [[0]])
        assert [c.request_id for c in client.poll("d0")] == ["one-more"]
    finally:
        _unlink(regions)


def test_hold_nowait_refusals_come_as_failed_completions(client: SidecarClient,
                                                         handler: HandlerDouble) -> None:
    """Holds sent without waiting share the reads' book: an accepted one
    completes as any hold, a refused one is a ``failed`` completion of its
    request id from the next poll (nothing pinned), in the order sent, the
    answers taken by that poll; the calls themselves raised nothing."""
    regions = _registered(client)
    try:
        client.hold_nowait("d0", "h1", [[0]])
        client.hold_nowait("d0", "h-bad", [[9]], readers=2)  # out of range: refused
        client.read_nowait("d0", "r1", [[1]], REMOTE, [[3]])
        client.hold_nowait("d0", "h2", [[2]], timeout_s=30.0)
        assert len(client._core.posted) == 4
        got = client.poll("d0")
        assert [(c.request_id, c.kind) for c in got] == [
            ("h-bad", "failed"), ("h1", "sent"), ("r1", "received"), ("h2", "sent")]
        assert got[0].reason == ("refused by the sidecar (bad_request): held block id out "
                                 "of range") and got[0].invalid_block_ids == []
        holds = [r for r in handler.requests if isinstance(r, Hold)]
        assert [(h.request_id, h.readers, h.timeout_s) for h in holds] == [
            ("h1", 1, None), ("h-bad", 2, None), ("h2", 1, 30.0)]
        assert len(client._core.posted) == 0 and client.poll("d0") == []
    finally:
        _unlink(regions)


def test_close_takes_the_answers_first(path: str, threaded: ServerThread) -> None:
    c = SidecarClient(path, timeout_s=5.0)
    regions = _registered(c)
    try:
        c.read_nowait("d0", "bad", [[9]], REMOTE, [[2]])
        c.close()
        assert len(c._core.posted) == 0
        assert [(x.request_id, x.kind) for x in c.poll("d0")] == [("bad", "failed")]
    finally:
        c.close()
        _unlink(regions)


def _until_a_poll(conn: socket.socket, kind: type[Read] | type[Hold], seen: list[str],
                  reply: Callable[[Read | Hold], Reply] | None = None) -> None:
    """A fake daemon's connection: record each request (all of ``kind``) and
    answer it with ``reply`` (or not at all) until a poll, answered empty."""
    while True:
        req = decode_request(conn.recv(MAX_PACKET))
        if isinstance(req, Poll):
            conn.send(encode_reply(Completions([], id=req.id)))
            return
        assert isinstance(req, (Read, Hold)) and isinstance(req, kind)
        seen.append(req.request_id)
        if reply is not None:
            conn.send(encode_reply(reply(req)))


def _answers_the_ping_only(conn: socket.socket) -> None:
    """A fake daemon's first connection: it answers the client's ping, reads
    nothing more and, after the client has sent more, closes with it unread."""
    ping = decode_request(conn.recv(MAX_PACKET))
    conn.send(encode_reply(Pong(PROTOCOL_VERSION, id=ping.id)))
    time.sleep(0.3)


def _answers_one_read(seen: list[str], reply: Callable[[int], Reply]
                      ) -> Callable[[socket.socket], None]:
    """A fake daemon's first connection: it answers the client's ping and its
    first read (``reply`` of the read's id), records that read, then reads no
    further and, after the client has sent more, closes with them unread."""
    def first(conn: socket.socket) -> None:
        ping = decode_request(conn.recv(MAX_PACKET))
        conn.send(encode_reply(Pong(PROTOCOL_VERSION, id=ping.id)))
        req = decode_request(conn.recv(MAX_PACKET))
        assert isinstance(req, Read)
        seen.append(req.request_id)
        conn.send(encode_reply(reply(req.id)))
        time.sleep(0.2)  # the client's next reads arrive, never read
    return first


def test_reads_a_closed_connection_left_unanswered_go_again(tmp_path: Path) -> None:
    """The daemon answers the first read, reads no further and closes: the
    answer is taken, the two reads it left go again on the next connection
    (in order; a ``duplicate`` there means the first copy was taken, dropped),
    and nothing that was answered goes twice."""
    fake = str(tmp_path / "fake.sock")
    seen: list[list[str]] = [[], []]
    first = _answers_one_read(seen[0], lambda i: Error(BAD_REQUEST, "no such block", id=i))

    def second(conn: socket.socket) -> None:
        while True:
            req = decode_request(conn.recv(MAX_PACKET))
            if isinstance(req, Poll):
                conn.send(encode_reply(Completions([Completion("r3", "received")], last=1,
                                                   id=req.id)))
                return
            assert isinstance(req, Read)
            seen[1].append(req.request_id)
            reply = (Error(DUPLICATE, "read 'r2' is already in progress", id=req.id)
                     if req.request_id == "r2" else Ok(id=req.id))
            conn.send(encode_reply(reply))

    t = _fake_daemon(fake, first, second)
    with SidecarClient(fake, timeout_s=5.0) as c:
        c.ping()
        for rid in ("r1", "r2", "r3"):
            c.read_nowait("d0", rid, [[0]], REMOTE, [[1]])
            time.sleep(0.05)
        time.sleep(0.3)  # the first connection is closed by now
        got = c.poll("d0")
        assert [(x.request_id, x.kind) for x in got] == [("r1", "failed"), ("r3", "received")]
        assert "no such block" in got[0].reason
    t.join(5)
    assert seen == [["r1"], ["r2", "r3"]]


def test_holds_raise_at_once_what_the_sidecar_refuses_on_sight(
        client: SidecarClient, handler: HandlerDouble) -> None:
    """A hold the sidecar would refuse while decoding it (before it knows the
    engine, so it could record nothing) is refused by the call, nothing sent;
    so are the blocking calls' (a batch's whole)."""
    regions = _registered(client)
    try:
        sent = len(handler.requests)
        for bad in ({"readers": 0}, {"timeout_s": 0.0}, {"timeout_s": 1e9}):
            with pytest.raises(BadMessage):
                client.hold_nowait("d0", "h", [[0]], **bad)  # type: ignore[arg-type]
        with pytest.raises(BadMessage):
            client.hold_nowait("d0", "x" * 5000, [[0]])
        assert len(handler.requests) == sent and len(client._core.posted) == 0
        with pytest.raises(BadMessage):  # the blocking calls check it as well
            client.hold("d0", "h", [[0]], timeout_s=7200.0)
        with pytest.raises(BadMessage, match="'h2'"):
            client.hold_many("d0", [HoldSpec("h1", [[0]]), HoldSpec("h2", [[1]], readers=0)])
        assert len(handler.requests) == sent
        client.hold_nowait("d0", "h", [[0]], timeout_s=30.0)
        assert [(c.request_id, c.kind) for c in client.poll("d0")] == [("h", "sent")]
    finally:
        _unlink(regions)


def test_a_batch_refused_whole_reports_each_item_short_or_long(
        client: SidecarClient, handler: HandlerDouble) -> None:
    """This stand-in daemon answers every Batch with one error (as a sidecar
    older than minor 5 does): each item is a ``failed`` completion from the next
    poll, whether the batch went without waiting or, too long for one packet,
    waited for its answer."""
    regions = _registered(client)
    try:
        client.read_many_nowait("d0", [ReadSpec("s1", [[0]], REMOTE, [[0]]),
                                       ReadSpec("s2", [[1]], REMOTE, [[1]])])
        long_ids = [list(range(40_000))]
        client.read_many_nowait("d0", [ReadSpec("l1", long_ids, REMOTE, long_ids)])
        got = client.poll("d0")
        assert [(c.request_id, c.kind) for c in got] == [
            ("s1", "failed"), ("s2", "failed"), ("l1", "failed")]
        assert all(c.reason.startswith("refused by the sidecar (") for c in got)
        sent = len(handler.requests)
        with pytest.raises(Unavailable, match="verif"):  # a sidecar that would not verify
            client.read_many_nowait("d0", [ReadSpec("v", [[0]], REMOTE, [[0]], verify=True)])
        assert [type(r) for r in handler.requests[sent:]] == [Ping]
    finally:
        _unlink(regions)


def test_holds_a_closed_connection_left_unread_go_again(tmp_path: Path) -> None:
    """The daemon closes the connection with two holds unread: the next call
    sends both again, in order; a ``duplicate`` there (the first copy was
    placed after all) is dropped, not reported, and the other is placed."""
    fake = str(tmp_path / "fake.sock")
    seen: list[str] = []

    def second(conn: socket.socket) -> None:
        _until_a_poll(conn, Hold, seen, lambda req: (
            Error(DUPLICATE, "request 'h1' is already held", id=req.id)
            if req.request_id == "h1" else Held(10.0, 120.0, id=req.id)))

    t = _fake_daemon(fake, _answers_the_ping_only, second)
    with SidecarClient(fake, timeout_s=5.0) as c:
        c.ping()
        c.hold_nowait("p0", "h1", [[0]])
        c.hold_nowait("p0", "h2", [[1]])
        time.sleep(0.5)  # the first connection is closed by now
        assert c.poll("p0") == []
        assert len(c._core.posted) == 0
    t.join(5)
    assert seen == ["h1", "h2"]


def test_a_forked_child_neither_takes_nor_sends_again_its_parents_reads(
        client: SidecarClient, handler: HandlerDouble) -> None:
    regions = _registered(client)
    try:
        client.read_nowait("d0", "mine", [[0]], REMOTE, [[2]])
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                ok = client.ping().version == PROTOCOL_VERSION and len(client._core.posted) == 0
                code = 0 if ok else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert [(c.request_id, c.kind) for c in client.poll("d0")] == [("mine", "received")]
        assert [r.request_id for r in handler.requests if isinstance(r, Read)] == ["mine"]
    finally:
        _unlink(regions)


def test_close_reports_the_reads_a_closed_connection_never_read(tmp_path: Path) -> None:
    """The daemon closes the connection with two reads unread; the engine
    closes its client before any call sent them again: both are reported
    ``failed`` by the next poll (they were never read, and are never sent)."""
    fake = str(tmp_path / "fake.sock")
    polls: list[Request] = []

    def second(conn: socket.socket) -> None:
        req = decode_request(conn.recv(MAX_PACKET))
        polls.append(req)
        conn.send(encode_reply(Completions([], id=req.id)))

    t = _fake_daemon(fake, _answers_the_ping_only, second)
    c = SidecarClient(fake, timeout_s=5.0)
    try:
        c.ping()
        c.read_nowait("d0", "r1", [[0]], REMOTE, [[1]])
        c.read_nowait("d0", "r2", [[1]], REMOTE, [[2]])
        time.sleep(0.5)  # the first connection is closed by now
        c.close()
        got = c.poll("d0")
        assert [(x.request_id, x.kind) for x in got] == [("r1", "failed"), ("r2", "failed")]
        assert "closed its connection before reading this request" in got[0].reason
        assert [type(r) for r in polls] == [Poll]  # nothing sent again
    finally:
        c.close()
    t.join(5)


def test_a_read_too_long_for_one_packet_waits_for_its_answer(client: SidecarClient) -> None:
    """A read whose message needs several packets is not sent without waiting:
    its refusal is raised, as read() raises it."""
    regions = _registered(client)
    try:
        ids = list(range(20_000))  # > 64 KiB of block ids; out of range here
        with pytest.raises(BadRequest, match="out of range"):
            client.read_nowait("d0", "long", [ids], REMOTE, [ids])
        assert len(client._core.posted) == 0
    finally:
        _unlink(regions)


def test_reads_a_connection_read_before_it_ended_are_never_sent_again(
        tmp_path: Path) -> None:
    """The daemon reads both reads and ends the connection without answering
    (no reset: nothing of ours was left unread, e.g. it stopped while handling
    them): they are not sent again, nor reported failed (their completions, if
    any, would come from the sidecar)."""
    fake = str(tmp_path / "fake.sock")
    seen: list[list[str]] = [[], []]

    def first(conn: socket.socket) -> None:
        ping = decode_request(conn.recv(MAX_PACKET))
        conn.send(encode_reply(Pong(PROTOCOL_VERSION, id=ping.id)))
        for _ in range(2):
            req = decode_request(conn.recv(MAX_PACKET))
            assert isinstance(req, Read)
            seen[0].append(req.request_id)

    def second(conn: socket.socket) -> None:
        _until_a_poll(conn, Read, seen[1])

    t = _fake_daemon(fake, first, second)
    with SidecarClient(fake, timeout_s=5.0) as c:
        c.ping()
        c.read_nowait("d0", "r1", [[0]], REMOTE, [[1]])
        c.read_nowait("d0", "r2", [[1]], REMOTE, [[2]])
        time.sleep(0.3)  # both read, the connection ended
        assert c.poll("d0") == []
        assert len(c._core.posted) == 0
    t.join(5)
    assert seen == [["r1", "r2"], []]


def test_a_refusal_said_at_the_door_is_raised_not_retried(tmp_path: Path) -> None:
    """A daemon that refuses the connection (an error without an id, then
    closing) makes the next call raise that refusal."""
    fake = str(tmp_path / "fake.sock")

    def answer(conn: socket.socket) -> None:
        conn.recv(MAX_PACKET)
        conn.send(encode_reply(Error(FORBIDDEN, "uid 1234 may not use this sidecar")))

    t = _fake_daemon(fake, answer)
    with SidecarClient(fake, timeout_s=5.0) as c:
        c.read_nowait("d0", "r1", [[0]], REMOTE, [[1]])
        with pytest.raises(Forbidden, match="may not use this sidecar"):
            c.poll("d0")
    t.join(5)


def test_a_blocking_call_after_a_reset_sends_the_unread_reads_again(tmp_path: Path) -> None:
    """The daemon answers r1 and closes with r2 unread; the next call is a
    blocking one (its send meets the reset first): r2 goes again on the new
    connection, before that call's own request."""
    fake = str(tmp_path / "fake.sock")
    seen: list[list[str]] = [[], []]
    first = _answers_one_read(seen[0], lambda i: Ok(id=i))

    def second(conn: socket.socket) -> None:
        while True:
            req = decode_request(conn.recv(MAX_PACKET))
            seen[1].append(req.request_id if isinstance(req, Read) else type(req).__name__)
            if isinstance(req, Ping):
                conn.send(encode_reply(Pong(PROTOCOL_VERSION, id=req.id)))
                return
            conn.send(encode_reply(Ok(id=req.id)))

    t = _fake_daemon(fake, first, second)
    with SidecarClient(fake, timeout_s=5.0) as c:
        c.ping()
        c.read_nowait("d0", "r1", [[0]], REMOTE, [[1]])
        c.read_nowait("d0", "r2", [[1]], REMOTE, [[2]])
        time.sleep(0.5)  # the first connection is closed by now
        assert c.ping().version == PROTOCOL_VERSION
        assert len(c._core.posted) == 0
    t.join(5)
    assert seen == [["r1"], ["r2", "Ping"]]


def test_a_forked_childs_long_call_does_not_wait_for_its_parents_answers(
        client: SidecarClient) -> None:
    regions = _registered(client)
    try:
        client.read_nowait("d0", "mine", [[0]], REMOTE, [[2]])
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                ids = list(range(20_000))  # a message of several packets
                try:  # waiting for the parent's answers would end in SidecarTimeout
                    client.read("d0", "long", [ids], REMOTE, [ids])
                except BadRequest:
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert [(c.request_id, c.kind) for c in client.poll("d0")] == [("mine", "received")]
    finally:
        _unlink(regions)
