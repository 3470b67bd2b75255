"""Bad flags and KVSIDECAR_* values through the real command line: one line on
stderr naming the flag and its variable, exit code 2, nothing on stdout (the
rules themselves: tests/unit/test_settings.py and tests/unit/test_options.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(("argv", "env", "msg"), [
    (["--device", "gpu0"], {}, "--device (env KVSIDECAR_DEVICE) must be cpu or cuda:N"),
    (["--backends", " , "], {}, "names no backend"),
    (["--hold-timeout", "0"], {}, "--hold-timeout (env KVSIDECAR_HOLD_TIMEOUT) must be a finite"),
    (["--engine-lease", "inf"], {}, "--engine-lease (env KVSIDECAR_ENGINE_LEASE) must be a finite"),
    (["--read-timeout", "nan"], {}, "--read-timeout (env KVSIDECAR_READ_TIMEOUT) must be a finite"),
    (["--allow-uid", "no-such-user-x"], {}, "--allow-uid (env KVSIDECAR_ALLOW_UID): no such uid"),
    ([], {"KVSIDECAR_HANDSHAKE_PORT": "abc"},
     "--handshake-port: must be an integer (flag or env KVSIDECAR_HANDSHAKE_PORT), got 'abc'"),
    ([], {"KVSIDECAR_READ_TIMEOUT": "soon"}, "env KVSIDECAR_READ_TIMEOUT), got 'soon'"),
    (["--metrics-port", "70000"], {}, "--metrics-port (env KVSIDECAR_METRICS_PORT) must be"),
    ([], {"KVSIDECAR_LOG_LEVEL": "loud"}, "must be one of DEBUG, INFO, WARNING, ERROR"),
    (["--transport-check", "maybe"], {}, "must be one of require-zero-copy, allow-tcp, off"),
    ([], {"KVSIDECAR_CUDA_ATTACH": "yes"},
     "--cuda-attach (env KVSIDECAR_CUDA_ATTACH) must be one of serve, warn, refuse"),
    (["--post-during-claim", "-1"], {},
     "--post-during-claim (env KVSIDECAR_POST_DURING_CLAIM) must be 0..3600 seconds"),
    (["--post-lanes", "0"], {}, "--post-lanes (env KVSIDECAR_POST_LANES) must be 1..8, got 0"),
    (["--advertise-host", "not_a_host!"], {},
     "--advertise-host (env KVSIDECAR_ADVERTISE_HOST) must be a host name or an IP address"),
    ([], {"KVSIDECAR_INSECURE_PEERS": "maybe"},
     "argument --insecure-peers: must be 1/true/yes/on (on) or empty/0/false/no/off (off), "
     "any case (env KVSIDECAR_INSECURE_PEERS), got 'maybe'"),
])
def test_bad_settings_are_one_line_and_exit_2(argv: list[str], env: dict[str, str],
                                              msg: str) -> None:
    """The real command line: one line on stderr naming flag and variable, exit code 2."""
    out = subprocess.run([sys.executable, "-m", "kvsidecar", "serve", *argv],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("kvsidecar serve: error: ") and msg in lines[0], lines[0]


@pytest.mark.parametrize("backends", ["FOO", "UCX,FOO", "ucx"])
def test_an_unknown_backend_is_refused_at_start(backends: str, tmp_path: Path) -> None:
    """``KVSIDECAR_BACKENDS=FOO`` once started, answered /readyz 200 and then
    failed every registration (``nixlNotFoundError``): the names are checked
    against NIXL's plugins before anything starts, one line, exit 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSIDECAR_")}
    out = subprocess.run([sys.executable, "-m", "kvsidecar", "serve", "--insecure-peers",
                          "--socket", str(tmp_path / "s.sock")],
                         env={**env, "KVSIDECAR_BACKENDS": backends}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    bad = backends.split(",")[-1]
    assert lines[0].startswith(f"kvsidecar: --backends (env KVSIDECAR_BACKENDS): no NIXL "
                               f"plugin {bad} here; available: "), lines[0]
    assert "UCX" in lines[0].split("available: ")[1]
    assert not (tmp_path / "s.sock").exists()
