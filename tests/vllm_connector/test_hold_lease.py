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


def test_keeps_are_cut_by_claims_and_a_round_cut_short_resumes_where_it_stopped() -> None:
    """A Keep carries at most MAX_BATCH items and MAX_KEEP_CLAIMS_PER_KEEP claims
    (an item claims up to its P tp size), so a wide P does not get every Keep
    refused; when the sidecar refuses a Keep (its claims in flight at their
    bound), the next round starts with the items it did not keep, so the same
    tail of waiting requests is not left out every round."""
    from kvsidecar.integrations.vllm.transfers import Transfers, keep_chunks
    from kvsidecar.ipc.errors import Unavailable
    from kvsidecar.ipc.protocol import MAX_BATCH, MAX_KEEP_CLAIMS_PER_KEEP, KeepItem, RemoteEngine

    def item(i: int, tp: int) -> KeepItem:
        return KeepItem(RemoteEngine("P", tp, [f"h:{r}" for r in range(tp)]), f"r{i}",
                        ["t"] * tp)

    narrow = keep_chunks([item(i, 1) for i in range(600)])
    assert [len(c) for c in narrow] == [MAX_BATCH, MAX_BATCH, 600 - 2 * MAX_BATCH]
    wide = keep_chunks([item(i, 32) for i in range(300)])
    assert all(sum(x.remote.tp_size for x in c) <= MAX_KEEP_CLAIMS_PER_KEEP for c in wide)
    assert [len(c) for c in wide] == [128, 128, 44]

    sent: list[list[str]] = []

    class Client:
        refuse_after = 1

        def keep(self, engine_id: str, chunk: list[KeepItem]) -> None:
            if len(sent) >= self.refuse_after:
                raise Unavailable("unavailable", "keep claims in flight at their bound")
            sent.append([x.remote_request_id for x in chunk])

    t = object.__new__(Transfers)
    t.client, t.engine_id, t._keeps, t._keep_from = Client(), "D", True, 0
    t._lost = t._unreachable = ""
    items = [item(i, 1) for i in range(600)]
    t._keep(items)  # keeps the first 256, refused at the second Keep
    assert sent == [[f"r{i}" for i in range(256)]]
    sent.clear()
    t._keep(items)  # starts with r256
    assert sent == [[f"r{i}" for i in range(256, 512)]]
