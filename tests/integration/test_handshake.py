"""Handshake over real TCP on 127.0.0.1: caching, dedupe, dead peers, bad input, mismatches.

Timing is never asserted; "does not hang" is what the pytest timeout marks guard.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.peers.messages import (
    HANDSHAKE_VERSION,
    HandshakeError,
    HandshakeFailed,
    HandshakeInfo,
    HandshakeReply,
    HandshakeRequest,
    RawReply,
    check_peer,
    make_handshake_info,
    new_daemon_id,
)
from kvsidecar.daemon.peers.server import HandshakeServer
from kvsidecar.ipc.layout import (
    IncompatibleLayout,
    Layout,
    attention_layout,
    mamba2_hybrid_layout,
)

pytestmark = pytest.mark.timeout(20)


def attn(tp_size: int = 1) -> Layout:
    return attention_layout(model="m", num_layers=2, total_kv_heads=8, head_dim=64,
                            block_tokens=16, tp_size=tp_size, num_blocks=8)


def hybrid() -> Layout:
    return mamba2_hybrid_layout(model="m", num_layers=2, total_kv_heads=8, head_dim=64,
                                block_tokens=16, intermediate_size=256, n_groups=2, d_state=16,
                                conv_kernel=4, mamba_heads=4, mamba_head_dim=64, tp_size=1,
                                num_blocks=8)


GPU = "GPU-01234567-89ab-cdef-0123-456789abcdef"
#: what a GPU sidecar reads; a host-memory one reads DRAM only
GPU_READER = ("DRAM", "VRAM")


def info_for(engine_id: str, tp_rank: int, layout: Layout | None = None) -> HandshakeInfo:
    layout = layout or attn()
    return make_handshake_info(
        engine_id=engine_id, tp_rank=tp_rank, agent_name=f"{engine_id}-{tp_rank}",
        agent_metadata=b"\x00nixl-md" * 64, layout=layout,
        bases=[0x7F00_0000_0000 + r * layout.region_bytes for r in range(layout.num_regions)],
        daemon_id=new_daemon_id(), mem_type="VRAM", dev_id=tp_rank, device_uuid=GPU,
    )


class Registry:
    """A lookup that counts calls, standing in for the daemon's engine table."""

    def __init__(self) -> None:
        self.infos: dict[tuple[str, int], HandshakeInfo] = {}
        self.lookups = 0

    def add(self, info: HandshakeInfo) -> None:
        self.infos[(info.engine_id, info.tp_rank)] = info

    def lookup(self, engine_id: str, tp_rank: int) -> HandshakeInfo | None:
        self.lookups += 1
        return self.infos.get((engine_id, tp_rank))

    def engines(self) -> list[str]:
        return [e for e, _ in self.infos]


@pytest.fixture
def registry() -> Registry:
    reg = Registry()
    reg.add(info_for("prefill-0", 0, attn(tp_size=2)))
    reg.add(info_for("prefill-0", 1, attn(tp_size=2)))
    return reg


@pytest.fixture
async def server(registry: Registry) -> AsyncIterator[HandshakeServer]:
    srv = HandshakeServer("127.0.0.1:0", registry.lookup, engines=registry.engines)
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def client() -> AsyncIterator[HandshakeClient]:
    cli = HandshakeClient(timeout_s=2.0)
    yield cli
    await cli.close()


def addr_of(srv: HandshakeServer) -> str:
    assert srv.address is not None
    return str(srv.address)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def raw_exchange(address: str, frame: bytes) -> bytes:
    """Send one frame from a bare DEALER and return the reply frame."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{address}")
        await sock.send(frame)
        frames: list[bytes] = await asyncio.wait_for(sock.recv_multipart(), 5)
        return frames[-1]
    finally:
        sock.close(linger=0)
        ctx.term()


def decode_reply(frame: bytes) -> HandshakeReply | HandshakeError:
    return msgspec.msgpack.decode(frame, type=HandshakeReply | HandshakeError)


# --------------------------------------------------------------------------


async def test_fetch_returns_the_registered_info(
    server: HandshakeServer, client: HandshakeClient, registry: Registry
) -> None:
    address = addr_of(server)
    host, port = address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    got = await client.fetch(address, "prefill-0", 1)
    assert got == registry.infos[("prefill-0", 1)]
    check_peer(got, "prefill-0", 2, attn(), readable=GPU_READER)
    # tcp:// prefix is the same address.
    assert await client.fetch(f"tcp://{address}", "prefill-0", 1) is got


async def test_cache_hit_sends_nothing(server: HandshakeServer, client: HandshakeClient) -> None:
    first = await client.fetch(addr_of(server), "prefill-0", 0)
    assert server.requests_received == 1
    for _ in range(5):
        assert await client.fetch(addr_of(server), "prefill-0", 0) is first
    assert server.requests_received == 1
    client.forget(addr_of(server), "prefill-0")
    await client.fetch(addr_of(server), "prefill-0", 0)
    assert server.requests_received == 2


async def test_concurrent_fetches_share_one_request(
    server: HandshakeServer, client: HandshakeClient
) -> None:
    results = await asyncio.gather(
        *(client.fetch(addr_of(server), "prefill-0", 0) for _ in range(20))
    )
    assert server.requests_received == 1
    assert all(r is results[0] for r in results)
    # Different ranks are different keys and still share one socket.
    await asyncio.gather(*(client.fetch(addr_of(server), "prefill-0", r) for r in (0, 1)))
    assert server.requests_received == 2


async def test_server_caches_encoding_until_invalidated(
    server: HandshakeServer, registry: Registry
) -> None:
    for _ in range(3):
        cli = HandshakeClient(timeout_s=2.0)
        try:
            await cli.fetch(addr_of(server), "prefill-0", 0)
        finally:
            await cli.close()
    assert registry.lookups == 1
    new = info_for("prefill-0", 0, attn(tp_size=2))
    registry.add(new)
    server.invalidate("prefill-0")
    cli = HandshakeClient(timeout_s=2.0)
    try:
        assert await cli.fetch(addr_of(server), "prefill-0", 0) == new
    finally:
        await cli.close()
    assert registry.lookups == 2


async def test_unknown_engine_is_named(server: HandshakeServer, client: HandshakeClient) -> None:
    with pytest.raises(HandshakeFailed) as ei:
        await client.fetch(addr_of(server), "decode-9", 0)
    msg = str(ei.value)
    assert "decode-9" in msg and "prefill-0" not in msg  # other engines are not listed
    assert ei.value.address == addr_of(server)
    with pytest.raises(HandshakeFailed, match="'prefill-0' rank 5"):
        await client.fetch(addr_of(server), "prefill-0", 5)
    # Failures are not cached: each retry reaches the server.
    with pytest.raises(HandshakeFailed):
        await client.fetch(addr_of(server), "decode-9", 0)
    assert server.requests_received == 3


async def test_dead_address_times_out_and_client_recovers(server: HandshakeServer) -> None:
    dead = f"127.0.0.1:{free_port()}"
    cli = HandshakeClient(timeout_s=0.3)
    try:
        with pytest.raises(HandshakeFailed) as ei:
            await cli.fetch(dead, "prefill-0", 0)
        assert ei.value.reason == f"no answer from {dead} within 0.3 s"
        # Concurrent waiters on a dead peer all fail, none hangs.
        outcomes = await asyncio.gather(
            *(cli.fetch(dead, "prefill-0", r) for r in (0, 1, 0)), return_exceptions=True
        )
        assert all(isinstance(o, HandshakeFailed) for o in outcomes)
        assert (await cli.fetch(addr_of(server), "prefill-0", 0)).engine_id == "prefill-0"
    finally:
        await cli.close()


async def test_failed_fetch_retries_on_a_fresh_socket(registry: Registry) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    cli = HandshakeClient(timeout_s=0.3)
    try:
        with pytest.raises(HandshakeFailed, match="no answer"):
            await cli.fetch(address, "prefill-0", 0)
        srv = HandshakeServer(address, registry.lookup)
        assert await srv.start() == address
        try:
            cli.timeout_s = 5.0
            assert (await cli.fetch(address, "prefill-0", 0)).tp_rank == 0
            # Only the new request reached the server: the timed-out one died
            # with its socket instead of being delivered late.
            assert srv.requests_received == 1
        finally:
            await srv.stop()
    finally:
        await cli.close()


async def test_malformed_requests_get_errors_and_server_survives(
    server: HandshakeServer, client: HandshakeClient
) -> None:
    for junk in (b"", b"\xc1\xc1garbage", msgspec.msgpack.encode([1, 2, 3]),
                 msgspec.msgpack.encode({"engine_id": 5, "tp_rank": "x", "req_id": 77})):
        reply = decode_reply(await raw_exchange(addr_of(server), junk))
        assert isinstance(reply, HandshakeError)
        assert reply.code == "bad_message"
    # The req_id is salvaged when it can be, so a real client could route the error.
    assert reply.req_id == 77
    old = HandshakeRequest("prefill-0", 0, v=HANDSHAKE_VERSION + 1, req_id=3)
    reply = decode_reply(await raw_exchange(addr_of(server), msgspec.msgpack.encode(old)))
    assert isinstance(reply, HandshakeError) and reply.code == "version" and reply.req_id == 3
    good = HandshakeRequest("prefill-0", 1, req_id=9)
    reply = decode_reply(await raw_exchange(addr_of(server), msgspec.msgpack.encode(good)))
    assert isinstance(reply, HandshakeReply) and reply.req_id == 9
    assert reply.info.tp_rank == 1
    assert (await client.fetch(addr_of(server), "prefill-0", 0)).tp_rank == 0


def test_raw_reply_encodes_like_the_public_reply() -> None:
    info = info_for("p", 0)
    public = msgspec.msgpack.encode(HandshakeReply(info, req_id=4))
    spliced = msgspec.msgpack.encode(RawReply(msgspec.Raw(msgspec.msgpack.encode(info)), 4))
    assert public == spliced


async def test_engine_id_mismatch_in_reply(client: HandshakeClient) -> None:
    liar = info_for("someone-else", 0)
    srv = HandshakeServer("127.0.0.1:0", lambda e, r: liar)
    address = await srv.start()
    try:
        with pytest.raises(HandshakeFailed, match="engine id mismatch") as ei:
            await client.fetch(address, "prefill-0", 0)
        assert ei.value.field == "engine_id"
        assert "someone-else" in str(ei.value)
        with pytest.raises(HandshakeFailed, match="engine id mismatch"):
            await client.fetch(address, "someone-else", 1)
    finally:
        await srv.stop()


async def test_protocol_mismatch_in_info(client: HandshakeClient) -> None:
    future = msgspec.structs.replace(info_for("p", 0), protocol=HANDSHAKE_VERSION + 1)
    srv = HandshakeServer("127.0.0.1:0", lambda e, r: future)
    address = await srv.start()
    try:
        with pytest.raises(HandshakeFailed, match="protocol version mismatch"):
            await client.fetch(address, "p", 0)
    finally:
        await srv.stop()


async def test_incompatible_layout_is_named(client: HandshakeClient) -> None:
    srv = HandshakeServer("127.0.0.1:0", lambda e, r: info_for(e, r, hybrid()))
    address = await srv.start()
    try:
        got = await client.fetch(address, "p", 0)
    finally:
        await srv.stop()
    with pytest.raises(IncompatibleLayout) as ei:
        check_peer(got, "p", 1, attn(), readable=GPU_READER)
    assert ei.value.field == "family"
    assert "family" in str(ei.value)


Mutate = Callable[[HandshakeInfo], HandshakeInfo]


@pytest.mark.parametrize(
    ("field", "mutate"),
    [
        ("engine_id", lambda i: i),  # expected id differs below
        ("tp_size", lambda i: msgspec.structs.replace(i, tp_size=4)),
        ("bases", lambda i: msgspec.structs.replace(i, bases=i.bases[:-1])),
        ("bases", lambda i: msgspec.structs.replace(i, bases=[0, *i.bases[1:]])),
        ("bases", lambda i: msgspec.structs.replace(i, bases=[-4096, *i.bases[1:]])),
        ("bases", lambda i: msgspec.structs.replace(i, bases=[(1 << 63) - 4096,
                                                              *i.bases[1:]])),
        ("bases", lambda i: msgspec.structs.replace(i, bases=[i.bases[1], *i.bases[1:]])),
        ("fingerprint", lambda i: msgspec.structs.replace(i, fingerprint="0" * 16)),
        ("protocol", lambda i: msgspec.structs.replace(i, protocol=99)),
    ],
)
def test_check_peer_names_the_field(field: str, mutate: Mutate) -> None:
    info = mutate(info_for("p", 0))
    expected = "q" if field == "engine_id" else "p"
    with pytest.raises(HandshakeFailed) as ei:
        check_peer(info, expected, 1, attn(), readable=GPU_READER)
    assert ei.value.field == field
    assert field in str(ei.value)


def test_host_sidecar_refuses_a_vram_peer_and_names_why() -> None:
    info = info_for("p", 0)
    with pytest.raises(HandshakeFailed, match=f"peer serves VRAM on GPU {GPU}; this sidecar "
                                              "reads DRAM only") as ei:
        check_peer(info, "p", 1, attn())
    assert ei.value.field == "mem_type"
    check_peer(msgspec.structs.replace(info, mem_type="DRAM", device_uuid="", dev_id=0),
               "p", 1, attn())  # the same peer with host memory is fine


def test_vram_peer_must_name_its_gpu_and_type_must_be_known() -> None:
    with pytest.raises(HandshakeFailed, match="without naming its GPU") as ei:
        check_peer(msgspec.structs.replace(info_for("p", 0), device_uuid=""), "p", 1, attn(),
                   readable=GPU_READER)
    assert ei.value.field == "device_uuid"
    with pytest.raises(HandshakeFailed, match="unknown type 'HBM'"):
        check_peer(msgspec.structs.replace(info_for("p", 0), mem_type="HBM"), "p", 1, attn(),
                   readable=GPU_READER)


def test_check_peer_tp_size_as_announced() -> None:
    info = info_for("p", 1, attn(tp_size=2))
    check_peer(info, "p", 2, attn(tp_size=4), readable=GPU_READER)  # hetero TP: 2 vs 4 is fine
    with pytest.raises(HandshakeFailed, match="announced with tp_size 4") as ei:
        check_peer(info, "p", 4, attn(), readable=GPU_READER)
    assert ei.value.field == "tp_size"


def test_check_peer_model_fact_mismatch() -> None:
    other = attention_layout(model="m", num_layers=2, total_kv_heads=8, head_dim=128,
                             block_tokens=16, tp_size=1, num_blocks=8)
    with pytest.raises(IncompatibleLayout) as ei:
        check_peer(info_for("p", 0, other), "p", 1, attn(), readable=GPU_READER)
    assert ei.value.field == "model.head_dim"


async def test_close_fails_inflight_cleanly() -> None:
    cli = HandshakeClient(timeout_s=5.0)
    pending = asyncio.ensure_future(cli.fetch(f"127.0.0.1:{free_port()}", "p", 0))
    await asyncio.sleep(0.05)
    await cli.close()
    with pytest.raises(HandshakeFailed, match="closed"):
        await pending
    with pytest.raises(HandshakeFailed, match="closed"):
        await cli.fetch("127.0.0.1:1", "p", 0)


async def test_cache_and_connections_are_bounded_lru(registry: Registry) -> None:
    """Peers' answers cannot grow the client without bound: past max_cached the
    least recently used answer goes (and is fetched again when next needed), past
    max_connections idle sockets are closed; each eviction is reported."""
    servers = [HandshakeServer("127.0.0.1:0", registry.lookup) for _ in range(3)]
    for s in servers:
        await s.start()
    evicted: list[str] = []
    cli = HandshakeClient(timeout_s=2.0, max_cached=2, max_connections=2,
                          on_evict=evicted.append)
    try:
        a, b, c = (addr_of(s) for s in servers)
        await cli.fetch(a, "prefill-0", 0)
        await cli.fetch(b, "prefill-0", 0)
        await cli.fetch(a, "prefill-0", 0)  # a is now the most recently used
        await cli.fetch(c, "prefill-0", 0)  # evicts b's answer and b's idle socket
        assert evicted.count("handshake") == 1 and evicted.count("connection") == 1
        assert [s.requests_received for s in servers] == [1, 1, 1]
        await cli.fetch(a, "prefill-0", 0)  # still cached
        await cli.fetch(b, "prefill-0", 0)  # fetched again, over a new socket
        assert [s.requests_received for s in servers] == [1, 2, 1]
        assert len(cli._cache) == 2 and len(cli._conns) <= 2
    finally:
        await cli.close()
        for s in servers:
            await s.stop()


async def _answer_with(info_bytes: bytes) -> tuple[str, asyncio.Task[None], zmq.asyncio.Context]:
    """A bare ROUTER answering every handshake request with ``info_bytes`` as its info."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    async def serve() -> None:
        try:
            while True:
                ident, frame = await sock.recv_multipart()
                req = msgspec.msgpack.decode(frame, type=HandshakeRequest)
                await sock.send_multipart([ident, msgspec.msgpack.encode(
                    RawReply(msgspec.Raw(info_bytes), req.req_id))])
        finally:
            sock.close(linger=0)

    return f"127.0.0.1:{port}", asyncio.create_task(serve()), ctx


@pytest.mark.parametrize("layers", [2, 32768])
async def test_large_infos_decode_off_the_loop_with_the_same_errors(
        layers: int, client: HandshakeClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """An info of 65,536 named regions (~0.5 MB) is decoded on a thread, a small
    one on the loop; a malformed one is refused with msgspec's words either way."""
    from kvsidecar.daemon.peers import client as client_module

    threads: list[bool] = []
    real = client_module._decode_info

    def spy(addr: str, raw: msgspec.Raw) -> HandshakeInfo:
        threads.append(threading.current_thread() is threading.main_thread())
        return real(addr, raw)

    monkeypatch.setattr(client_module, "_decode_info", spy)
    lay = attention_layout(model="m", num_layers=layers, total_kv_heads=2, head_dim=8,
                           block_tokens=4, tp_size=1, num_blocks=2, kv_separate=True)
    good = msgspec.structs.replace(info_for("p", 0, lay), mem_type="DRAM", device_uuid="")
    wire = msgspec.msgpack.encode(good)
    bad = msgspec.msgpack.encode({**msgspec.structs.asdict(good), "bases": [
        *good.bases[:-1], "0x1"]})
    big = len(wire) > client_module.OFF_LOOP_INFO_BYTES
    assert big == (layers > 2)
    for payload in (wire, bad):
        address, task, ctx = await _answer_with(payload)
        try:
            if payload is wire:
                got = await client.fetch(address, "p", 0)
                assert got == good
            else:
                with pytest.raises(HandshakeFailed) as e:
                    await client.fetch(address, "p", 0)
                at = len(good.bases) - 1
                assert str(e.value) == (f"handshake with {address} failed: malformed handshake "
                                        f"info: Expected `int`, got `str` - at `$.bases[{at}]`")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            ctx.term()
    assert threads == [not big] * 2
