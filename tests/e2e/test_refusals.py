"""Every start-up refusal of ``kvsidecar serve`` is whole and fast (#26): a real
process, with metrics on and off, prints one line on stderr naming the problem
and the fix, prints no READY line, and exits 2 within 2 s.

The 2 s are the sidecar's own: the bound is 2 s plus what ``kvsidecar
--version`` (the same interpreter start and CLI imports, nothing else) took in
the same run, so a loaded machine does not fail the test and a refusal that
waits for NIXL (seconds) or a server thread (forever) does.
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsidecar.sim.cluster import fleet_keys

pytestmark = pytest.mark.timeout(300)

BOUND_S = 2.0


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVSIDECAR_") and k not in ("CREDENTIALS_DIRECTORY", "UCX_TLS")}
    return {**env, **extra}


def _run(argv: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kvsidecar", *argv], env=_env(env),
                          capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - t0


@pytest.fixture(scope="module")
def startup_s() -> float:
    """The interpreter's and the CLI's start-up, measured now (the best of three)."""
    times = []
    for _ in range(3):
        proc, took = _run(["--version"], {})
        assert proc.returncode == 0, proc.stderr
        times.append(took)
    return min(times)


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A TCP port something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def held_socket(tmp_path: Path) -> Iterator[str]:
    """A socket path whose lock another open file holds, as a live sidecar does."""
    path = str(tmp_path / "held.sock")
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    yield path
    os.close(fd)


def _case(name: str, request: pytest.FixtureRequest, tmp_path: Path
          ) -> tuple[list[str], dict[str, str], str]:
    """(argv after ``serve``, env, what the one line says) of the named refusal."""
    sock = str(tmp_path / "s.sock")
    keys = ["--peer-keys", fleet_keys()]
    cases: dict[str, tuple[list[str], dict[str, str], str]] = {
        "missing keys": ([], {"KVSIDECAR_PEER_KEYS": str(tmp_path)},
                         f"kvsidecar: no {tmp_path}/sidecar.key_secret: create one with "
                         f"`kvsidecar keys {tmp_path}`"),
        # README's serve once ran like this and got "no sidecar.key_secret ... keys ."
        "no keys named": ([], {}, "kvsidecar: no peer key: pass --peer-keys DIR (env "
                                  "KVSIDECAR_PEER_KEYS), a directory made once with "
                                  "`kvsidecar keys DIR`"),
        "bad flag": (["--post-lanes", "9", *keys], {},
                     "kvsidecar serve: error: --post-lanes (env KVSIDECAR_POST_LANES) must be "
                     "1..8, got 9"),
        "unknown flag": (["--no-such-flag", "2", *keys], {},
                         "kvsidecar serve: error: unrecognized arguments: --no-such-flag 2"),
        "bad env value": (keys, {"KVSIDECAR_HOLD_TIMEOUT": "soon"},
                          "kvsidecar serve: error: argument --hold-timeout: must be a number "
                          "(flag or env KVSIDECAR_HOLD_TIMEOUT), got 'soon'"),
        "bad env choice": (keys, {"KVSIDECAR_LOG_FORMAT": "xml"},
                           "kvsidecar serve: error: --log-format (env KVSIDECAR_LOG_FORMAT) "
                           "must be text or json"),
        "socket in use": (["--socket", "HELD", *keys], {},
                          "kvsidecar: another sidecar is serving HELD (it holds HELD.lock); "
                          "stop it or pass another --socket"),
        "socket not a socket": (["--socket", str(tmp_path / "file"), *keys], {},
                                f"kvsidecar: {tmp_path}/file exists and is not a socket; "
                                "remove it or pass another --socket"),
        # procfs makes no directory (ENOENT), as a read-only file system (EROFS) makes none
        "socket directory not made": (["--socket", "/proc/self/kvs-none/s.sock", *keys], {},
                                      "kvsidecar: cannot serve /proc/self/kvs-none/s.sock: "),
        # ".." once hid the open directory: it was chmodded 0700 instead of refused
        "socket directory open to others": (
            ["--socket", str(tmp_path / "open" / "new" / ".." / "s.sock"), *keys], {},
            f"kvsidecar: cannot serve {tmp_path}/open/s.sock: socket directory "
            f"{tmp_path}/open is writable by others (mode 1777)"),
        "socket path too long": (["--socket", "/tmp/" + "x" * 120 + ".sock", *keys], {},
                                 "is longer than 107 bytes (a unix socket limit); "
                                 "pass a shorter path"),
        "handshake port in use": (["--handshake-port", "TAKEN", *keys], {},
                                  "kvsidecar: --handshake-port TAKEN on 127.0.0.1: Address "
                                  "already in use; stop what holds it or pass another "
                                  "--handshake-port (0: any free port)"),
        "metrics port in use": (["--metrics-port", "TAKEN", *keys], {},
                                "kvsidecar: --metrics-port TAKEN on 127.0.0.1: Address already "
                                "in use; stop what holds it or pass another --metrics-port"),
        "handshake host not here": (["--handshake-host", "192.0.2.1", *keys], {},
                                    "kvsidecar: --handshake-host 192.0.2.1: Cannot assign "
                                    "requested address; pass an address of this host, or "
                                    "0.0.0.0 for all"),
        "metrics host not here": (["--metrics-host", "192.0.2.1", *keys], {},
                                  "kvsidecar: --metrics-host 192.0.2.1: Cannot assign "
                                  "requested address; pass an address of this host"),
        "unusable device": (["--device", "cuda:99", *keys], {},
                            "kvsidecar: --device cuda:99: "),
        "transport check": (keys, {"UCX_TLS": "tcp"},
                            "kvsidecar: --transport-check require-zero-copy, but UCX_TLS=tcp "
                            "allows no zero-copy transport; add cma (host memory) or "
                            "cuda_ipc/rc (GPU) to UCX_TLS, unset it, or pass "
                            "--transport-check allow-tcp"),
    }
    argv, env, says = cases[name]
    if "--socket" not in argv:
        argv = ["--socket", sock, *argv]
    if name == "socket not a socket":
        (tmp_path / "file").write_text("not a socket")
    if name == "socket directory open to others":
        (tmp_path / "open").mkdir()
        os.chmod(tmp_path / "open", 0o1777)
    for token, fixture in (("HELD", "held_socket"), ("TAKEN", "taken_port")):
        if token in " ".join(argv) + says:
            value = str(request.getfixturevalue(fixture))
            argv = [a.replace(token, value) for a in argv]
            says = says.replace(token, value)
    return argv, env, says


CASES = ["missing keys", "no keys named", "bad flag", "unknown flag", "bad env value",
         "bad env choice",
         "socket in use", "socket not a socket", "socket directory not made",
         "socket directory open to others", "socket path too long",
         "handshake port in use", "handshake host not here", "unusable device",
         "transport check"]
#: Cases that exist only with metrics on (the "metrics off" run has no listener).
METRICS_CASES = ["metrics port in use", "metrics host not here"]


METRICS = ["metrics off", "metrics on (flag)", "metrics on (env)"]


@pytest.mark.parametrize(("name", "metrics"), [
    *((n, m) for n in CASES for m in METRICS),
    *((n, m) for n in METRICS_CASES for m in METRICS[1:]),
])
def test_a_refusal_exits_2_at_once_with_one_line(name: str, metrics: str, startup_s: float,
                                                 request: pytest.FixtureRequest,
                                                 tmp_path: Path) -> None:
    argv, env, says = _case(name, request, tmp_path)
    port = "0"
    if "--metrics-port" in argv:  # the case's own port, given by the flag or the env below
        i = argv.index("--metrics-port")
        port, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    if metrics == "metrics on (flag)":
        argv = [*argv, "--metrics-port", port]
    elif metrics == "metrics on (env)":  # the same port, given by the environment
        env = {**env, "KVSIDECAR_METRICS_PORT": port}
    proc, took = _run(["serve", *argv], env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert says in lines[0], lines[0]
    assert took < BOUND_S + startup_s, (took, startup_s)
    assert not (tmp_path / "s.sock").exists()
    if name == "socket directory open to others":  # refused, and left as it was
        assert os.stat(tmp_path / "open").st_mode & 0o7777 == 0o1777
        assert not (tmp_path / "open" / "new").exists()


@pytest.mark.parametrize("metrics", METRICS)
def test_a_failed_transport_self_check_exits_2(metrics: str, tmp_path: Path) -> None:
    """``UCX_TLS=^cma`` passes every check made before start (it lists no
    transports preflight can judge), but the start-up loopback READ then takes
    tcp: under the default ``--transport-check require-zero-copy`` the sidecar
    stops and exits 2 as soon as the check ends, its last line the check's
    finding and the fix, metrics on or off (no server thread keeps it alive)."""
    argv = ["--socket", str(tmp_path / "s.sock"), "--peer-keys", fleet_keys()]
    env = {"UCX_TLS": "^cma"}
    if metrics == "metrics on (flag)":
        argv += ["--metrics-port", "0"]
    elif metrics == "metrics on (env)":
        env["KVSIDECAR_METRICS_PORT"] = "0"
    proc, _ = _run(["serve", *argv], env)  # a sidecar left running fails at _run's timeout
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvsidecar: --transport-check require-zero-copy: the start-up "
                           "loopback READ took the tcp path: "), last
    assert "--transport-check allow-tcp" in last, last
    assert not (tmp_path / "s.sock").exists()
