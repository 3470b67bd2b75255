"""Flags, KVSIDECAR_* environment defaults and their validation."""

from __future__ import annotations

import argparse
import os

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
    with pytest.raises(SystemExit, match="no such gid"):
        parse(["--allow-gid", "no-such-group-kvs"])


def test_wildcard_bind_advertises_a_dialable_host() -> None:
    assert parse(["--handshake-host", "0.0.0.0"]).advertised not in ("0.0.0.0", "")
    assert parse(["--handshake-host", "0.0.0.0", "--advertise-host", "10.1.2.3"]
                 ).advertised == "10.1.2.3"


@pytest.mark.parametrize(("argv", "msg"), [
    (["--device", "gpu0"], "must be cpu or cuda:N"),
    (["--backends", " , "], "names no backend"),
    (["--hold-timeout", "0"], "--hold-timeout must be a finite number"),
    (["--engine-lease", "inf"], "--engine-lease must be a finite number"),
    (["--read-timeout", "nan"], "--read-timeout must be a finite number"),
])
def test_bad_settings_exit_with_a_message(argv: list[str], msg: str) -> None:
    with pytest.raises(SystemExit, match=msg):
        parse(argv)
