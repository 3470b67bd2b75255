"""P's blocks live as long as a live reader wants them: D keeps the holds of the
requests it admitted while they wait (``Keep``), and P frees what nobody keeps
one ``--hold-lease`` after the last claim. Through vLLM 0.33's real scheduler
and real sidecars; P's hold timeout (``hold_timeout_s``) and lease
(``--hold-lease``) are shortened so the test waits seconds, not minutes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

if os.environ.get("KVSIDECAR_REQUIRE_VLLM"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm==0.33.0)")

from vllm.v1.request import RequestStatus

from kvsidecar.sim.cluster import SidecarProcess

from .harness import make_engine, oracle_fill, request, write_model
from .test_connector import FAST, prefill, run_until, start_all, verify

pytestmark = pytest.mark.vllm

HOLD_TIMEOUT_S = 4.0  # P's hold of a request no reader claimed
LEASE_S = 2.0  # each claim keeps it this much longer (P's --hold-lease)
KEEP_EVERY_S = 0.5  # D keeps its admitted requests this often


def test_a_queued_request_keeps_p_blocks_and_a_vanished_reader_lets_them_go(
        tmp_path: Path) -> None:
    """D runs one request at a time (``max_num_seqs`` 1) and is busy with a local
    one: the remote request it admitted waits 3 hold timeouts, kept alive at P,
    then reads oracle-exact bytes. A second admitted request whose D then
    vanishes (no more steps, so no more keeps) is freed by P within one lease
    of the last keep, long before it would have been without the lease."""
    model = write_model(tmp_path / "llama", False)
    p_side = SidecarProcess(tmp_path, "p", args=["--hold-lease", str(LEASE_S), *FAST])
    d_side = SidecarProcess(tmp_path, "d", args=FAST)
    start_all([p_side, d_side])
    seeds = {"q": 41, "v": 42}
    P = make_engine("Pk", model, "kv_producer", 1, [p_side.socket], 64, False,
                    hold_timeout_s=HOLD_TIMEOUT_S)
    D = make_engine("Dk", model, "kv_consumer", 1, [d_side.socket], 64, False,
                    keep_every_s=KEEP_EVERY_S)
    P.fill = oracle_fill(lambda rid: seeds[rid])
    D.sched.max_num_running_reqs = D.sched.max_num_active_reqs = 1
    try:
        D.sched.add_request(request(D, "busy", 20, None, max_tokens=100_000))
        D.step()
        assert D.sched.requests["busy"].status == RequestStatus.RUNNING
        params = prefill(P, "q", 60, seeds["q"])
        admitted = time.monotonic()
        D.sched.add_request(request(D, "q", 60, dict(params), seed=seeds["q"]))
        while time.monotonic() - admitted < 3 * HOLD_TIMEOUT_S:
            D.step()  # "busy" decodes; "q" waits for a running slot, kept alive
            P.step()
            assert D.sched.requests["q"].status == RequestStatus.WAITING_FOR_REMOTE_KVS \
                or D.sched.requests["q"].status == RequestStatus.WAITING
            assert "q" in P.sched.requests, "P freed the blocks of a request D keeps"
            time.sleep(0.1)
        D.sched.finish_requests("busy", RequestStatus.FINISHED_ABORTED)
        D.step()  # schedules the read of "q"
        blocks = tuple(list(g) for g in D.block_ids("q"))
        run_until(D, lambda: D.sched.requests["q"].status == RequestStatus.RUNNING)
        verify(D, "q", blocks, 60, seeds["q"])
        run_until(P, lambda: "q" not in P.sched.requests)

        # A reader that vanishes: admitted (kept for a while past the hold
        # timeout), then its engine stops.
        params = prefill(P, "v", 50, seeds["v"])
        D.sched.add_request(request(D, "busy2", 20, None, max_tokens=100_000))
        D.step()
        D.sched.add_request(request(D, "v", 50, dict(params), seed=seeds["v"]))
        admitted = time.monotonic()
        while time.monotonic() - admitted < 2 * HOLD_TIMEOUT_S:
            D.step()
            P.step()
            time.sleep(0.1)
        assert "v" in P.sched.requests
        gone = time.monotonic()  # D makes no call from here on: its keeps stop
        run_until(P, lambda: "v" not in P.sched.requests)
        freed_after = time.monotonic() - gone
        # The last keep went out at most KEEP_EVERY_S before D stopped; P's
        # housekeeping ends the hold within 0.1 s of its lease, the next P step
        # frees the blocks.
        assert freed_after < LEASE_S + 1.5, freed_after
    finally:
        P.shutdown()
        D.shutdown()
        for s in (p_side, d_side):
            s.stop()
