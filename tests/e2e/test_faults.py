"""End to end: bad input and failures get clear answers; the daemon keeps serving."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest

from kvsidecar.daemon.reservations import MAX_RESERVATIONS
from kvsidecar.ipc.client import (
    AsyncSidecarClient,
    BadRequest,
    Duplicate,
    SidecarClient,
    Unavailable,
    UnknownEngine,
)
from kvsidecar.ipc.layout import attention_layout
from kvsidecar.ipc.memory import ENGINE_SHM_PREFIX, ShmRegion, unique_name
from kvsidecar.ipc.protocol import Error, RemoteEngine, decode_reply
from kvsidecar.ipc.seqpacket import BlockingChannel
from kvsidecar.sim.cluster import SidecarProcess, SimEngine
from kvsidecar.sim.models import attn, hybrid
from kvsidecar.sim.oracle import Request

from ..unit.bench_modules import suite

pytestmark = pytest.mark.e2e


def _completion(engine, rid: str, timeout_s: float = 30.0):
    got = engine.wait_for([rid], timeout_s)[rid]
    return got


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_hold_expires(pool) -> None:
    with pool.engines(attn(8), 2, 1) as (P, _):
        P.prefill("lonely", Request(seed=1, prompt_tokens=20), timeout_s=0.3)
        got = _completion(P, "lonely")
        assert {c.kind for c in got.values()} == {"expired"}
        assert "0 of 1 reading engines" in got[0].reason


def test_a_pending_hold_does_not_make_housekeeping_tick(pool) -> None:
    """With one hold waiting for its reader (the 60 s hold timeout), P's event
    loop sleeps about as it does idle: housekeeping passes when the hold is due
    and once a second, not every 0.1 s (which alone woke it 40 times in 4 s;
    13 wake-ups in 4 s were measured with the fix, 49 without)."""
    p0 = pool.p[0]
    assert p0.proc is not None
    with pool.engines(attn(8), 1, 1) as (P, _):
        P.prefill("waiting", Request(seed=1, prompt_tokens=20))
        time.sleep(0.3)
        before = suite.proc_threads_wakeups(p0.proc.pid)["loop"]
        time.sleep(4)
        woke = suite.proc_threads_wakeups(p0.proc.pid)["loop"] - before
        assert woke < 30, f"P's loop woke {woke} times in 4 s with one hold pending"
        P.clients[0].release(P.engine_id, "waiting")
        assert _completion(P, "waiting")[0].kind == "aborted"


def test_release_aborts_a_hold(pool) -> None:
    with pool.engines(attn(8), 1, 1) as (P, _):
        P.prefill("dropped", Request(seed=1, prompt_tokens=20))
        P.clients[0].release(P.engine_id, "dropped")
        got = _completion(P, "dropped")
        assert got[0].kind == "aborted"
        # Its end is not acknowledged yet: releasing again is accepted and changes nothing.
        P.clients[0].release(P.engine_id, "dropped")
        P.poll()  # acknowledges the completion: now the id is unknown
        with pytest.raises(BadRequest, match="no read or hold 'dropped'"):
            P.clients[0].release(P.engine_id, "dropped")


def test_release_aborts_a_read_waiting_for_its_handshake(pool) -> None:
    """A read stuck in its handshake (peer never answers) is aborted at once;
    its blocks are reported invalid."""
    with pool.engines(hybrid, 1, 1) as (P, (D,)):
        sent = P.prefill("slow-peer", Request(seed=2, prompt_tokens=30))
        silent = socket.socket()  # accepts TCP connections, never speaks ZMQ
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        try:
            sent.remote = RemoteEngine(sent.remote.engine_id, 1,
                                       [f"127.0.0.1:{silent.getsockname()[1]}"])
            rec = D.start_read(sent)
            D.clients[0].release(D.engine_id, "slow-peer")
            got = _completion(D, "slow-peer")
        finally:
            silent.close()
        assert got[0].kind == "aborted"
        assert got[0].invalid_block_ids == rec.block_ids
        D.finish("slow-peer")


def test_dead_handshake_address_fails_the_read_not_the_daemon(pool) -> None:
    with pool.engines(hybrid, 1, 2) as (P, (D,)):
        sent = P.prefill("dead", Request(seed=3, prompt_tokens=30))
        good = sent.remote
        sent.remote = RemoteEngine(good.engine_id, 1, [f"127.0.0.1:{_free_port()}"])
        rec = D.start_read(sent)
        got = _completion(D, "dead", timeout_s=30)
        for c in got.values():
            assert c.kind == "failed"
            assert "no answer from" in c.reason
            assert c.invalid_block_ids == rec.block_ids
        D.finish("dead")
        # The same daemons still serve a good read.
        sent.remote = good
        D.start_read(sent, request_id="after-dead")
        got = _completion(D, "after-dead")
        assert {c.kind for c in got.values()} == {"received"}
        assert not D.verify("after-dead")


#: handshake addresses an engine may name that libzmq refuses to dial at all
UNDIALABLE = ["127.0.0.1:abc", "127.0.0.1:-1", "a:b:c", "*:5555", "ipc:///tmp/x:1",
              "udp://1.2.3.4:5:1"]


def test_undialable_addresses_fail_their_reads_and_leak_nothing(pool, tmp_path) -> None:
    """Reads naming handshake addresses libzmq cannot dial each fail at once,
    naming the address, on a D sidecar of their own; the same engine then
    reads oracle-exact bytes, D's fds are back where they were, and D still
    shuts down cleanly. Before: each such read left a ZMQ socket behind (its
    connect raised after the socket was made), and at SIGTERM the context's
    term() waited for those sockets forever (the sidecar had to be killed)."""
    d = SidecarProcess(tmp_path, "d-undialable").start()
    P = SimEngine(pool.uid("P"), hybrid, 1, 96, pool.p[:1])
    D = SimEngine(pool.uid("D"), hybrid, 1, 96, [d])
    try:
        assert d.proc is not None
        sent = P.prefill("held", Request(seed=5, prompt_tokens=60))
        D.start_read(sent, request_id="warm")  # links, sockets, executors made once
        assert {c.kind for c in _completion(D, "warm").values()} == {"received"}
        D.finish("warm")
        fds = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
        good = sent.remote
        for i, addr in enumerate(UNDIALABLE * 3):
            sent.remote = RemoteEngine(good.engine_id, 1, [addr])
            rec = D.start_read(sent, request_id=f"undialable-{i}")
            c = _completion(D, f"undialable-{i}")[0]
            assert c.kind == "failed" and "cannot dial it" in c.reason, (addr, c)
            assert c.invalid_block_ids == rec.block_ids
            D.finish(f"undialable-{i}")
        assert len(os.listdir(f"/proc/{d.proc.pid}/fd")) <= fds
        # Addresses that are not printable ASCII (they reach log lines as they are:
        # a newline would forge one) are refused at the door, with a clear error.
        for addr in ["10.0.0.1:5555\n2026-11-27 CRITICAL forged:1", "épée:1", "a b:1", ":::"]:
            sent.remote = RemoteEngine(good.engine_id, 1, [addr])
            with pytest.raises(BadRequest) as e:
                D.clients[0].read(D.engine_id, "refused", [[1], [2]], sent.remote,
                                  sent.block_ids)
            assert "handshake address" in e.value.message or "host:port" in e.value.message
        assert "forged" not in d.read_log()
        D.start_read(P.prefill("after", Request(seed=6, prompt_tokens=60)))
        got = _completion(D, "after")
        assert {c.kind for c in got.values()} == {"received"}, got
        assert not D.verify("after")
    finally:
        D.close()
        P.close()
        rc = d.stop(timeout_s=60)
    assert rc == 0, d.read_log()


async def test_engines_past_max_engines_are_refused_and_counted(pool, tmp_path) -> None:
    """Registrations past ``--max-engines`` (3 here; each engine costs a NIXL agent,
    a thread and ~16 fds, measured) get ``unavailable`` naming the flag, also
    when they arrive all at once, and are counted in one series; the engines
    registered keep reading oracle-exact bytes, and a deregistration makes room.
    Before: no bound (200 registrations of one client: +3,200 fds, +400
    threads, +1 GB RSS in the sidecar, growing linearly)."""
    d = SidecarProcess(tmp_path, "d-max-engines",
                       args=["--max-engines", "3", "--metrics-port", "0"]).start()
    P = SimEngine(pool.uid("P"), hybrid, 1, 96, pool.p[:1])
    D = SimEngine(pool.uid("D"), hybrid, 1, 96, [d])
    extra = AsyncSidecarClient(d.socket, timeout_s=60)
    layout = attn(2)(1, 4)
    try:
        # One more engine fits; then six registrations at once: one of them fits
        # (3 in all), five are refused, none registered past the bound.
        await extra.register("extra-0", 0, layout, allocate=True)
        got = await asyncio.gather(*(extra.register(f"extra-{i}", 0, layout, allocate=True)
                                     for i in range(1, 7)), return_exceptions=True)
        refused = [e for e in got if isinstance(e, Exception)]
        assert len(refused) == 5, got
        for e in refused:
            assert isinstance(e, Unavailable) and "--max-engines 3" in e.message, e
        assert d.metric("kvsidecar_limit_refusals_total", limit="engines") == 5
        assert d.metric("kvsidecar_engines") == 3
        D.start_read(P.prefill("at-limit", Request(seed=7, prompt_tokens=60)))
        assert {c.kind for c in _completion(D, "at-limit").values()} == {"received"}
        assert not D.verify("at-limit")
        registered = [f"extra-{i}" for i, r in enumerate([None, *got]) if not
                      isinstance(r, Exception)]
        await extra.deregister(registered[-1])
        await extra.register("extra-again", 0, layout, allocate=True)
        await extra.deregister("extra-again")
        await extra.deregister(registered[0])
        # Reservations (64 per sidecar): refusals of fresh ids share one series too,
        # so ids sent past a limit do not grow the registry.
        held = [await extra.reserve(f"res-{i}", 4096) for i in range(MAX_RESERVATIONS)]
        for i in range(3):
            with pytest.raises(Unavailable):
                await extra.reserve(f"res-refused-{i}", 4096)
        assert d.metric("kvsidecar_limit_refusals_total", engine="",
                        limit="reservations") == 3
        for i, region in enumerate(held):
            region.close()
            await extra.deregister(f"res-{i}")
    finally:
        await extra.close()
        D.close()
        P.close()
        rc = d.stop(timeout_s=60)
    assert rc == 0, d.read_log()


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
async def test_host_memory_past_the_machine_is_refused_not_oom(pool, tmp_path) -> None:
    """An engine asks a real sidecar for more host memory than the machine has
    (a 4 TiB memfd reservation, a 16 TiB memfd engine): each is refused with
    'unavailable' naming the OOM killer before anything is reserved, and the
    sidecar then serves a D engine's oracle-exact read. Before: the sidecar
    reserved the memfd's pages until memory ran out, and the kernel's OOM
    killer killed five processes on the host, the sidecar among them. The
    sidecar runs under a file size limit of 1 GiB, so that should the guard
    ever fail the allocation fails (EFBIG) instead of taking the host's memory."""
    d = SidecarProcess(tmp_path, "d-host-memory",
                       launcher=["prlimit", f"--fsize={1 << 30}", "--"]).start()
    P = SimEngine(pool.uid("P"), hybrid, 1, 96, pool.p[:1])
    D = SimEngine(pool.uid("D"), hybrid, 1, 96, [d])
    client = AsyncSidecarClient(d.socket, timeout_s=60)
    huge = attention_layout(model="huge", num_layers=64, total_kv_heads=64, head_dim=256,
                            block_tokens=64, tp_size=1, num_blocks=1 << 16)
    try:
        with pytest.raises(Unavailable, match="OOM killer"):
            await client.reserve("too-big-reserve", 1 << 42, "memfd")
        with pytest.raises(Unavailable, match="OOM killer"):
            await client.register("too-big-engine", 0, huge, allocate=True, memory="memfd")
        D.start_read(P.prefill("after-huge", Request(seed=9, prompt_tokens=60)))
        assert {c.kind for c in _completion(D, "after-huge").values()} == {"received"}
        assert not D.verify("after-huge")
    finally:
        await client.close()
        D.close()
        P.close()
        rc = d.stop(timeout_s=60)
    assert rc == 0, d.read_log()


def test_incompatible_peer_is_refused_by_field(pool) -> None:
    def other(tp: int, nb: int):
        return attention_layout(model="e2e-attn", num_layers=3, total_kv_heads=8, head_dim=32,
                                block_tokens=8, tp_size=tp, num_blocks=nb)

    with pool.engines(attn(8), 1, 1) as (P, _), pool.engines(other, 1, 1) as (_, (D,)):
        sent = P.prefill("mismatch", Request(seed=4, prompt_tokens=16))
        D.start_read(sent)
        got = _completion(D, "mismatch")
        assert got[0].kind == "failed"
        assert "model.head_dim" in got[0].reason


def test_wrong_engine_id_at_address_is_refused(pool) -> None:
    with pool.engines(attn(8), 1, 1) as (P, (D,)):
        sent = P.prefill("who", Request(seed=4, prompt_tokens=16))
        sent.remote = RemoteEngine("nobody", 1, sent.remote.handshake)
        D.start_read(sent)
        got = _completion(D, "who")
        assert got[0].kind == "failed"
        assert "nobody" in got[0].reason


def test_bad_requests_get_typed_errors(pool) -> None:
    with pool.engines(hybrid, 1, 1) as (P, (D,)):
        c = D.clients[0]
        sent = P.prefill("bad", Request(seed=5, prompt_tokens=16))
        n = D.layout.num_blocks
        with pytest.raises(BadRequest, match=rf"block id {n} out of range"):
            c.read(D.engine_id, "bad", [[n], [0]], sent.remote, sent.block_ids)
        with pytest.raises(BadRequest, match="name 1 groups"):
            c.read(D.engine_id, "bad", [[1]], sent.remote, sent.block_ids)
        with pytest.raises(BadRequest, match="tp_size 3 but 2 handshake addresses"):
            c.read(D.engine_id, "bad", [[1], [2]],
                   RemoteEngine(P.engine_id, 3, ["127.0.0.1:1"] * 2), sent.block_ids)
        with pytest.raises(BadRequest, match="named twice"):
            c.read(D.engine_id, "bad", [[1], [1]], sent.remote, sent.block_ids)
        with pytest.raises(UnknownEngine, match="'ghost' is not registered"):
            c.poll("ghost")
        with pytest.raises(Duplicate, match="already registered"):  # not a retry: differs
            c.register(D.engine_id, 0, D.layout.with_blocks(D.layout.num_blocks + 1),
                       allocate=True)
        with pytest.raises(BadRequest, match="block id"):
            P.clients[0].hold(P.engine_id, "bad2", [[10**6], []])
        with pytest.raises(Duplicate):
            P.clients[0].hold(P.engine_id, "bad", sent.block_ids)
        # Nothing accepted was lost: the good request still goes through.
        D.start_read(sent)
        got = _completion(D, "bad")
        assert {x.kind for x in got.values()} == {"received"}
        assert not D.verify("bad")


def test_attach_with_wrong_region_size_is_refused(pool) -> None:
    layout = attention_layout(model="m", num_layers=2, total_kv_heads=2, head_dim=8,
                              block_tokens=4, tp_size=1, num_blocks=8)
    small = [ShmRegion.create(unique_name(ENGINE_SHM_PREFIX + "t"), layout.region_bytes // 2)
             for _ in range(2)]
    try:
        with SidecarClient(pool.d[0].socket) as c:
            with pytest.raises(BadRequest, match="the layout needs exactly 8 pages"):
                c.register(pool.uid("A"), 0, layout, regions=small)
            with pytest.raises(BadRequest, match="tp_rank 1 outside"):
                c.register(pool.uid("A"), 1, layout, allocate=True)
    finally:
        for r in small:
            r.close()
            r.unlink()


def test_malformed_messages_get_errors_and_the_daemon_keeps_serving(pool) -> None:
    s = BlockingChannel(pool.d[1].socket, timeout_s=5.0)
    try:
        bad = [
            b"\xc1garbage",
            msgspec.msgpack.encode({"op": "read", "id": 4, "v": 1}),
            msgspec.msgpack.encode({"op": "explode", "id": 5, "v": 1}),
            msgspec.msgpack.encode({"op": "ping", "id": 6, "v": 99}),
            msgspec.msgpack.encode([1, 2, 3]),
            b"",
        ]
        for raw in bad:
            s.send(raw)
            reply = decode_reply(s.recv())
            assert isinstance(reply, Error), reply
            assert reply.code in ("bad_message", "version")
    finally:
        s.close()
    with SidecarClient(pool.d[1].socket) as c:
        assert c.ping().version == 1


def test_engine_process_exit_releases_its_registration(pool, tmp_path) -> None:
    """An engine that dies without deregistering is noticed by pid and cleaned up."""
    script = textwrap.dedent(f"""
        from kvsidecar.ipc.client import SidecarClient
        from kvsidecar.ipc.layout import attention_layout
        layout = attention_layout(model="m", num_layers=1, total_kv_heads=2, head_dim=8,
                                  block_tokens=4, tp_size=1, num_blocks=4)
        c = SidecarClient({pool.d[2].socket!r})
        reg = c.register("crashy", 0, layout, allocate=True, memory="shm")
        print(reg.regions[0].name, flush=True)
        import os; os._exit(1)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=False)
    shm_name = out.stdout.strip()
    assert shm_name, out.stderr
    with SidecarClient(pool.d[2].socket) as c:
        deadline = time.monotonic() + 20
        while "crashy" in c.ping().engines:
            assert time.monotonic() < deadline, "dead engine never released"
            time.sleep(0.1)
    # Its memory goes right after (once its NIXL agent has stopped).
    while os.path.exists(f"/dev/shm/{shm_name}"):
        assert time.monotonic() < deadline, "allocated region never unlinked"
        time.sleep(0.1)


def test_an_engine_that_dies_during_its_registration_is_released_by_pid(pool) -> None:
    """A client killed mid-request: it sends its registration and exits at once
    (the sidecar's NIXL agent alone takes longer to make), so the registration
    finishes for a process that is gone. The sidecar releases it by pid, as for
    any engine that dies, and the restarted engine registers the same id and
    reads oracle-exact bytes. Before: the dead pid was taken for one it cannot
    check ("liveness by its requests only"), the memory stayed for the whole
    --engine-lease (30 s) and the restart's registration was refused meanwhile as
    'already registered (by a live process)'."""
    side = pool.d[3]
    engine_id = pool.uid("dies-registering-")
    script = textwrap.dedent(f"""
        import os
        from kvsidecar.ipc.layout import attention_layout
        from kvsidecar.ipc.protocol import Register, encode_request
        from kvsidecar.ipc.seqpacket import BlockingChannel
        layout = attention_layout(model="m", num_layers=1, total_kv_heads=2, head_dim=8,
                                  block_tokens=4, tp_size=1, num_blocks=4)
        chan = BlockingChannel({side.socket!r}, timeout_s=30)
        chan.send(encode_request(Register({engine_id!r}, 0, layout, "allocate", [], False,
                                          os.getpid(), os.readlink("/proc/self/ns/pid"),
                                          "the-dead-one", id=1)))
        os._exit(0)  # gone before the reply
    """)
    subprocess.run([sys.executable, "-c", script], timeout=60, check=True)
    with SidecarClient(side.socket) as c:
        deadline = time.monotonic() + 60
        while f"registered engine {engine_id!r}" not in side.log_path.read_text():
            assert time.monotonic() < deadline, "the registration never finished"
            time.sleep(0.05)
        while engine_id in c.ping().engines:
            assert time.monotonic() < deadline, "dead engine never released"
            time.sleep(0.1)

    def released() -> list[str]:
        return [line for line in side.log_path.read_text().splitlines()
                if f"engine {engine_id!r} released" in line]

    while not released():  # logged once its agent has stopped
        assert time.monotonic() < deadline, "no release logged"
        time.sleep(0.05)
    assert "exited" in released()[0], released()
    P = SimEngine(pool.uid("P"), hybrid, 1, 96, pool.p[:1])
    D = SimEngine(engine_id, hybrid, 1, 96, [side])
    try:
        D.start_read(P.prefill("restarted", Request(seed=8, prompt_tokens=60)))
        assert {c.kind for c in _completion(D, "restarted").values()} == {"received"}
        assert not D.verify("restarted")
    finally:
        D.close()
        P.close()


def test_sigterm_finishes_or_aborts_in_flight_reads_and_cleans_up(pool, tmp_path) -> None:
    sidecar = SidecarProcess(tmp_path, "short-lived").start()
    P = SimEngine(pool.uid("P"), hybrid, 1, 96, pool.p[:1])
    D = SimEngine(pool.uid("D"), hybrid, 1, 96, [sidecar], timeout_s=3)
    try:
        rids = [f"term-{i}" for i in range(12)]
        for i, rid in enumerate(rids):
            D.start_read(P.prefill(rid, Request(seed=i, prompt_tokens=60 + i)))
        sidecar.terminate()
        got = D.wait_for(rids, timeout_s=30)
        for rid in rids:
            c = got[rid][0]
            assert c.kind in ("received", "aborted"), c
            if c.kind == "received":
                assert not D.verify(rid)
            else:
                assert "shutting down" in c.reason and c.invalid_block_ids
        assert sidecar.stop() == 0
        assert not os.path.exists(sidecar.socket)
        assert "stopped" in sidecar.read_log()
    finally:
        sidecar.kill()
        D.close()
        P.close()


async def test_async_client_against_a_real_sidecar(pool) -> None:
    layout = attention_layout(model="m", num_layers=2, total_kv_heads=2, head_dim=8,
                              block_tokens=4, tp_size=1, num_blocks=8)
    eid = pool.uid("async")
    async with AsyncSidecarClient(pool.d[3].socket) as c:
        reg = await c.register(eid, 0, layout, allocate=True)
        try:
            assert len(reg.regions) == 2 and reg.regions[0].nbytes == layout.region_bytes
            pong, polled = await asyncio.gather(c.ping(), c.poll(eid))
            assert eid in pong.engines and polled == []
            await c.hold(eid, "h", [[1, 2]], timeout_s=0.2)
            deadline = time.monotonic() + 10
            while not (items := await c.poll(eid)):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            assert [(x.request_id, x.kind) for x in items] == [("h", "expired")]
        finally:
            await c.deregister(eid)
            for r in reg.regions:
                r.close()


def test_kept_registration_survives_engine_restart(pool) -> None:
    """keep_on_exit: the sidecar keeps allocated memory (and its KV) for a restarted
    engine; without it the memory goes with the engine."""
    script = textwrap.dedent(f"""
        from kvsidecar.ipc.client import SidecarClient
        from kvsidecar.ipc.layout import attention_layout
        layout = attention_layout(model="m", num_layers=1, total_kv_heads=2, head_dim=8,
                                  block_tokens=4, tp_size=1, num_blocks=4)
        c = SidecarClient({pool.d[2].socket!r})
        reg = c.register("phoenix", 0, layout, allocate=True, keep_on_exit=True,
                         memory="shm")
        reg.regions[0].numpy()[:4] = [1, 2, 3, 4]
        print(reg.regions[0].name, flush=True)
        import os; os._exit(1)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=False)
    shm_name = out.stdout.strip()
    assert shm_name, out.stderr
    layout = attention_layout(model="m", num_layers=1, total_kv_heads=2, head_dim=8,
                              block_tokens=4, tp_size=1, num_blocks=4)
    with SidecarClient(pool.d[2].socket) as c:
        time.sleep(1.5)  # past a liveness check: the dead pid must not release it
        assert "phoenix" in c.ping().engines
        with pytest.raises(Duplicate, match="differs"):
            c.register("phoenix", 0, layout.with_blocks(8), allocate=True, memory="shm")
        reg = c.register("phoenix", 0, layout, allocate=True, memory="shm")
        mapped = list(reg.regions)
        try:
            assert reg.regions[0].name == shm_name
            assert reg.regions[0].numpy()[:4].tolist() == [1, 2, 3, 4]
            # The same process registering the same again (a retry) gets the same.
            again = c.register("phoenix", 0, layout, allocate=True, memory="shm")
            mapped += again.regions
            assert [r.name for r in again.regions] == [r.name for r in reg.regions]
        finally:
            for r in mapped:
                r.close()
            c.deregister("phoenix")
    deadline = time.monotonic() + 20
    while os.path.exists(f"/dev/shm/{shm_name}"):
        assert time.monotonic() < deadline, "region not unlinked after deregister"
        time.sleep(0.1)


def _stuck_pipeline(chan: BlockingChannel) -> int:
    """Pings on ``chan`` without reading replies, until the daemon stops taking
    them (2 s without one more): how many it took."""
    chan.sock.setblocking(False)
    sent, stuck_since = 0, 0.0
    while sent < 20_000:
        try:
            chan.sock.send(msgspec.msgpack.encode({"op": "ping", "id": sent, "v": 1}))
        except BlockingIOError:
            stuck_since = stuck_since or time.monotonic()
            if time.monotonic() - stuck_since > 2.0:
                break
            time.sleep(0.01)
            continue
        stuck_since = 0.0
        sent += 1
    chan.sock.settimeout(30)
    return sent


def test_channel_attacks_on_both_sidecars_leave_a_transfer_whole(pool) -> None:
    """While the P and the D sidecar of a transfer are both under attack on their
    engine sockets (five long messages of the 32 MiB backstop announced and
    stalled: four held, the fifth refused ``unavailable``; a connection that
    pipelines pings and reads no reply; garbage), a transfer between them moves
    the oracle's bytes. Then the pipeliners read every reply, once, in order."""
    header = b"\xc1KVL" + (2 * (16 << 20)).to_bytes(8, "little")
    held: list[BlockingChannel] = []
    try:
        with pool.engines(hybrid, 1, 1) as (P, (D,)):
            pipes = []
            for side in (pool.p[0], pool.d[0]):
                stalled = [BlockingChannel(side.socket, timeout_s=30) for _ in range(5)]
                held += stalled
                for chan in stalled:
                    chan.sock.send(header)
                deadline = time.monotonic() + 30
                while not any(chan.readable(0) for chan in stalled):
                    assert time.monotonic() < deadline, "no long message refused"
                    time.sleep(0.05)
                refused = [chan for chan in stalled if chan.readable(0.2)]
                assert len(refused) == 1
                err = decode_reply(refused[0].recv())
                assert isinstance(err, Error) and err.code == "unavailable", err
                pipe = BlockingChannel(side.socket, timeout_s=30)
                held.append(pipe)
                pipes.append((pipe, _stuck_pipeline(pipe)))
                with BlockingChannel(side.socket, timeout_s=30) as junk:
                    junk.send(os.urandom(200))
                    err = decode_reply(junk.recv())
                    assert isinstance(err, Error) and err.code == "bad_message", err
            D.start_read(P.prefill("attacked", Request(seed=5, prompt_tokens=60)))
            got = D.wait_for(["attacked"], timeout_s=120)
            assert {c.kind for c in got["attacked"].values()} == {"received"}, got
            problems = D.verify("attacked")
            assert not problems, problems[:3]
            for pipe, sent in pipes:
                ids = [decode_reply(pipe.recv()).id for _ in range(sent)]
                assert ids == list(range(sent))
    finally:
        for chan in held:
            chan.close()
