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
