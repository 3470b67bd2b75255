"""End to end: engine liveness without pids, idempotent registration, and a
sidecar removing only its own stale shared memory at start-up."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsidecar.daemon.engines.memory import shm_prefix_for
from kvsidecar.ipc.client import (
    AsyncSidecarClient,
    Duplicate,
    SidecarClient,
    Unavailable,
    process_instance,
)
from kvsidecar.ipc.layout import attention_layout
from kvsidecar.ipc.memory import ShmRegion
from kvsidecar.ipc.protocol import (
    Register,
    Registered,
    RemoteEngine,
    decode_reply,
    encode_request,
)
from kvsidecar.ipc.seqpacket import BlockingChannel
from kvsidecar.sim.cluster import SidecarProcess

pytestmark = pytest.mark.e2e

LEASE_S = 2.0
LAYOUT = attention_layout(model="m", num_layers=1, total_kv_heads=2, head_dim=8, block_tokens=4,
                          tp_size=1, num_blocks=4)


@pytest.fixture(scope="module")
def stale(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[str]]]:
    """Segments a previous run of the sidecar (same socket) left, and one of
    another sidecar, created before the sidecar under test starts."""
    workdir = tmp_path_factory.mktemp("lifecycle")
    mine = shm_prefix_for(str(workdir / "lease.sock"))
    theirs = shm_prefix_for(str(workdir / "another-sidecar.sock"))
    names = [f"{mine}-old-engine-1", f"{mine}-old-engine-2", f"{theirs}-their-engine"]
    for n in names:
        ShmRegion.create(n, 4096).close()
    yield workdir, names
    for n in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{n}")


@pytest.fixture(scope="module")
def sidecar(stale: tuple[Path, list[str]]) -> Iterator[SidecarProcess]:
    workdir, _ = stale
    s = SidecarProcess(workdir, "lease", args=[
        "--engine-lease", str(LEASE_S), "--max-reads-per-engine", "3",
        "--max-holds-per-engine", "4", "--max-completions-per-engine", "6",
        "--handshake-timeout", "60", "--allow-unsealed-shm"]).start()
    yield s
    assert s.stop() == 0


def test_start_up_removes_only_its_own_stale_segments(sidecar, stale) -> None:
    _, (mine1, mine2, theirs) = stale
    assert not os.path.exists(f"/dev/shm/{mine1}")
    assert not os.path.exists(f"/dev/shm/{mine2}")
    assert os.path.exists(f"/dev/shm/{theirs}"), "another sidecar's segment was removed"
    log = sidecar.read_log()
    assert "removed 2 shared memory segment(s)" in log and mine1 in log and theirs not in log


def _register_raw(socket: str, engine_id: str, pid: int, pid_ns: str) -> Registered:
    """Register as an engine whose pid the sidecar cannot check (another PID
    namespace), the way a container without a shared PID namespace does."""
    with BlockingChannel(socket, timeout_s=30) as sock:
        sock.send(encode_request(Register(engine_id, 0, LAYOUT, "allocate", [], False, pid,
                                          pid_ns, "other-container", "shm", id=1)))
        reply = decode_reply(sock.recv())
    assert isinstance(reply, Registered), reply
    return reply


def test_engine_in_another_pid_namespace_lives_while_it_polls(sidecar) -> None:
    # pid 1 exists here too (so a pid check would even say "alive"), but it is
    # not the engine: the foreign namespace makes the sidecar ignore it.
    reg = _register_raw(sidecar.socket, "foreign", 1, "pid:[1]")
    shm = f"/dev/shm/{reg.regions[0].name}"
    assert reg.regions[0].name.startswith(shm_prefix_for(sidecar.socket) + "-")
    with SidecarClient(sidecar.socket) as c:
        # Polling for three leases keeps it registered...
        until = time.monotonic() + 3 * LEASE_S
        while time.monotonic() < until:
            assert c.poll("foreign") == []
            assert "foreign" in c.ping().engines
            time.sleep(LEASE_S / 8)
        # ...and once it stops, it is released with its memory.
        deadline = time.monotonic() + 60
        while "foreign" in c.ping().engines:
            assert time.monotonic() < deadline, "silent engine never released"
            time.sleep(0.1)
    while os.path.exists(shm):
        assert time.monotonic() < deadline, "released engine's memory never unlinked"
        time.sleep(0.1)
    assert "sent no request for" in sidecar.read_log()


def test_a_pid_the_sidecar_cannot_see_does_not_release_the_engine(sidecar) -> None:
    """Same namespace string but a pid that does not exist: not trusted either."""
    own_ns = os.readlink("/proc/self/ns/pid")
    _register_raw(sidecar.socket, "ghost-pid", 4_000_000, own_ns)
    with SidecarClient(sidecar.socket) as c:
        until = time.monotonic() + 2 * LEASE_S
        while time.monotonic() < until:
            c.poll("ghost-pid")
            assert "ghost-pid" in c.ping().engines
            time.sleep(LEASE_S / 8)
        c.deregister("ghost-pid")


async def test_a_retried_registration_is_the_same_registration(sidecar) -> None:
    """A client retrying register (its first reply lost to a timeout) must not
    get Duplicate: concurrent and later retries join the same registration."""
    async with AsyncSidecarClient(sidecar.socket) as c:
        first, second = await asyncio.gather(
            c.register("retry", 0, LAYOUT, allocate=True),
            c.register("retry", 0, LAYOUT, allocate=True))
        third = await c.register("retry", 0, LAYOUT, allocate=True)
        try:
            names = [r.name for r in first.regions]
            assert [r.name for r in second.regions] == names
            assert [r.name for r in third.regions] == names
            assert first.agent_name == second.agent_name == third.agent_name
        finally:
            for r in [*first.regions, *second.regions, *third.regions]:
                r.close()
            await c.deregister("retry")


def test_another_process_with_the_same_engine_id_is_refused(sidecar) -> None:
    with SidecarClient(sidecar.socket) as c:
        reg = c.register("taken", 0, LAYOUT, allocate=True)
        try:
            with BlockingChannel(sidecar.socket, timeout_s=30) as sock:
                sock.send(encode_request(Register("taken", 0, LAYOUT, "allocate", [], False, 0,
                                                  "", "someone-else", id=1)))
                reply = decode_reply(sock.recv())
            assert reply.code == "duplicate" and "already registered" in reply.message
            assert process_instance() != "someone-else"
        finally:
            for r in reg.regions:
                r.close()
            c.deregister("taken")


def test_per_engine_bounds_refuse_clearly_and_lose_nothing(sidecar) -> None:
    """Reads in flight, open holds and unpolled completions are bounded per engine;
    at a bound new work is refused with the limit's name; what was accepted
    still completes; the engine is served again once it polls."""
    # A peer that accepts TCP but never answers keeps reads in their handshake.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    remote = RemoteEngine("P-silent", 1, [f"127.0.0.1:{silent.getsockname()[1]}"])
    with SidecarClient(sidecar.socket) as c:
        reg = c.register("bounded", 0, LAYOUT, allocate=True)
        try:
            for i in range(3):
                c.read("bounded", f"r{i}", [[i]], remote, [[i]], remote_tokens=["unchecked"])
            with pytest.raises(Unavailable, match=r"3 reads in flight, the limit is 3 "
                                                  r"\(--max-reads-per-engine\)"):
                c.read("bounded", "r3", [[3]], remote, [[3]], remote_tokens=["unchecked"])
            # at the limit, a read already in progress sent again (a client's after
            # a lost connection) learns that it is, not that it is refused
            with pytest.raises(Duplicate, match="'r1' is already in progress"):
                c.read("bounded", "r1", [[1]], remote, [[1]], remote_tokens=["unchecked"])
            c.hold("bounded", "h0", [[0]], timeout_s=1000)
            c.hold("bounded", "h1", [[1]], timeout_s=1000)
            # reads + holds + completions: 3 + 2 = 5 of 6
            c.hold("bounded", "h2", [[2]], timeout_s=1000)
            with pytest.raises(Unavailable, match="--max-completions-per-engine"):
                c.hold("bounded", "h3", [[3]], timeout_s=1000)
            for i in range(3):
                c.release("bounded", f"r{i}")  # aborted reads: completions wait to be polled
            with pytest.raises(Unavailable, match="poll completions"):
                c.hold("bounded", "h3", [[3]], timeout_s=1000)
            # A released read reports ``aborted`` once its cancelled task has ended, a
            # loop turn after the release was answered: poll until all three came.
            got = c.poll("bounded")
            deadline = time.monotonic() + 30
            while len(got) < 3:
                assert time.monotonic() < deadline, got
                got += c.poll("bounded", wait_s=1.0)
            assert sorted((x.request_id, x.kind) for x in got) == [
                ("r0", "aborted"), ("r1", "aborted"), ("r2", "aborted")]
            assert c.poll("bounded") == []  # acknowledges them: only now are they gone
            c.hold("bounded", "h3", [[3]], timeout_s=1000)
            with pytest.raises(Unavailable, match=r"4 holds open, the limit is 4"):
                c.hold("bounded", "h4", [[3]], timeout_s=1000)
            # likewise a hold placed already (hold_nowait sends one again after a
            # lost connection): duplicate, checked before the limit
            with pytest.raises(Duplicate, match="'h1' is already held"):
                c.hold("bounded", "h1", [[1]], timeout_s=1000)
        finally:
            for r in reg.regions:
                r.close()
            c.deregister("bounded")
            silent.close()


def test_a_keepalive_keeps_an_idle_engine_and_its_death_still_releases_it(sidecar,
                                                                          tmp_path) -> None:
    """An engine whose only traffic is its keepalive (ipc/keepalive.py, a thread of
    its own process) stays registered for three leases; once that process is
    killed, the engine is released within the lease, as any silent engine is. The
    engine registers from another PID namespace (as a container without a shared
    one does), so the lease is the only signal: what an idle engine keeps alive
    is exactly what its death lets go."""
    reg = _register_raw(sidecar.socket, "kept-alive", 1, "pid:[1]")
    script = textwrap.dedent(f"""
        import sys, time
        from kvsidecar.ipc.keepalive import Keepalive
        ka = Keepalive({sidecar.socket!r}, ["kept-alive"], timeout_s=5.0).start()
        while not ka.answers:
            time.sleep(0.01)
        print(ka.period_s, flush=True)
        time.sleep(3600)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert float(child.stdout.readline()) == pytest.approx(LEASE_S / 3)
        with SidecarClient(sidecar.socket) as c:
            until = time.monotonic() + 3 * LEASE_S
            while time.monotonic() < until:  # nothing but the keepalive names it
                assert "kept-alive" in c.ping().engines
                time.sleep(LEASE_S / 8)
            child.kill()
            child.wait()
            killed = time.monotonic()
            while "kept-alive" in c.ping().engines:
                assert time.monotonic() - killed < LEASE_S + 30, "never released"
                time.sleep(0.1)
        assert time.monotonic() - killed >= LEASE_S - LEASE_S / 3 - 0.5
    finally:
        child.kill()
        for r in reg.regions:
            with contextlib.suppress(Exception):
                os.unlink(f"/dev/shm/{r.name}")


def test_a_killed_sidecar_restarts_and_a_clean_stop_leaves_no_socket_files(
        tmp_path: Path) -> None:
    """SIGKILL leaves the socket and its lock file; the next start takes both over
    (the kernel dropped the lock); SIGTERM then removes everything the sidecar
    made beside its socket: the socket, the fd socket and ``<socket>.lock``."""
    s = SidecarProcess(tmp_path, "relock").start()
    try:
        s.kill()
        left = sorted(os.listdir(tmp_path))
        assert {"relock.sock", "relock.sock.lock"} <= set(left), left
        s.start()
        with SidecarClient(s.socket, timeout_s=10) as c:
            c.ping()
    finally:
        assert s.stop() == 0
    assert sorted(os.listdir(tmp_path)) == ["relock.log"]
