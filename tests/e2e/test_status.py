"""``kvsidecar status`` against real sidecar processes (#26): a P sidecar with an
engine holding a request nobody reads, a D sidecar with an engine linked to P
(one read done, every byte checked) and a read in flight towards a peer that
never answers its handshake. What status says is checked against what the
test did and against the other surfaces (READY line, ``/metrics``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvsidecar
from kvsidecar.ipc.client import SidecarClient
from kvsidecar.ipc.protocol import RemoteEngine, StatusReport
from kvsidecar.sim.cluster import SidecarProcess, SimEngine
from kvsidecar.sim.models import hybrid
from kvsidecar.sim.oracle import Request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@dataclass
class Scene:
    p: SidecarProcess
    d: SidecarProcess
    P: SimEngine
    D: SimEngine
    silent: str  # host:port of a peer that accepts TCP and never answers
    held_at: float  # when P placed its unread hold
    read_at: float  # when D started its read towards the silent peer


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    work = tmp_path_factory.mktemp("status")
    p = SidecarProcess(work, "p", args=["--metrics-port", "0", "--transport-check", "allow-tcp"])
    d = SidecarProcess(work, "d", args=["--handshake-timeout", "120", "--read-timeout", "120"])
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    made: list[SimEngine] = []
    try:
        p.start()
        d.start()
        P = SimEngine("status-P", hybrid, 1, 64, [p])
        made.append(P)
        D = SimEngine("status-D", hybrid, 1, 64, [d])
        made.append(D)
        D.read_exactly(P, "linked", seed=7, tokens=(40,))  # makes D's link to P
        P.prefill("unread", Request(seed=8, prompt_tokens=20), timeout_s=600)
        held_at = time.monotonic()
        host, port = silent.getsockname()
        sent = P.prefill("towards-silent", Request(seed=9, prompt_tokens=20), hold=False)
        sent.remote = RemoteEngine("silent-P", 1, [f"{host}:{port}"])
        D.start_read(sent, request_id="stuck")
        read_at = time.monotonic()
        yield Scene(p, d, P, D, f"{host}:{port}", held_at, read_at)
    finally:
        for e in made:
            e.close()
        silent.close()
        assert d.stop() == 0, d.read_log()
        assert p.stop() == 0, p.read_log()


def _status(sc: SidecarProcess) -> StatusReport:
    with SidecarClient(sc.socket, timeout_s=30) as c:
        return c.status()


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvsidecar", "status", *argv],
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "KVSIDECAR_SOCKET"})


def test_the_read_in_flight_and_the_link_on_d(scene: Scene) -> None:
    scene.D.poll()  # acknowledges the done read's completion: nothing queued
    time.sleep(1.0)
    before = time.monotonic()
    r = _status(scene.d)
    after = time.monotonic()
    assert (r.version, r.socket, r.handshake_address) == (
        kvsidecar.__version__, scene.d.socket, scene.d.handshake_address)
    assert r.daemon_id == scene.d.ready["daemon_id"]
    assert (r.ready, r.draining, r.transport) == (True, False, "off")
    (e,) = r.engines
    assert (e.engine_id, e.tp_rank, e.tp_size, e.pid) == ("status-D", 0, 1, os.getpid())
    assert (e.reads, e.holds, e.queued, e.peers_linked) == (1, 0, 0, 1)
    assert before - scene.read_at <= e.oldest_read_s + 0.01
    assert e.oldest_read_s <= after - scene.read_at + 0.01
    (link,) = e.peers  # the silent peer never linked; P did, and its handshake named its version
    assert (link.address, link.engine_id, link.tp_rank, link.version, link.reads) == (
        scene.P.registrations[0].handshake_address, "status-P", 0, kvsidecar.__version__, 0)


def test_the_open_hold_on_p_and_its_transport(scene: Scene) -> None:
    deadline = time.monotonic() + 120
    while (r := _status(scene.p)).transport == "checking":  # the loopback READ runs
        assert not r.ready
        assert time.monotonic() < deadline, "the transport self-check never ended"
        time.sleep(0.5)
    before = time.monotonic()
    r = _status(scene.p)
    after = time.monotonic()
    (e,) = r.engines
    assert (e.engine_id, e.reads, e.holds, e.peers_linked, e.peers) == ("status-P", 0, 1, 0, [])
    assert before - scene.held_at <= e.oldest_hold_s + 0.01
    assert e.oldest_hold_s <= after - scene.held_at + 0.01
    # The path is whatever the self-check found here; /metrics must say the same.
    assert r.ready
    assert scene.p.metric("kvsidecar_selfcheck_info", path=r.transport, passed="true") == 1
    assert {c.name for c in r.checks} >= {"event_loop", "nixl_agents", "handshake_listener",
                                          "transport_selfcheck", "not_draining"}
    assert scene.p.metric("kvsidecar_build_info", version=kvsidecar.__version__) == 1
    assert scene.p.ready["version"] == kvsidecar.__version__


def test_the_command_line_table_and_json(scene: Scene) -> None:
    out = _cli("--socket", scene.d.socket)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"kvsidecar {kvsidecar.__version__}  daemon ")
    assert lines[0].endswith("  ready")
    assert "1 engine rank(s); 1 read(s) in flight (oldest " in out.stdout
    assert "0 hold(s) open (oldest -); 1 peer link(s)" in out.stdout
    row = next(ln.split() for ln in lines if ln.startswith("status-D "))
    assert row[:5] == ["status-D", "0/1", str(os.getpid()), "1", "1"]  # lanes 1, reads 1
    assert row[5].endswith("s") and float(row[5][:-1]) >= 1.0  # the oldest read's age
    assert row[6:] == ["0", "-", "0", "1"]  # no hold (no age), nothing queued, 1 peer
    peer_row = next(ln.split() for ln in lines if ln.startswith("status-D/0 "))
    assert peer_row == ["status-D/0", scene.P.registrations[0].handshake_address, "status-P",
                        "0", kvsidecar.__version__, "0"]
    js = _cli("--socket", scene.d.socket, "--json")
    assert js.returncode == 0, js.stderr
    doc = json.loads(js.stdout)
    assert (doc["version"], doc["ready"], doc["engines"][0]["reads"]) == (
        kvsidecar.__version__, True, 1)


def test_no_sidecar_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = _cli("--socket", str(tmp_path / "none.sock"))
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.strip() == (f"kvsidecar: no socket at {tmp_path}/none.sock: is "
                                  f"`kvsidecar serve --socket {tmp_path}/none.sock` running? "
                                  "(--socket, env KVSIDECAR_SOCKET)")


def test_the_health_check_finds_a_sidecar_whose_device_is_a_flag(tmp_path: Path) -> None:
    """The image's HEALTHCHECK runs ``kvsidecar status`` with the container's
    environment only: ``serve --device cuda:0`` (a flag, as ``podman run IMAGE
    --device cuda:0`` passes it) listens on cuda:0's default socket, which a
    status that looks only where KVSIDECAR_DEVICE (unset: cpu) says never finds:
    unhealthy forever. With nothing at that socket, status takes the one socket
    in serve's default folder. Shown with the roles swapped (no GPU here): serve
    for the CPU by default, status told KVSIDECAR_DEVICE=cuda:0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSIDECAR_")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    sock = tmp_path / "kvsidecar" / "cpu.sock"
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvsidecar", "serve", "--insecure-peers", "--metrics-port",
             "-1", "--handshake-host", "127.0.0.1", "--handshake-port", "0",
             "--transport-check", "off"],
            env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the sidecar never made its socket"
            time.sleep(0.1)
        out = subprocess.run([sys.executable, "-m", "kvsidecar", "status"], capture_output=True,
                             text=True, timeout=120, env={**env, "KVSIDECAR_DEVICE": "cuda:0"})
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"kvsidecar {kvsidecar.__version__}  daemon "), out.stdout
        assert f"engines on {sock}," in out.stdout
        # a second sidecar's socket in that folder: which one is meant is not guessed
        (tmp_path / "kvsidecar" / "cuda1.sock").touch()
        out = subprocess.run([sys.executable, "-m", "kvsidecar", "status"], capture_output=True,
                             text=True, timeout=120, env={**env, "KVSIDECAR_DEVICE": "cuda:0"})
        assert out.returncode == 2
        assert f"no socket at {tmp_path}/kvsidecar/cuda0.sock" in out.stderr, out.stderr
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
