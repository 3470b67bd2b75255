"""Connection floods against a real sidecar with the systemd default fd limit.

The P sidecar runs under ``prlimit --nofile=1024:1024`` (soft and hard 1024,
harsher than systemd's 1024 soft / 524288 hard, which the daemon would raise).
A flood of 1,100 TCP connections on its handshake port, 300 on its engine
socket and 300 on its fd socket must not starve or kill it: the registered engines keep moving bytes
(checked by the oracle), excess connections are shut, and it exits cleanly.
"""

from __future__ import annotations

import contextlib
import itertools
import resource
import shutil
import socket
import time
from pathlib import Path

import pytest

from kvsidecar.ipc.fdpass import fd_socket_for
from kvsidecar.ipc.protocol import RemoteEngine
from kvsidecar.sim.cluster import SidecarProcess, engines
from kvsidecar.sim.models import hybrid
from kvsidecar.sim.oracle import Request

# Each test starts its own sidecars: minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

HANDSHAKE_FLOOD = 1100
ENGINE_FLOOD = 300
FD_FLOOD = 300


def _transfer(P, D, rid: str, seed: int) -> None:  # type: ignore[no-untyped-def]
    D.start_read(P.prefill(rid, Request(seed=seed, prompt_tokens=60)))
    got = D.wait_for([rid], timeout_s=120)
    assert {c.kind for c in got[rid].values()} == {"received"}, got[rid]
    problems = D.verify(rid)
    assert not problems, problems[:3]


def _open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_a_connection_flood_neither_starves_nor_kills_the_sidecar(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < HANDSHAKE_FLOOD + ENGINE_FLOOD + FD_FLOOD + 200:
        pytest.skip(f"this test process may open only {hard} fds")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    p = SidecarProcess(tmp_path, "p", launcher=["prlimit", "--nofile=1024:1024", "--"]).start()
    d = SidecarProcess(tmp_path, "d").start()
    flood: list[socket.socket] = []
    ids = itertools.count()
    try:
        assert p.proc is not None
        with engines([p], [d], lambda pre: f"{pre}{next(ids)}", hybrid, 1, 1) as (P, (D,)):
            _transfer(P, D, "before", 1)
            host, port = p.handshake.rsplit(":", 1)
            for _ in range(HANDSHAKE_FLOOD):
                with contextlib.suppress(OSError):
                    flood.append(socket.create_connection((host, int(port)), timeout=5))
            for _ in range(ENGINE_FLOOD):
                u = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                try:
                    u.connect(p.socket)
                    flood.append(u)
                except OSError:
                    u.close()
            for _ in range(FD_FLOOD):  # silent: the first 64 wait out their 5 s
                u = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                try:
                    u.connect(fd_socket_for(p.socket))
                    flood.append(u)
                except OSError:
                    u.close()
            fds_in_flood = _open_fds(p.proc.pid)
            deadline = time.monotonic() + 120
            doors = ("handshake socket: refused a connection", "engine socket: refused a "
                     "connection", "fd socket: refused a connection (connection_limit")
            while not all(door in p.read_log() for door in doors):
                assert time.monotonic() < deadline, p.read_log()
                time.sleep(0.2)
            # The registered engines are still served while the flood holds on.
            _transfer(P, D, "during", 2)
            assert p.alive(), p.read_log()
            assert fds_in_flood < 1024
            print(f"flood: {len(flood)} connections opened, sidecar fds {fds_in_flood} (limit "
                  f"1024)")
        for f in flood:
            f.close()
        flood.clear()
        assert "Too many open files" not in p.read_log()
        assert p.stop() == 0
    finally:
        for f in flood:
            f.close()
        p.kill()
        d.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_a_read_naming_thousands_of_dead_addresses_cannot_exhaust_fds(pool, tmp_path: Path
                                                                      ) -> None:
    """One read names a P engine of 4,096 ranks, each at its own dead address, on
    a D sidecar limited to 1,024 fds. It fails with a clear error; the handshake
    client opens no more sockets than its bound (the rest fail at once, naming
    it), so D never runs out of fds, no flush task dies unseen, and once the
    dead handshakes and abandons time out a real read is oracle-exact. Before:
    a socket per address, 'Too many open files' from libzmq, the abandon to the
    real P lost with a 'Task exception was never retrieved'."""
    d = SidecarProcess(tmp_path, "d-wide", args=["--handshake-timeout", "2"],
                       launcher=["prlimit", "--nofile=1024:1024", "--"]).start()
    try:
        assert d.proc is not None
        with engines(pool.p[:1], [d], pool.uid, hybrid, 1, 1) as (P, (D,)):
            _transfer(P, D, "before", 1)
            baseline = _open_fds(d.proc.pid)
            sent = P.prefill("wide", Request(seed=2, prompt_tokens=60))
            n = 4096
            dead = [f"127.0.0.{1 + i // 60000}:{1 + i % 60000}" for i in range(n)]
            D.clients[0].read(D.engine_id, "wide", [[0], [1]],
                              RemoteEngine(P.engine_id, n, dead), sent.block_ids,
                              remote_request_id="wide", remote_tokens=["unchecked"] * n)
            most = 0
            deadline = time.monotonic() + 120
            got = []
            while not got:
                assert time.monotonic() < deadline, "the wide read never completed"
                most = max(most, _open_fds(d.proc.pid))
                got = [c for c in D.clients[0].poll(D.engine_id) if c.request_id == "wide"]
                time.sleep(0.01)
            assert got[0].kind == "failed", got
            while _open_fds(d.proc.pid) > baseline + 8:  # dead handshakes time out
                assert time.monotonic() < deadline, (baseline, _open_fds(d.proc.pid))
                most = max(most, _open_fds(d.proc.pid))
                time.sleep(0.1)
            assert most < 1024, most
            _transfer(P, D, "after", 3)
            log = d.read_log()
            assert "Too many open files" not in log and "never retrieved" not in log, log
        assert d.stop() == 0
    finally:
        d.kill()
