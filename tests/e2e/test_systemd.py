"""The systemd unit and the notify protocol.

- ``systemd-analyze verify`` accepts the unit (ExecStart pointed at this
  checkout's real ``kvsidecar``), and ``systemd-analyze security --offline``
  scores it at most 4.0;
- the unit's promises: Type=notify, watchdog, stop timeout longer than the
  drain, memlock, runtime directory for the socket, no %i in env files;
- a real ``kvsidecar serve`` child speaks the protocol to a real datagram
  socket named by NOTIFY_SOCKET: READY=1 (+STATUS) once listening,
  WATCHDOG=1 pings while live, STOPPING=1 on SIGTERM;
- the daemon starts, turns ready and stops cleanly under the unit's own
  seccomp filters (SystemCallFilter=, RestrictAddressFamilies=,
  RestrictRealtime=, read from the unit and installed with libseccomp by
  ``unit_sandbox.py``) and the unit's environment: there is no systemd PID 1
  here to start the unit itself, and the filters are what broke it (libzmq
  aborted on sched_setscheduler, ALLOW_GID's chown failed).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvsidecar.daemon.sdnotify import Notifier, watchdog_interval
from kvsidecar.daemon.settings import Settings
from kvsidecar.sim.cluster import fleet_keys

from .unit_sandbox import libseccomp_available, unit_filter, write_spec

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "kvsidecar@.service"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")
SANDBOX = Path(__file__).with_name("unit_sandbox.py")
needs_libseccomp = pytest.mark.skipif(
    not libseccomp_available(),
    reason="libseccomp (libseccomp.so.2) is not installed: scripts/system-deps.sh installs it")


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


def _sandboxed(spec: Path, *cmd: str) -> list[str]:
    """``cmd`` run under the filters in ``spec`` (see unit_sandbox.py)."""
    return [sys.executable, str(SANDBOX), str(spec), "--", *cmd]


@needs_analyze
@needs_libseccomp
def test_the_sandbox_enforces_the_units_filter(tmp_path: Path) -> None:
    """The harness below is only worth something if it filters: ptrace (in the
    unit's ~@debug) is refused with the unit's errno, socket() of a family the
    unit does not list gets EAFNOSUPPORT, real-time scheduling EPERM."""
    assert ANALYZE
    spec = tmp_path / "filter.json"
    write_spec(unit_filter(UNIT, ANALYZE), spec)
    probe = (
        "import ctypes, os, socket\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "rc = libc.ptrace(0, 0, None, None)\n"  # PTRACE_TRACEME: allowed to anyone
        "print('ptrace', rc, ctypes.get_errno())\n"
        "try:\n"
        "    socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM)\n"
        "except OSError as e:\n"
        "    print('packet', e.errno)\n"
        "try:\n"
        "    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))\n"
        "except OSError as e:\n"
        "    print('fifo', e.errno)\n"
        "os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))\n"
        "print('other ok')\n")
    run = subprocess.run(_sandboxed(spec, sys.executable, "-c", probe),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [f"ptrace -1 {errno.EPERM}", f"packet {errno.EAFNOSUPPORT}",
                                f"fifo {errno.EPERM}", "other ok"]


def _unit_environment(work: Path) -> dict[str, str]:
    """The unit's Environment= for instance 0, with what a test machine lacks
    replaced: no GPU (cpu), no /run/kvsidecar (a directory like the
    RuntimeDirectory=, 0750), no group kvsidecar (this process's own group:
    the daemon still chowns its sockets to it, as the unit's ALLOW_GID does)."""
    stand_ins = {
        "KVSIDECAR_DEVICE": "cpu",
        "KVSIDECAR_SOCKET": str(work / "run" / "0" / "engine.sock"),
        "KVSIDECAR_ALLOW_GID": str(os.getgid()),
    }
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVSIDECAR_", "NOTIFY_", "WATCHDOG_"))
           and k != "CREDENTIALS_DIRECTORY"}
    for line in unit_settings()["Environment"]:
        key = line.split("=", 1)[0]
        assert key in stand_ins, f"the unit sets {key}: decide how this test sets it"
        env[key] = stand_ins[key]
    # what the unit leaves to /etc/kvsidecar/gpu<N>.env
    env.update(KVSIDECAR_HANDSHAKE_PORT="0", KVSIDECAR_METRICS_PORT="0")
    # LoadCredential=sidecar.key_secret:...: systemd's copy in $CREDENTIALS_DIRECTORY
    creds = work / "credentials"
    creds.mkdir(mode=0o700)
    shutil.copy(Path(fleet_keys()) / "sidecar.key_secret", creds / "sidecar.key_secret")
    env["CREDENTIALS_DIRECTORY"] = str(creds)
    run = work / "run" / "0"
    run.mkdir(parents=True)
    run.chmod(0o750)
    return env


@pytest.mark.e2e
@needs_analyze
@needs_libseccomp
def test_daemon_serves_under_the_units_seccomp_filters() -> None:
    """``kvsidecar serve`` as the unit starts it: READY=1, /readyz 200 (the
    transport self-check, NIXL/UCX included, passed under the filter), a
    clean exit 0 on SIGTERM, and no EPERM anywhere in its log.

    Before the fix libzmq's I/O thread aborted (sched_setscheduler is in
    ~@resources: "Operation not permitted (src/thread.cpp:315)", rc 134) and,
    with that allowed, chowning the engine socket to ALLOW_GID's group failed
    (@chown is in ~@privileged: exit 2) -- neither got to READY."""
    assert ANALYZE
    work = Path(tempfile.mkdtemp(prefix="kvs-unit-", dir="/tmp"))  # short: sun_path limit
    try:
        spec = work / "filter.json"
        write_spec(unit_filter(UNIT, ANALYZE), spec)
        env = _unit_environment(work)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
            srv.bind(str(work / "notify"))
            srv.settimeout(5)
            env.update(NOTIFY_SOCKET=str(work / "notify"), WATCHDOG_USEC="1000000")
            proc = subprocess.Popen(_sandboxed(spec, sys.executable, "-m", "kvsidecar", "serve"),
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
            try:
                got: list[dict[str, str]] = []

                def until(key: str, timeout: float = 120) -> dict[str, str]:
                    deadline = time.monotonic() + timeout
                    while time.monotonic() < deadline:
                        try:
                            raw = srv.recv(4096).decode()
                        except TimeoutError:
                            assert proc.poll() is None, (
                                f"exit {proc.returncode} before {key}: "
                                + (proc.stderr.read() if proc.stderr else ""))
                            continue
                        msg = dict(ln.split("=", 1) for ln in raw.splitlines())
                        got.append(msg)
                        if key in msg:
                            return msg
                    raise AssertionError(f"no {key} in {got}")

                assert until("READY")["READY"] == "1"
                st = os.stat(env["KVSIDECAR_SOCKET"])
                assert (st.st_mode & 0o777, st.st_gid) == (0o660, os.getgid())
                line = proc.stdout.readline() if proc.stdout else ""
                ready = json.loads(line.removeprefix("KVSIDECAR READY "))
                url = f"http://127.0.0.1:{ready['metrics_port']}/readyz"
                deadline, status = time.monotonic() + 120, 0
                while time.monotonic() < deadline and status != 200:
                    try:
                        with urllib.request.urlopen(url, timeout=10) as r:
                            status = r.status
                    except urllib.error.HTTPError as e:
                        status = e.code
                        time.sleep(0.5)
                assert status == 200, "the transport self-check never passed under the filter"
                proc.send_signal(signal.SIGTERM)
                assert until("STOPPING")["STOPPING"] == "1"
                assert proc.wait(150) == 0
                err = proc.stderr.read() if proc.stderr else ""
                assert "Operation not permitted" not in err and "EPERM" not in err, err
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)
