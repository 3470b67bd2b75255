"""The systemd unit and the notify protocol.

- ``systemd-analyze verify`` accepts the unit (ExecStart pointed at this
  checkout's real ``kvsidecar``), and ``systemd-analyze security --offline``
  scores it at most 4.0;
- the unit's promises: Type=notify, watchdog, stop timeout longer than the
  drain, memlock, runtime directory for the socket, no %i in env files;
- a real ``kvsidecar serve`` child speaks the protocol to a real datagram
  socket named by NOTIFY_SOCKET: READY=1 (+STATUS) once listening,
  WATCHDOG=1 pings while live, STOPPING=1 on SIGTERM.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvsidecar.daemon.sdnotify import Notifier, watchdog_interval
from kvsidecar.daemon.settings import Settings
from kvsidecar.sim.cluster import fleet_keys

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "kvsidecar@.service"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def unit_settings() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if line.strip() and not line.startswith(("#", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def installed_copy(tmp: Path, instance: str = "") -> Path:
    """The unit with ExecStart at this venv's kvsidecar (verify wants it executable)."""
    exe = Path(sys.executable).parent / "kvsidecar"
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={exe}", UNIT.read_text(), flags=re.M)
    path = tmp / f"kvsidecar@{instance}.service"
    path.write_text(text)
    return path


@needs_analyze
def test_unit_verifies(tmp_path: Path) -> None:
    out = subprocess.run([ANALYZE, "verify", "--man=no", str(installed_copy(tmp_path))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr


@needs_analyze
def test_unit_security_score_at_most_4(tmp_path: Path) -> None:
    out = subprocess.run([ANALYZE, "security", "--offline=yes", "--no-pager",
                          str(installed_copy(tmp_path, "0"))],
                         capture_output=True, text=True, timeout=120)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out.stdout)
    assert m, out.stdout[-2000:] + out.stderr
    score = float(m.group(1))
    print(f"systemd-analyze security: {score}")
    assert score <= 4.0


def test_unit_promises() -> None:
    u = unit_settings()
    assert u["Type"] == ["notify"] and u["NotifyAccess"] == ["main"]
    assert int(u["WatchdogSec"][0]) > 0
    s = Settings(socket="x")
    # Sidecar.stop: posted reads, open holds (--drain-timeout), then engine polls
    drain = s.read_timeout_s + 15 + s.drain_timeout_s + 2
    assert int(u["TimeoutStopSec"][0]) > drain
    assert u["LimitMEMLOCK"] == ["infinity"]
    assert u["RuntimeDirectory"] == ["kvsidecar/%i"]
    assert any(v.startswith("KVSIDECAR_SOCKET=/run/kvsidecar/%i/") for v in u["Environment"])
    assert "@system-service" in u["SystemCallFilter"]
    assert u["CapabilityBoundingSet"] == [""]


def test_notifier_outside_systemd_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert not Notifier().send(ready=1)
    assert watchdog_interval() is None


def test_notifier_abstract_socket() -> None:
    name = f"kvsidecar-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind("\0" + name)
        n = Notifier("@" + name)
        assert n.send(ready=1, status="hello")
        assert srv.recv(4096) == b"READY=1\nSTATUS=hello"
        n.close()


@pytest.mark.e2e
def test_real_daemon_speaks_notify_protocol() -> None:
    work = Path(tempfile.mkdtemp(prefix="kvs-notify-", dir="/tmp"))  # short: sun_path limit
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
            srv.bind(str(work / "notify"))
            srv.settimeout(120)
            env = {**os.environ, "NOTIFY_SOCKET": str(work / "notify"),
                   "WATCHDOG_USEC": "1000000"}
            env.pop("WATCHDOG_PID", None)
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvsidecar", "serve", "--socket", str(work / "e.sock"),
                 "--transport-check", "off", "--metrics-port", "0", "--peer-keys", fleet_keys()],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                got: list[dict[str, str]] = []

                def until(key: str) -> dict[str, str]:
                    deadline = time.monotonic() + 120
                    while time.monotonic() < deadline:
                        msg = dict(line.split("=", 1) for line in
                                   srv.recv(4096).decode().splitlines())
                        got.append(msg)
                        if key in msg:
                            return msg
                    raise AssertionError(f"no {key} in {got}")

                ready = until("READY")
                assert ready["READY"] == "1" and "listening" in ready["STATUS"]
                assert os.path.exists(work / "e.sock")  # READY only once it listens
                assert until("WATCHDOG")["WATCHDOG"] == "1"
                proc.send_signal(signal.SIGTERM)
                assert until("STOPPING")["STOPPING"] == "1"
                assert proc.wait(120) == 0
                out = proc.stdout.read() if proc.stdout else ""
                # stdout carries the READY line and nothing else (no library chatter)
                assert [ln for ln in out.splitlines() if ln] == [
                    ln for ln in out.splitlines() if ln.startswith("KVSIDECAR READY ")]
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)
