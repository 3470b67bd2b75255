"""/healthz and /readyz over real HTTP against a real sidecar (in this process,
so the test can wedge its threads and close its listener for real).

- ready once the transport self-check (a real loopback NIXL READ) passed;
- a NIXL worker thread stuck in a job turns /healthz and /readyz red, naming it,
  and green again once it moves;
- a blocked event loop turns /healthz red (answered from the HTTP thread);
- a closed handshake listener turns /readyz red (and only that check);
- a stopping sidecar is not ready (draining).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.daemon.app import Sidecar
from kvsidecar.daemon.health import verdict
from kvsidecar.daemon.settings import Settings
from kvsidecar.ipc.client import AsyncSidecarClient
from kvsidecar.metrics.server import MetricsServer
from kvsidecar.sim.cluster import fleet_keys
from kvsidecar.sim.models import hybrid

BOUND_S = 1.0  # health bound for the test: short, so red comes quickly
WAIT_S = 120.0  # how long a state change may take on a loaded machine


def get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def until(port: int, path: str, pred: Callable[[int, dict[str, Any]], bool]
                ) -> tuple[int, dict[str, Any]]:
    """Poll (off the loop) until ``pred`` holds; fail with the last answer after WAIT_S."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + WAIT_S
    while True:
        code, body = await loop.run_in_executor(None, get, port, path)
        if pred(code, body):
            return code, body
        assert time.monotonic() < deadline, (path, code, body)
        await asyncio.sleep(0.1)


@pytest.fixture(params=["require-zero-copy"])
async def served(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    sc = Sidecar(Settings(socket=str(tmp_path / "h.sock"), peer_keys=fleet_keys(),
                          health_timeout_s=BOUND_S,
                          transport_check=request.param))
    await sc.start()
    http = MetricsServer(sc.metrics, "127.0.0.1", 0, probes={
        "/healthz": lambda: verdict(sc.liveness()), "/readyz": lambda: verdict(sc.readiness())})
    port = http.start()
    try:
        yield sc, port
    finally:
        await sc.stop(drain_s=0)
        http.stop()


async def test_probes_follow_wedged_worker_and_closed_listener(served: Any) -> None:
    sc, port = served
    # Ready once the self-check passed (zero-copy cma here).
    _, body = await until(port, "/readyz", lambda c, b: c == 200)
    assert body["status"] == "ok" and body["failed"] == []
    assert "path cma" in body["checks"]["transport_selfcheck"]["detail"]

    client = AsyncSidecarClient(sc.settings.socket, timeout_s=60)
    await client.register("E0", 0, hybrid(1, 16), allocate=True)
    code, body = await until(port, "/healthz", lambda c, b: "worker:E0" in b["checks"])
    assert code == 200

    # Wedge the engine's NIXL worker thread: a job that blocks until released.
    release = threading.Event()
    worker = sc.table.ranks["E0"].worker
    stuck = worker._submit("test: block the worker thread", lambda fut: release.wait(300))
    code, body = await until(port, "/healthz", lambda c, b: c == 503)
    assert body["failed"] == ["worker:E0"], body
    assert "wedged" in body["checks"]["worker:E0"]["detail"]
    code, body = await until(port, "/readyz", lambda c, b: c == 503)
    assert "worker:E0" in body["failed"]
    release.set()
    await stuck
    await until(port, "/healthz", lambda c, b: c == 200)
    await until(port, "/readyz", lambda c, b: c == 200)

    # Close the handshake listener for real: not ready, but alive.
    await sc._hs_server.stop()
    code, body = await until(port, "/readyz", lambda c, b: c == 503)
    assert body["failed"] == ["handshake_listener"], body
    code, _ = get(port, "/healthz")
    assert code == 200
    await client.deregister("E0")
    await client.close()


@pytest.mark.parametrize("served", ["off"], indirect=True)
async def test_blocked_event_loop_fails_healthz(served: Any) -> None:
    _, port = served
    await until(port, "/healthz", lambda c, b: c == 200)
    seen: list[tuple[int, dict[str, Any]]] = []
    done = threading.Event()

    def probe() -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            code, body = get(port, "/healthz")
            if code == 503:
                seen.append((code, body))
                break
            time.sleep(0.1)
        done.set()

    threading.Thread(target=probe, daemon=True).start()
    done.wait(WAIT_S + 10)  # blocks the event loop itself until the probe saw red
    assert seen, "healthz never failed while the loop was blocked"
    assert seen[0][1]["failed"] == ["event_loop"]
    await until(port, "/healthz", lambda c, b: c == 200)


@pytest.mark.parametrize("served", ["off"], indirect=True)
async def test_draining_sidecar_is_not_ready(served: Any) -> None:
    sc, port = served
    await sc.stop(drain_s=0)
    code, body = get(port, "/readyz")
    assert code == 503 and "not_draining" in body["failed"]
