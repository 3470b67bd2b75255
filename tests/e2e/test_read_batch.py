"""End to end (issue #12): the reads of one engine message that read one remote
engine over links already made share one task on D (daemon/read_batch.py), and
each still ends alone: its own lease, its own failure, its own abort, its own
completion, bytes checked against the oracle (LAYOUT.md section 6). Real
sidecars with metrics, so the batch counter counts this test only."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsidecar.sim.cluster import SidecarProcess, SimEngine
from kvsidecar.sim.models import attn
from kvsidecar.sim.oracle import Request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

BATCHED = "kvsidecar_reads_batched_total"


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[tuple[SimEngine, SimEngine, SidecarProcess]]:
    p = SidecarProcess(tmp_path, "rb-p", args=["--metrics-port", "0"]).start()
    d = None
    P = D = None
    try:
        d = SidecarProcess(tmp_path, "rb-d", args=["--metrics-port", "0"]).start()
        P = SimEngine("rb-P", attn(8), 1, 200, [p])
        D = SimEngine("rb-D", attn(8), 1, 200, [d])
        warm = P.prefill("w", Request(seed=69, prompt_tokens=8))
        D.start_read(warm)  # links D to P: later reads find the link made
        assert D.wait_for(["w"])["w"][0].kind == "received"
        D.finish("w")
        yield P, D, d
    finally:
        for e in (D, P):
            if e is not None:
                e.close()
        codes = {"p": p.stop(), "d": d.stop() if d is not None else 0}
        assert codes == {"p": 0, "d": 0}, codes


def test_reads_of_one_message_share_a_task_and_each_keeps_its_own_fate(engines) -> None:
    """The 16 reads of one read_many run as one batch task (counted). One whose
    remote block ids lie outside P's cache fails (planning), one whose hold P
    released before the claim fails (refused lease), one D releases right after
    the message ends aborted; the other 13 land oracle-exact and their holds end
    by their own notifications."""
    P, D, d = engines
    before = d.metric(BATCHED, engine=D.engine_id)
    sents = [P.prefill(f"k{i}", Request(seed=90 + i, prompt_tokens=8 + 3 * i))
             for i in range(16)]
    bad = sents[5]
    sents[5] = dataclasses.replace(
        bad, block_ids=[[P.layout.num_blocks + 7, *bad.block_ids[0][1:]]])
    P.clients[0].release(P.engine_id, "k7")  # P gave the blocks back: no lease
    recs = D.start_reads(sents)
    D.clients[0].release(D.engine_id, "k9")
    rids = [s.request_id for s in sents]
    got = {rid: per[0] for rid, per in D.wait_for(rids).items()}
    assert d.metric(BATCHED, engine=D.engine_id) - before == 16
    assert got["k5"].kind == "failed" and "out of range" in got["k5"].reason
    assert got["k5"].invalid_block_ids == recs[5].block_ids
    assert got["k7"].kind == "failed" and "refused the lease" in got["k7"].reason
    assert got["k7"].invalid_block_ids == recs[7].block_ids
    assert got["k9"].kind == "aborted"
    assert got["k9"].invalid_block_ids == recs[9].block_ids
    good = [rid for rid in rids if rid not in ("k5", "k7", "k9")]
    for rid in good:
        assert got[rid].kind == "received", (rid, got[rid])
        assert not D.verify(rid), rid
    sent_back = {rid: per[0].kind for rid, per in P.wait_for([*good, "k5"]).items()}
    assert {sent_back[rid] for rid in good} == {"sent"}
    assert sent_back["k5"] == "aborted"  # the failed read gave its hold up at once


def test_a_batch_to_two_p_ranks_moves_oracle_exact_bytes(tmp_path: Path) -> None:
    """D tp 1 reading P tp 2 (two candidate ranks, two links): a batch claims
    every rank for every read and posts to both; every read lands oracle-exact."""
    ps = [SidecarProcess(tmp_path, f"rb2-p{i}", args=["--metrics-port", "0"]).start()
          for i in range(2)]
    d = SidecarProcess(tmp_path, "rb2-d", args=["--metrics-port", "0"]).start()
    P = SimEngine("rb2-P", attn(8), 2, 200, ps)
    D = SimEngine("rb2-D", attn(8), 1, 200, [d])
    try:
        warm = P.prefill("w", Request(seed=3, prompt_tokens=8))
        D.start_read(warm)
        assert D.wait_for(["w"])["w"][0].kind == "received"
        before = d.metric(BATCHED, engine=D.engine_id)
        sents = [P.prefill(f"t{i}", Request(seed=30 + i, prompt_tokens=8 + 7 * i))
                 for i in range(8)]
        D.start_reads(sents)
        rids = [s.request_id for s in sents]
        got = D.wait_for(rids)
        assert d.metric(BATCHED, engine=D.engine_id) - before == 8
        assert {rid: got[rid][0].kind for rid in rids} == dict.fromkeys(rids, "received")
        for rid in rids:
            assert not D.verify(rid), rid
        assert {c.kind for per in P.wait_for(rids).values() for c in per.values()} == {"sent"}
    finally:
        D.close()
        P.close()
        codes = [s.stop() for s in (*ps, d)]
        assert codes == [0, 0, 0], codes
