"""A vLLM server that idles, and a sidecar restarted under an idle one, through
vLLM 0.33's real scheduler and real sidecars with their DEFAULT settings
(``--engine-lease`` 30 s, ephemeral handshake port).

vLLM makes no connector call while it has no request; before the worker's
keepalive the sidecar took such an engine for dead after ``--engine-lease``
and the next step's poll raised ``UnknownEngine`` out of
``get_transfer_results`` (fatal for vLLM). The two cases wait out the same
two leases side by side (about 70 s together, not 140).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("KVSIDECAR_REQUIRE_VLLM"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm==0.33.0)")

from vllm.v1.request import RequestStatus

from kvsidecar.daemon.settings import Settings
from kvsidecar.ipc.client import SidecarClient
from kvsidecar.sim.cluster import SidecarProcess

from .harness import Engine, failed_reads, make_engine, oracle_fill, request, write_model
from .test_connector import WAIT_S, prefill, run_until, schedule_reads, start_all, verify

pytestmark = pytest.mark.vllm

LEASE_S = Settings.__dataclass_fields__["engine_lease_s"].default  # the default in use


def workers(eng: Engine) -> list[Any]:
    out = [c.worker for c in eng.workers]
    assert all(w is not None for w in out)
    return out


def read_one(P: Engine, D: Engine, rid: str, tokens: int, seed: int) -> dict[str, Any]:
    """P prefills ``rid``; D reads it; returns D's connector output of the step
    that reported the read finished."""
    params = prefill(P, rid, tokens, seed)
    D.sched.add_request(request(D, rid, tokens, params, seed=seed))
    blocks = schedule_reads(D, rid)[rid]
    seen: dict[str, Any] = {"blocks": blocks, "failed": set()}
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        _, agg = D.step()
        out = agg.kv_connector_output
        if out is not None:
            seen["failed"] |= failed_reads(out)
            if rid in (out.finished_recving or ()):
                return seen
        if D.sched.requests[rid].status == RequestStatus.RUNNING:
            return seen
        time.sleep(0.002)
    raise AssertionError(f"{rid}: D never finished its read")


def idle_then_serve(P: Engine, D: Engine) -> str:
    """Idle two leases, then one request, oracle-checked."""
    time.sleep(2 * LEASE_S + 2)
    seen = read_one(P, D, "idle-1", 70, 61)
    assert not seen["failed"]
    verify(D, "idle-1", seen["blocks"], 70, 61)
    run_until(P, lambda: "idle-1" not in P.sched.requests)  # D's notification freed P
    run_until(D, lambda: "idle-1" in D.outputs and D.outputs["idle-1"][-1].finished)
    return "ok"


def restart_then_serve(P: Engine, D: Engine, p_side: SidecarProcess,
                       d_side: SidecarProcess) -> str:
    """Both sidecars restart while P and D idle; each worker's keepalive sees its
    rank gone; the next request makes every rank register again (memfd: the KV
    bytes move into the new sidecar's reservation at the same address)."""
    time.sleep(3)
    old_address = P.connector.scheduler.addresses[0]  # type: ignore[union-attr]
    for side in (p_side, d_side):
        assert side.stop() == 0
    start_all([p_side, d_side])
    deadline = time.monotonic() + WAIT_S
    for w in workers(P) + workers(D):  # noticed while idle, within a third of a lease
        while w.engine_id not in w._keepalive.missing:
            assert time.monotonic() < deadline, "the keepalive never saw the restart"
            time.sleep(0.1)
    time.sleep(LEASE_S + 2)  # the restarted sidecars do not release anything meanwhile
    # The first request finishes prefill in the step where P registers again:
    # its params name P's old address (vLLM hands the scheduler the new one only
    # with that step's output), so D's read of it fails and D recomputes it.
    first = read_one(P, D, "restart-1", 70, 62)
    assert first["failed"] == {"restart-1"}
    new_address = P.connector.scheduler.addresses[0]  # type: ignore[union-attr]
    assert new_address != old_address and new_address.split("/", 1)[0].endswith(
        p_side.handshake.rsplit(":", 1)[1])
    run_until(D, lambda: "restart-1" in D.outputs and D.outputs["restart-1"][-1].finished)
    # From then on: served, oracle-exact.
    second = read_one(P, D, "restart-2", 70, 63)
    assert not second["failed"]
    verify(D, "restart-2", second["blocks"], 70, 63)
    run_until(P, lambda: "restart-2" not in P.sched.requests)
    assert [w.registrations for w in workers(P) + workers(D)] == [2, 2]
    return "ok"


def test_idle_for_two_leases_and_a_sidecar_restarted_while_idle(tmp_path: Path) -> None:
    model = write_model(tmp_path / "llama", False)
    sides = {n: SidecarProcess(tmp_path, n) for n in ("idle-p", "idle-d", "rst-p", "rst-d")}
    start_all(list(sides.values()))
    engines: list[Engine] = []
    try:
        idle_p = make_engine("idleP", model, "kv_producer", 1, [sides["idle-p"].socket], 32,
                             False)
        idle_d = make_engine("idleD", model, "kv_consumer", 1, [sides["idle-d"].socket], 32,
                             False)
        rst_p = make_engine("rstP", model, "kv_producer", 1, [sides["rst-p"].socket], 32, False)
        rst_d = make_engine("rstD", model, "kv_consumer", 1, [sides["rst-d"].socket], 32, False)
        engines = [idle_p, idle_d, rst_p, rst_d]
        seeds = {"idle-1": 61, "restart-1": 62, "restart-2": 63}
        for P in (idle_p, rst_p):
            P.fill = oracle_fill(lambda rid: seeds[rid])
        with ThreadPoolExecutor(2) as pool:
            idle = pool.submit(idle_then_serve, idle_p, idle_d)
            rst = pool.submit(restart_then_serve, rst_p, rst_d, sides["rst-p"], sides["rst-d"])
            assert idle.result() == "ok"
            assert rst.result() == "ok"
        # The idle pair kept its one registration, and its sidecars never took it
        # for gone.
        assert [w.registrations for w in workers(idle_p) + workers(idle_d)] == [1, 1]
        for n in ("idle-p", "idle-d"):
            log = sides[n].read_log()
            assert "is gone" not in log and "sent no request" not in log, log
            with SidecarClient(sides[n].socket) as c:
                assert c.ping().engine_lease_s == LEASE_S
    finally:
        for eng in engines:
            eng.shutdown()
        for s in sides.values():
            s.stop()
