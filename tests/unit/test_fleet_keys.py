"""The test harness's fleet keys: every sidecar a process starts shares one
CURVE keypair, even when sidecars are started from several threads at once
(a race there gave sidecars different keys, and their handshakes failed)."""

from __future__ import annotations

import threading

import pytest

from kvsidecar.sim import cluster


def test_fleet_keys_are_one_directory_across_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster, "_fleet_keys", None)
    barrier = threading.Barrier(8)
    got: list[str] = []

    def start() -> None:
        barrier.wait()
        got.append(cluster.fleet_keys())

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1, got
