"""Flags, KVSIDECAR_* environment defaults and their validation."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from kvsidecar.daemon import settings


def parse(argv: list[str]) -> settings.Settings:
    p = argparse.ArgumentParser()
    settings.add_arguments(p)
    return settings.from_args(p.parse_args(argv))


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    s = parse([])
    assert s.socket == f"/tmp/kvsidecar-{os.geteuid()}/cpu.sock"
    assert s.backends == ("UCX",) and s.handshake_port == 0 and s.metrics_port == -1
    assert s.advertised == "127.0.0.1"
    assert s.post_during_claim_s == 2.0
    assert parse(["--post-during-claim", "0"]).post_during_claim_s == 0.0
    assert s.post_lanes == 1 and parse(["--post-lanes", "2"]).post_lanes == 2
    monkeypatch.setenv("KVSIDECAR_POST_LANES", "3")
    assert parse([]).post_lanes == 3


def test_environment_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIDECAR_DEVICE", "cuda:3")
    monkeypatch.setenv("KVSIDECAR_HANDSHAKE_PORT", "5603")
    monkeypatch.setenv("KVSIDECAR_BACKENDS", "UCX, GDS")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    s = parse([])
    assert (s.device, s.handshake_port, s.backends) == ("cuda:3", 5603, ("UCX", "GDS"))
    assert s.socket == "/run/user/7/kvsidecar/cuda3.sock"
    assert parse(["--handshake-port", "7000"]).handshake_port == 7000


def test_systemd_runtime_directory_holds_the_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/kvsidecar-gpu0")
    assert parse([]).socket == "/run/kvsidecar-gpu0/cpu.sock"


def test_allowed_users_and_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIDECAR_ALLOW_UID", "1000, root")
    s = parse(["--allow-gid", "0"])
    assert (s.allow_uids, s.allow_gids) == ((1000, 0), (0,))
    with pytest.raises(settings.ConfigError, match="no such gid"):
        parse(["--allow-gid", "no-such-group-kvs"])


def test_wildcard_bind_advertises_a_dialable_host() -> None:
    assert parse(["--handshake-host", "0.0.0.0"]).advertised not in ("0.0.0.0", "")
    assert parse(["--handshake-host", "0.0.0.0", "--advertise-host", "10.1.2.3"]
                 ).advertised == "10.1.2.3"


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


def test_long_engine_message_bounds() -> None:
    s = parse([])
    assert (s.max_assembling_bytes, s.long_message_timeout_s) == (0, 30.0)
    s = parse(["--max-message-bytes", "1000", "--max-assembling-bytes", "2000",
               "--long-message-timeout", "2.5"])
    assert (s.max_assembling_bytes, s.long_message_timeout_s) == (2000, 2.5)
    with pytest.raises(settings.ConfigError, match="at least 2x --max-message-bytes"):
        parse(["--max-message-bytes", "1000", "--max-assembling-bytes", "1999"])
    with pytest.raises(settings.ConfigError, match="--long-message-timeout"):
        parse(["--long-message-timeout", "0"])
