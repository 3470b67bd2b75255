"""Slow and idle clients on a real sidecar's TCP ports must not starve the ones
that matter: the kubelet's probes on the metrics port, a fleet member's
handshake on the handshake port.

Before: 4 addresses x 8 connections trickling one byte every 3 s held all 32
metrics slots (the timeout was per read) and /healthz was refused 10 of 10
times; idle TCP connections held every handshake slot for libzmq's 30 s
handshake timeout and a fleet member's handshake got no reply.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsidecar.sim.cluster import SidecarProcess, engines
from kvsidecar.sim.models import hybrid
from kvsidecar.sim.oracle import Request

from .test_fuzz import _get, _refused


def _timeouts(port: int) -> float:
    """Connections cut at their deadline so far; -1 while every slot is taken (a
    scrape then gets a probe slot and 503)."""
    if _get(port, "/metrics", source="127.0.0.2")[0] == 503:
        return -1
    return _refused(port, "timeout")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

_ids = itertools.count()


@pytest.fixture
def flood() -> Iterator[list[socket.socket]]:
    made: list[socket.socket] = []
    yield made
    for s in made:
        s.close()


def _trickle(socks: list[socket.socket], stop: threading.Event) -> None:
    """One byte on each socket every 3 s (a slowloris): never a whole request."""
    while not stop.wait(3.0):
        for s in socks:
            with contextlib.suppress(OSError):  # cut at its deadline: fine
                s.send(b"X")


def test_slow_scrapers_cannot_keep_the_probes_out(tmp_path: Path, flood) -> None:
    side = SidecarProcess(tmp_path, "pr-metrics", args=["--metrics-port", "0"]).start()
    stop = threading.Event()
    try:
        port = side.metrics_port
        for a in range(3, 7):  # 4 addresses x 8 connections: every slot (_refused uses .2)
            for _ in range(8):
                s = socket.create_connection(("127.0.0.1", port), timeout=10,
                                             source_address=(f"127.0.0.{a}", 0))
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                flood.append(s)
        trickler = threading.Thread(target=_trickle, args=(flood, stop), daemon=True)
        trickler.start()
        time.sleep(1.0)
        answered = []
        for _ in range(10):  # the kubelet's liveness probe, from its own address
            answered.append(_get(port, "/healthz", source="127.0.0.9")[0])
            time.sleep(0.3)
        assert answered == [200] * 10, answered
        # A scrape over the probe slot is turned away, not served slowly.
        assert _get(port, "/metrics", source="127.0.0.9")[0] == 503
        # The trickling connections are cut at their whole-request deadline.
        deadline = time.monotonic() + 60
        while _timeouts(port) < 32:
            assert time.monotonic() < deadline, side.read_log()[-3000:]
            time.sleep(0.5)
        assert _get(port, "/metrics", source="127.0.0.9")[0] == 200
    finally:
        stop.set()
        assert side.stop() == 0


def _closed_by_peer(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(64) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_idle_tcp_connections_cannot_keep_a_fleet_member_out(tmp_path: Path, flood) -> None:
    p = SidecarProcess(tmp_path, "pr-p", args=["--max-peer-connections", "64",
                                               "--hold-timeout", "60"]).start()
    d = SidecarProcess(tmp_path, "pr-d", args=["--handshake-timeout", "5"]).start()
    try:
        host, port = p.handshake.rsplit(":", 1)
        for _ in range(64):  # every slot, from one other address, never a ZMTP byte
            flood.append(socket.create_connection((host, int(port)), timeout=10,
                                                  source_address=("127.0.0.2", 0)))
        time.sleep(0.5)
        with engines([p], [d], lambda x: f"pr{x}{next(_ids)}", hybrid, 1, 1) as (P, (D,)):
            D.start_read(P.prefill("through", Request(seed=4, prompt_tokens=60)))
            got = D.wait_for(["through"], timeout_s=60)["through"][0]
            assert got.kind == "received", got
            assert not D.verify("through")
        # The silent ones are dropped at the short handshake deadline, not 30 s later.
        t0 = time.monotonic()
        while not all(_closed_by_peer(s) for s in flood):
            assert time.monotonic() - t0 < 15, "idle handshake connections were kept"
            time.sleep(0.2)
    finally:
        d.stop()
        assert p.stop() == 0


def test_readiness_probes_are_not_refused_peers(tmp_path: Path) -> None:
    """/readyz and ``kvsidecar status`` check the handshake listener without
    connecting to it: no refused peer, no WARNING. Before, each one was a TCP
    connection that never sent a ZMTP greeting, so 5 probes counted
    ``kvsidecar_refused_total{channel="peer",reason="handshake_no_detail"}`` 8
    and the log's refusal lines (10, then every 1000th) went to the kubelet.
    A real peer that fails its handshake is still counted, and logged with the
    address it came from."""
    side = SidecarProcess(tmp_path, "pr-ready", args=["--metrics-port", "0"]).start()
    try:
        port = side.metrics_port
        deadline = time.monotonic() + 120
        while _get(port, "/readyz")[0] != 200:
            assert time.monotonic() < deadline, _get(port, "/readyz")[1]
            time.sleep(0.5)
        before = side.metric("kvsidecar_refused_total", channel="peer")
        assert before == 0  # waiting for ready probed too
        for _ in range(5):
            code, body = _get(port, "/readyz", source="127.0.0.9")
            assert code == 200, body
        status = subprocess.run(
            [sys.executable, "-m", "kvsidecar", "status", "--socket", side.socket],
            capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        time.sleep(1.0)  # the guard's monitor thread would have seen them by now
        assert side.metric("kvsidecar_refused_total", channel="peer") == before
        assert "failed its handshake" not in side.read_log()

        # A bare TCP connection to the handshake port is a failed handshake: counted,
        # logged with its address (noted when it is accepted: one reset at once,
        # before the guard saw it, is logged as "an unknown address").
        host, hs_port = side.handshake.rsplit(":", 1)
        with socket.create_connection((host, int(hs_port)), timeout=10,
                                      source_address=("127.0.0.3", 0)) as s:
            peer = f"127.0.0.3:{s.getsockname()[1]}"
            time.sleep(2.0)  # open until the guard's thread has surely seen it accepted
        line = f"a connection from {peer} failed its handshake (no_detail; 1 so far)"
        deadline = time.monotonic() + 30
        while line not in side.read_log():
            assert time.monotonic() < deadline, side.read_log()[-3000:]
            time.sleep(0.2)
        assert side.metric("kvsidecar_refused_total", channel="peer",
                           reason="handshake_no_detail") == 1
    finally:
        assert side.stop() == 0
