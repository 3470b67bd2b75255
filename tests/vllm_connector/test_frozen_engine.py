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

import logging
import os
import signal
import time
from pathlib import Path

import pytest

if os.environ.get("KVSIDECAR_REQUIRE_VLLM"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm==0.33.0)")

from kvsidecar.sim.cluster import SidecarProcess

from .flows import assert_drained
from .harness import failed_reads, make_engine, oracle_fill, request, write_model
from .test_connector import SHM, WAIT_S, prefill, run_until, schedule_reads, start_all, verify
from .test_liveness import read_one

pytestmark = pytest.mark.vllm

LEASE_S = 2.0


def _until_gone(side: SidecarProcess, engine_id: str) -> None:
    """Until ``side`` took ``engine_id`` for gone (its log says so)."""
    deadline = time.monotonic() + WAIT_S
    while f"engine {engine_id!r} is gone" not in side.read_log():
        assert time.monotonic() < deadline, f"{side.name} never took {engine_id} for gone"
        time.sleep(0.1)


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


def test_a_frozen_decode_engine_recovers_its_read_and_says_so_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """D freezes past its lease with a read in flight (P's sidecar stopped, so the
    read cannot end), then is continued: while its sidecar still ends the read
    D's polls are refused ("releasing", logged once, not once per step); then D
    learns the registration is gone, fails the read (vLLM recomputes it),
    registers again, and a later request is oracle-exact; no request or block
    is left behind on either side."""
    caplog.set_level(logging.DEBUG, logger="kvsidecar.integrations.vllm")
    model = write_model(tmp_path / "llama", False)
    p_side = SidecarProcess(tmp_path, "frz-p2")
    d_side = SidecarProcess(tmp_path, "frz-d2", args=[
        "--engine-lease", str(LEASE_S), "--read-timeout", "6"])
    start_all([p_side, d_side])
    assert p_side.proc is not None
    seeds = {"w": 81, "r": 82, "y": 83}
    P = make_engine("frzP2", model, "kv_producer", 1, [p_side.socket], 32, False)
    D = make_engine("frzD2", model, "kv_consumer", 1, [d_side.socket], 32, False)
    try:
        P.fill = oracle_fill(lambda rid: seeds[rid])
        warm = read_one(P, D, "w", 50, seeds["w"])
        verify(D, "w", warm["blocks"], 50, seeds["w"])
        params = prefill(P, "r", 50, seeds["r"])
        pw, dw = P.workers[0].worker, D.workers[0].worker
        assert pw is not None and dw is not None and dw._keepalive is not None
        run_until(P, lambda: "r" in pw._holding)
        p_side.proc.send_signal(signal.SIGSTOP)  # r's read cannot end
        D.sched.add_request(request(D, "r", 50, dict(params), seed=seeds["r"]))
        D.step()  # the read goes out
        D.dirty.update(b for g in D.block_ids("r") for b in g)  # a failed read may write
        dw._keepalive.close()  # frozen
        _until_gone(d_side, "frzD2")
        failed: set[str] = set()
        deadline = time.monotonic() + WAIT_S
        while dw.registrations < 2:  # continued
            assert time.monotonic() < deadline, "D never registered again"
            _, agg = D.step()
            failed |= failed_reads(agg.kv_connector_output)
        assert failed == {"r"}
        p_side.proc.send_signal(signal.SIGCONT)
        run_until(D, lambda: "r" not in D.sched.requests)  # recomputed, finished
        y = read_one(P, D, "y", 50, seeds["y"])
        assert not y["failed"]
        verify(D, "y", y["blocks"], 50, seeds["y"])
        run_until(D, lambda: not D.sched.requests)
        run_until(P, lambda: not P.sched.requests)
        assert_drained(P)
        assert_drained(D)
        refused = [r for r in caplog.records if "refused a poll" in r.getMessage()]
        assert refused and "is releasing" in refused[0].getMessage()
        assert [r.levelno for r in refused].count(logging.ERROR) == 1, sorted(
            {r.getMessage()[-160:] for r in refused})[:5]
    finally:
        if p_side.alive():
            p_side.proc.send_signal(signal.SIGCONT)
        P.shutdown()
        D.shutdown()
        for s in (p_side, d_side):
            s.stop()
