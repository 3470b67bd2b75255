"""One local engine (or process) must not starve the others (real sidecars).

Before: a read naming 4,096 dead addresses made other engines' reads fail at
once (the handshake client's connections were all waiting for the dead);
256 idle engine connections refused every new client for as long as they
stayed; 64 idle fd-socket connections made memfd registrations fail.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvsidecar.ipc import hold_token
from kvsidecar.ipc.client import SidecarClient
from kvsidecar.ipc.fdpass import fd_socket_for
from kvsidecar.ipc.memfd import MemfdRegion
from kvsidecar.ipc.protocol import KeepItem, RemoteEngine
from kvsidecar.ipc.seqpacket import BlockingChannel
from kvsidecar.sim.cluster import SidecarProcess, engines
from kvsidecar.sim.models import attn, hybrid
from kvsidecar.sim.oracle import Request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

_ids = itertools.count()


def _uid(prefix: str) -> str:
    return f"st-{prefix}{next(_ids)}"


def _idle(path: str, n: int) -> list[socket.socket]:
    """``n`` connections that never send a byte."""
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(path)
        out.append(s)
    return out


def _closed_by_peer(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(64) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


@pytest.fixture
def closing() -> Iterator[list[socket.socket]]:
    made: list[socket.socket] = []
    yield made
    for s in made:
        s.close()


def test_a_read_naming_thousands_of_dead_addresses_fails_alone(pool, tmp_path: Path) -> None:
    """Engine A, on the same D sidecar as engine B, reads from a P engine of 4,096
    ranks at dead addresses, again and again; each time B reads from a P engine it
    has never linked to (a new handshake): B's reads are oracle-exact, A's fail."""
    d = SidecarProcess(tmp_path, "st-d", args=["--handshake-timeout", "5"]).start()
    attacker = SidecarClient(d.socket, timeout_s=60)
    layout = attn(2)(1, 16)
    try:
        attacker.register("st-attacker", 0, layout, allocate=True)
        n = 4096
        dead = [f"127.1.{i // 256}.{i % 256}:9" for i in range(n)]
        for rnd in range(3):
            # Well-formed tokens of a key of its own: D can check them only against
            # the P ranks' handshakes, so the read goes on to its 4,096 handshakes.
            forged = hold_token.issue(os.urandom(hold_token.KEY_BYTES), "gone", f"wide-{rnd}",
                                      [[0]], int(time.time()) + 600)
            attacker.read("st-attacker", f"wide-{rnd}", [[0]], RemoteEngine("gone", n, dead),
                          [[0]], remote_tokens=[forged] * n)
            time.sleep(0.5)  # its handshakes are under way
            with engines(pool.p[:1], [d], _uid, hybrid, 1, 1) as (P, (D,)):
                rid = f"legit-{rnd}"
                D.start_read(P.prefill(rid, Request(seed=rnd, prompt_tokens=60)))
                got = D.wait_for([rid], timeout_s=120)[rid][0]
                assert got.kind == "received", got
                assert not D.verify(rid)
        deadline = time.monotonic() + 60
        failed: list[str] = []
        while len(failed) < 3:
            assert time.monotonic() < deadline, failed
            failed += [c.request_id for c in attacker.poll("st-attacker") if c.kind == "failed"]
            time.sleep(0.05)
        assert sorted(failed) == ["wide-0", "wide-1", "wide-2"]
        assert d.alive()
    finally:
        attacker.close()
        assert d.stop() == 0


def test_idle_engine_connections_do_not_lock_new_clients_out(tmp_path: Path,
                                                             closing) -> None:
    d = SidecarProcess(tmp_path, "st-engine", args=["--max-engine-connections", "16",
                                                    "--metrics-port", "0"]).start()
    try:
        closing += _idle(d.socket, 16)  # every slot
        time.sleep(1.5)
        with SidecarClient(d.socket, timeout_s=30) as c:
            assert c.ping().version >= 1
            reg = c.register("st-newcomer", 0, attn(2)(1, 8), allocate=True)
            for r in reg.regions:
                r.close()
            c.deregister("st-newcomer")
        assert d.metric("kvsidecar_refused_total", channel="engine",
                        reason="idle_evicted") >= 1
    finally:
        assert d.stop() == 0


def test_an_idle_engine_connection_that_never_registered_is_closed(tmp_path: Path,
                                                                   closing) -> None:
    d = SidecarProcess(tmp_path, "st-deadline", args=["--engine-idle-timeout", "2",
                                                      "--metrics-port", "0"]).start()
    try:
        closing += _idle(d.socket, 4)
        with SidecarClient(d.socket, timeout_s=30) as c:  # an engine's own connection
            reg = c.register("st-kept", 0, attn(2)(1, 8), allocate=True)
            deadline = time.monotonic() + 30
            while not all(_closed_by_peer(s) for s in closing):
                assert time.monotonic() < deadline, "idle connections were never closed"
                time.sleep(0.2)
            time.sleep(3)  # past the deadline: the registered connection stays
            assert c.poll("st-kept") == []
            assert d.metric("kvsidecar_refused_total", channel="engine",
                            reason="idle_timeout") >= 4
            # A client whose idle connection was closed reconnects on its next call.
            other = SidecarClient(d.socket, timeout_s=30)
            assert other.ping().version >= 1
            time.sleep(5)
            assert other.ping().version >= 1
            other.close()
            for r in reg.regions:
                r.close()
            c.deregister("st-kept")
    finally:
        assert d.stop() == 0


def test_idle_fd_socket_connections_do_not_fail_registrations(tmp_path: Path,
                                                               closing) -> None:
    d = SidecarProcess(tmp_path, "st-fd", args=["--metrics-port", "0"]).start()
    try:
        closing += _idle(fd_socket_for(d.socket), 64)  # the fd socket's every slot
        time.sleep(1.5)
        with SidecarClient(d.socket, timeout_s=30) as c:
            reg = c.register("st-memfd", 0, attn(2)(1, 8), allocate=True, memory="memfd")
            assert all(isinstance(r, MemfdRegion) for r in reg.regions)
            reg.regions[0].numpy()[:4] = 7
            for r in reg.regions:
                r.close()
            c.deregister("st-memfd")
        assert d.metric("kvsidecar_refused_total", channel="fd", reason="idle_evicted") >= 1
    finally:
        assert d.stop() == 0


def _pinned(path: str, n: int, engine_id: str) -> list[BlockingChannel]:
    """``n`` connections that each sent the same Reserve (the first makes the
    reservation, the rest are retries, each answered ``reserved``)."""
    out = []
    for i in range(n):
        ch = BlockingChannel(path, timeout_s=30)
        out.append(ch)
        ch.send(msgspec.msgpack.encode({"op": "reserve", "id": i + 1, "v": 1,
                                        "engine_id": engine_id, "nbytes": 4096}))
        assert msgspec.msgpack.decode(ch.recv())["op"] == "reserved"
    return out


def _closed(ch: BlockingChannel) -> bool:
    """Whether the sidecar closed ``ch`` (looked at without consuming or blocking:
    the channel's socket has a timeout, so a plain recv would wait for it)."""
    readable, _, _ = select.select([ch.sock], [], [], 0)
    if not readable:
        return False
    try:
        return ch.sock.recv(64, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _refused_at_once(path: str) -> dict[str, str]:
    """What a new connection is told before it sends anything (a refusal)."""
    ch = BlockingChannel(path, timeout_s=30)
    try:
        return dict(msgspec.msgpack.decode(ch.recv()))
    finally:
        ch.close()


def test_connections_of_a_deregistered_engine_do_not_hold_the_slots(tmp_path: Path) -> None:
    """Every slot taken by connections that each got a ``Reserved`` reply: while
    the reservation lives they are an engine's own and a newcomer is refused;
    once it is deregistered they are idle connections like any other, so one is
    evicted for the next newcomer. Before, a Registered/Reserved reply exempted
    its connection from the idle rules for as long as it stayed open."""
    d = SidecarProcess(tmp_path, "st-pinned", args=["--max-engine-connections", "8",
                                                    "--metrics-port", "0"]).start()
    pins = _pinned(d.socket, 8, "st-pin")
    try:
        time.sleep(1.5)  # past the idle grace
        refused = _refused_at_once(d.socket)
        assert refused["code"] == "unavailable"
        assert "--max-engine-connections" in refused["message"]
        pins[0].send(msgspec.msgpack.encode({"op": "deregister", "id": 99, "v": 1,
                                             "engine_id": "st-pin"}))
        assert msgspec.msgpack.decode(pins[0].recv())["op"] == "ok"
        with SidecarClient(d.socket, timeout_s=30) as c:
            assert c.ping().version >= 1
        assert d.metric("kvsidecar_refused_total", channel="engine",
                        reason="idle_evicted") == 1
    finally:
        for ch in pins:
            ch.close()
        assert d.stop() == 0


def test_idle_connections_of_a_deregistered_engine_are_closed(tmp_path: Path) -> None:
    """The audit's sequence: 8 slots (the limit) hold a Reserve's reply each, the
    engine id is deregistered, 6 s pass (--engine-idle-timeout 2): the idle
    connections are closed and a new client is served. Before, it was refused
    (``already serves 8 engine connections``)."""
    d = SidecarProcess(tmp_path, "st-gone", args=["--max-engine-connections", "8",
                                                  "--engine-idle-timeout", "2",
                                                  "--metrics-port", "0"]).start()
    pins = _pinned(d.socket, 8, "st-gone")
    try:
        time.sleep(3)  # past the idle timeout: the reservation lives, they stay
        assert not any(_closed(ch) for ch in pins)
        pins[0].send(msgspec.msgpack.encode({"op": "deregister", "id": 99, "v": 1,
                                             "engine_id": "st-gone"}))
        assert msgspec.msgpack.decode(pins[0].recv())["op"] == "ok"
        time.sleep(6)
        assert all(_closed(ch) for ch in pins)
        with SidecarClient(d.socket, timeout_s=30) as c:
            assert c.ping().version >= 1
        assert d.metric("kvsidecar_refused_total", channel="engine",
                        reason="idle_timeout") == 8
    finally:
        for ch in pins:
            ch.close()
        assert d.stop() == 0


def _keep_items(n: int, p_tp: int, prefix: str, address: str = "127.0.0.1:9",
                addresses: int | None = None) -> list[KeepItem]:
    remote = RemoteEngine("st-dead-p", p_tp, [address] * (p_tp if addresses is None
                                                          else addresses))
    return [KeepItem(remote, f"{prefix}{i}") for i in range(n)]


def test_keeps_are_bounded_and_another_engine_stays_served(tmp_path: Path) -> None:
    """Keeps naming P engines at a dead address: one asking for more claims than
    a message may is refused whole (``bad_request``), as is one whose remote has
    fewer addresses than ranks; the claims in flight are bounded per engine
    (``unavailable``, counted), and another engine's pings stay fast. Before,
    4 Keeps of 256 items x 512 ranks were all answered ``ok`` and spawned
    524,288 claims: another engine's ping took 11 s, the daemon grew by 1 GB."""
    from kvsidecar.daemon.keeps import (
        MAX_KEEP_CLAIMS_PER_ENGINE,
        MAX_KEEP_CLAIMS_PER_MESSAGE,
    )
    from kvsidecar.ipc.errors import BadRequest, Unavailable

    d = SidecarProcess(tmp_path, "st-keep", args=["--metrics-port", "0",
                                                  "--handshake-timeout", "3"]).start()
    try:
        with SidecarClient(d.socket, timeout_s=30) as c, \
                SidecarClient(d.socket, timeout_s=30) as other:
            reg = c.register("st-keeper", 0, attn(2)(1, 8), allocate=True)
            with pytest.raises(BadRequest, match="over 4096 per message"):
                c.keep("st-keeper", _keep_items(256, 512, "big"))
            with pytest.raises(BadRequest, match="tp_size 4 but 1 handshake addresses"):
                c.keep("st-keeper", _keep_items(1, 4, "short", addresses=1))
            per_message = MAX_KEEP_CLAIMS_PER_MESSAGE // 256  # P ranks: a full message
            rounds = MAX_KEEP_CLAIMS_PER_ENGINE // MAX_KEEP_CLAIMS_PER_MESSAGE
            for k in range(rounds):  # up to the bound: accepted
                c.keep("st-keeper", _keep_items(256, per_message, f"r{k}-"))
            for k in range(4):  # past it: refused, each counted; another engine served
                with pytest.raises(Unavailable, match="keep claims in flight"):
                    c.keep("st-keeper", _keep_items(256, per_message, f"x{k}-"))
                assert other.ping().version >= 1
            assert d.metric("kvsidecar_limit_refusals_total", engine="st-keeper",
                            limit="keep_claims") == 4
            deadline = time.monotonic() + 60  # the claims end (unanswered): room again
            while True:
                try:
                    c.keep("st-keeper", _keep_items(256, per_message, "later-"))
                    break
                except Unavailable:
                    assert time.monotonic() < deadline, "keep claims never ended"
                    time.sleep(0.5)
            for r in reg.regions:
                r.close()
            c.deregister("st-keeper")
    finally:
        assert d.stop() == 0
