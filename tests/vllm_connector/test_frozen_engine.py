"""A prefill engine frozen past its ``--engine-lease`` (a SIGSTOP, a debugger, a
long GC pause: every thread stops, its keepalive too), then continued, through
vLLM 0.33's real scheduler and real sidecars.

The sidecar takes the silent engine for gone; the engine, continued, learns
its registration is gone (``UnknownEngine``), ends its holds' sends (vLLM
frees and reuses their blocks) and registers again. Whatever the sidecar did
with the old registration, a decode engine must never receive the old
request's KV from blocks the prefill engine has reused: its read fails and
vLLM recomputes it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

if os.environ.get("KVSIDECAR_REQUIRE_VLLM"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm==0.33.0)")

from kvsidecar.sim.cluster import SidecarProcess

from .harness import make_engine, oracle_fill, request, write_model
from .test_connector import SHM, WAIT_S, prefill, run_until, schedule_reads, start_all, verify
from .test_liveness import read_one

pytestmark = pytest.mark.vllm

LEASE_S = 2.0


def test_a_frozen_prefill_engine_never_serves_blocks_it_reused(tmp_path: Path) -> None:
    """P (POSIX shm, attach mode) holds ``a`` for D, freezes past its lease and
    is continued: it ends ``a``'s send, reuses its blocks for ``b``; D, linked
    to P since an earlier read, then reads ``a``: the read fails (recomputed),
    never reported received with ``b``'s bytes."""
    model = write_model(tmp_path / "llama", False)
    p_side = SidecarProcess(tmp_path, "frz-p", args=[
        "--engine-lease", str(LEASE_S), "--metrics-port", "0", *SHM])
    d_side = SidecarProcess(tmp_path, "frz-d")
    start_all([p_side, d_side])
    seeds = {"warm": 71, "a": 72, "b": 73}
    P = make_engine("frzP", model, "kv_producer", 1, [p_side.socket], 10, False,
                    memory="shm")
    D = make_engine("frzD", model, "kv_consumer", 1, [d_side.socket], 32, False)
    try:
        P.fill = oracle_fill(lambda rid: seeds[rid])
        warm = read_one(P, D, "warm", 60, seeds["warm"])  # D links to P's registration
        assert not warm["failed"]
        verify(D, "warm", warm["blocks"], 60, seeds["warm"])
        run_until(P, lambda: "warm" not in P.sched.requests)
        params = prefill(P, "a", 60, seeds["a"])
        a_blocks = {b for g in P.block_ids("a") for b in g}
        pw = P.workers[0].worker
        assert pw is not None and pw._keepalive is not None
        run_until(P, lambda: "a" in pw._holding)
        pw._keepalive.close()  # frozen: no call, no keepalive
        deadline = time.monotonic() + WAIT_S
        while "frzP" not in {ln.split("'")[1] for ln in p_side.read_log().splitlines()
                             if "is gone" in ln and "'" in ln}:
            assert time.monotonic() < deadline, "P's sidecar never took P for gone"
            time.sleep(0.1)
        # Continued: P learns its registration is gone, ends a's send, frees a's blocks.
        run_until(P, lambda: "a" not in P.sched.requests)
        run_until(P, lambda: pw.registrations == 2)
        P.sched.add_request(request(P, "b", 130, {"do_remote_decode": True}, max_tokens=1,
                                    seed=seeds["b"]))
        run_until(P, lambda: "b" in P.outputs and P.outputs["b"][-1].finished)
        reused = a_blocks & {b for g in P.block_ids("b") for b in g}
        assert reused, "b did not reuse a's blocks: the test proves nothing"
        D.sched.add_request(request(D, "a", 60, dict(params), seed=seeds["a"]))
        blocks = schedule_reads(D, "a")["a"]
        failed: set[str] = set()
        got = False
        deadline = time.monotonic() + WAIT_S
        while not got:
            assert time.monotonic() < deadline, "D's read of a never ended"
            _, agg = D.step()
            out = agg.kv_connector_output
            if out is not None:
                failed |= set(out.failed_recving or ())
                if out.invalid_block_ids and "a" in (out.finished_recving or ()):
                    failed.add("a")
                got = "a" in (out.finished_recving or ())
        if "a" not in failed:  # reported received: its bytes must be a's
            verify(D, "a", blocks, 60, seeds["a"])
        assert failed == {"a"}, "D received a from blocks P had freed"
    finally:
        P.shutdown()
        D.shutdown()
        for s in (p_side, d_side):
            s.stop()
