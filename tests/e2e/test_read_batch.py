"""End to end (issue #12): the reads of one engine message that read one remote
engine over links already made share one task on D (a group, daemon/d_side/driver.py), and
each still ends alone: its own lease, its own failure, its own abort, its own
completion, bytes checked against the oracle (LAYOUT.md section 6). Real
sidecars with metrics, so the batch counter counts this test only."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.ipc.client import AsyncSidecarClient, BadRequest, ReadSpec, SidecarClient
from kvsidecar.ipc.layout import Layout, attention_layout
from kvsidecar.sim.cluster import Sent, SidecarProcess, SimEngine, engine_pair, stop_mid_read
from kvsidecar.sim.models import attn
from kvsidecar.sim.oracle import Request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

BATCHED = "kvsidecar_reads_batched_total"


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[tuple[SimEngine, SimEngine, SidecarProcess]]:
    with engine_pair(tmp_path, "rb", attn(8), ["--metrics-port", "0"]) as (P, D, d):
        warm = P.prefill("w", Request(seed=69, prompt_tokens=8))
        D.start_read(warm)  # links D to P: later reads find the link made
        assert D.wait_for(["w"])["w"][0].kind == "received"
        D.finish("w")
        yield P, D, d


def test_reads_of_one_message_share_a_task_and_each_keeps_its_own_fate(engines) -> None:
    """The 16 reads of one read_many run as one batch task (counted). One whose
    remote block ids lie outside P's cache fails (planning: P's engine issued its
    token for those blocks and holds nothing under its id), one whose hold P
    released before the claim fails (refused lease), one D releases right after
    the message ends aborted (the release goes over another connection: one sent
    over the same one could be read in the same wake-up as the read_many, and
    its read would then end before it started, outside the group); the other 13
    land oracle-exact and their holds end by their own notifications."""
    P, D, d = engines
    before = d.metric(BATCHED, engine=D.engine_id)
    sents = [P.prefill(f"k{i}", Request(seed=90 + i, prompt_tokens=8 + 3 * i), hold=i != 5)
             for i in range(16)]
    bad = sents[5]
    far = [[P.layout.num_blocks + 7, *bad.block_ids[0][1:]]]
    sents[5] = dataclasses.replace(bad, block_ids=far, tokens=P.issue_tokens("k5", far))
    P.clients[0].release(P.engine_id, "k7")  # P gave the blocks back: no lease
    recs = D.start_reads(sents)
    with SidecarClient(d.socket) as other:
        other.release(D.engine_id, "k9")
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
    sent_back = {rid: per[0].kind for rid, per in P.wait_for(good).items()}
    assert {sent_back[rid] for rid in good} == {"sent"}


def test_reads_of_messages_queued_together_start_as_one_group(engines) -> None:
    """One ``read`` per message, 12 sent at once while D's sidecar is stopped
    (SIGSTOP), so all 12 and a release wait in its socket and one wake-up reads
    them: one read is refused at once (a local block id out of range: its error
    comes back, the others stay accepted), one is released before it started
    (it ends ``aborted``, never posted), and the other 10 start as one group
    (counted), as a ``read_many`` of them would, and land oracle-exact."""
    P, D, d = engines
    assert d.proc is not None
    before = d.metric(BATCHED, engine=D.engine_id)
    sents = [P.prefill(f"q{i}", Request(seed=120 + i, prompt_tokens=8 + 5 * i))
             for i in range(12)]

    async def burst() -> tuple[list[Any], BaseException | None]:
        client = AsyncSidecarClient(d.socket, timeout_s=30)
        try:
            d.proc.send_signal(signal.SIGSTOP)
            try:
                good = asyncio.ensure_future(D.start_reads_at_once([client], sents[:11]))
                bad = asyncio.ensure_future(client.read(
                    D.engine_id, "q-bad", [[D.layout.num_blocks + 3]], sents[11].remote,
                    sents[11].block_ids, remote_tokens=sents[11].tokens))
                await asyncio.sleep(0.2)  # every read is in D's socket by now
                release = asyncio.ensure_future(client.release(D.engine_id, "q4"))
                await asyncio.sleep(0.1)
            finally:
                d.proc.send_signal(signal.SIGCONT)
            recs = await good
            await release
            refused = await asyncio.gather(bad, return_exceptions=True)
            return recs, refused[0]
        finally:
            await client.close()

    recs, refused = asyncio.run(burst())
    assert isinstance(refused, BadRequest) and "out of range" in str(refused), refused
    rids = [s.request_id for s in sents[:11]]
    got = {rid: per[0] for rid, per in D.wait_for(rids).items()}
    assert d.metric(BATCHED, engine=D.engine_id) - before == 10
    assert got["q4"].kind == "aborted"
    assert got["q4"].invalid_block_ids == recs[4].block_ids
    good = [rid for rid in rids if rid != "q4"]
    for rid in good:
        assert got[rid].kind == "received", (rid, got[rid])
        assert not D.verify(rid), rid
    sent_back = {rid: per[0].kind for rid, per in P.wait_for(good).items()}
    assert {sent_back[rid] for rid in good} == {"sent"}


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


def _big(tp: int, nb: int) -> Layout:
    """16 layers x 256 KiB per block: a 48-block read moves 192 MiB (a while over TCP)."""
    return attention_layout(model="lease", num_layers=16, total_kv_heads=8, head_dim=128,
                            block_tokens=64, tp_size=tp, num_blocks=nb)


def test_a_batch_renews_each_reads_lease_and_each_read_judges_its_own(tmp_path: Path) -> None:
    """Two big reads in one read_many, over TCP, P granting 1 s leases: once both
    are posted P's sidecar is stopped, so the renewals the batch's timer starts
    go unanswered and each read's lease runs out mid-read. When P resumes both
    transfers finish (inside D's 60 s read timeout), but each read reports
    ``failed`` naming its lease, never ``received``; P's holds end with the
    transfers. Both went as one batch (counted). A batch whose transfer ended
    before the stop landed (192 MiB take ~0.1 s here) is not the case under
    test: it is read, and the test tries again."""
    env = {"UCX_TLS": "tcp,self"}
    p = SidecarProcess(tmp_path, "rbl-p", env=env, args=["--hold-lease", "1"]).start()
    d = SidecarProcess(tmp_path, "rbl-d", env=env, args=[
        "--read-timeout", "60", "--handshake-timeout", "1", "--metrics-port", "0"]).start()
    P = SimEngine("rbl-P", _big, 1, 100, [p], timeout_s=60)
    D = SimEngine("rbl-D", _big, 1, 100, [d], timeout_s=60)
    try:
        D.start_read(P.prefill("warm", Request(seed=1, prompt_tokens=8)))
        assert D.wait_for(["warm"])["warm"][0].kind == "received"
        D.finish("warm")
        for attempt in range(5):
            sents = []
            for i in range(2):
                big = Request(seed=2 + i, prompt_tokens=64 * 48)  # P's pages stay POISON
                sent = Sent(f"lapse{attempt}-{i}", P.remote, P.blocks_for(big.prompt_tokens),
                            big)
                sent.tokens.append(P.clients[0].hold(P.engine_id, sent.request_id,
                                                     sent.block_ids, readers=1,
                                                     timeout_s=60).token)
                sents.append(sent)
            rids = [s.request_id for s in sents]
            lapsed = d.log_path.read_text().count("lease lapsed")
            lost = d.metric("kvsidecar_leases_lost_total", engine="rbl-D")
            before = d.metric(BATCHED, engine="rbl-D")
            D.start_reads(sents)
            # warm + two per attempt posted; both leases must run out mid-read
            if stop_mid_read(d, p, D, 1 + 2 * (attempt + 1), rids, lapses=lapsed + 2):
                break
            # A transfer ended before P stopped: not the case under test; again.
            D.wait_for(rids, timeout_s=120)
            P.wait_for(rids, timeout_s=60)
            for sent in sents:
                D.finish(sent.request_id)
                P.free(sent.block_ids)
        else:
            pytest.fail("in each of 5 batches a 192 MiB transfer ended before P was stopped")
        got = {rid: per[0] for rid, per in D.wait_for(rids, timeout_s=120).items()}
        assert d.metric(BATCHED, engine="rbl-D") - before == 2
        for rid in rids:
            assert got[rid].kind == "failed", got[rid]
            assert "lease ran out" in got[rid].reason, got[rid].reason
            assert got[rid].invalid_block_ids == D.receiving[rid].block_ids
        held = P.wait_for(rids, timeout_s=60)
        assert {per[0].kind for per in held.values()} == {"sent"}  # read, then freed
        assert d.metric("kvsidecar_leases_lost_total", engine="rbl-D") == lost + 2
        for rid in rids:
            D.finish(rid)
    finally:
        D.close()
        P.close()
        assert d.stop() == 0
        p.stop()


@pytest.mark.parametrize("how", ["deregister", "stop"])
def test_a_batch_cut_short_by_deregistration_or_stop_leaves_no_hold_on_p(
        engines, how: str) -> None:
    """D's engine deregisters (or D's sidecar is stopped) right after its
    read_many: whatever stage each read of the batch reached (claiming,
    planning, posted), deregistration and stop return, and every one of P's 16
    holds (1000 s timeout) ends well before its deadline: read (the
    notification), or abandoned."""
    P, D, d = engines
    before = d.metric(BATCHED, engine=D.engine_id)
    sents = [P.prefill(f"c{i}", Request(seed=50 + i, prompt_tokens=8 + 3 * i),
                       timeout_s=1000) for i in range(16)]
    D.start_reads(sents)
    if how == "deregister":
        D.clients[0].deregister(D.engine_id)
        assert d.metric(BATCHED, engine=D.engine_id) - before == 16  # one batch was cut
    else:
        assert d.stop() == 0
    held = P.wait_for([s.request_id for s in sents], timeout_s=60)
    assert len(held) == 16 and all(per[0].kind != "expired" for per in held.values())
    if how == "deregister":  # the sidecar serves on: a new engine reads oracle-exact
        D2 = SimEngine("rb-D2", attn(8), 1, 200, [d])
        try:
            D2.start_read(P.prefill("after", Request(seed=99, prompt_tokens=24)))
            assert D2.wait_for(["after"])["after"][0].kind == "received"
            assert not D2.verify("after")
        finally:
            D2.close()


def test_reads_sent_without_waiting_queue_and_refusals_come_through_poll(engines) -> None:
    """A blocking engine sends 12 reads with ``read_nowait`` (one message each,
    no answer awaited) while D's sidecar is stopped (SIGSTOP), and one it
    refuses (a local block id out of range): the calls return at once, the
    reads queue in D's socket and one wake-up starts the 11 good ones as one
    group (counted), which land oracle-exact; the refused one is a ``failed``
    completion from the engine's poll, naming the refusal."""
    P, D, d = engines
    assert d.proc is not None
    before = d.metric(BATCHED, engine=D.engine_id)
    sents = [P.prefill(f"n{i}", Request(seed=150 + i, prompt_tokens=8 + 5 * i))
             for i in range(12)]
    client = D.clients[0]
    d.proc.send_signal(signal.SIGSTOP)
    try:
        recs = D.start_reads_nowait(sents[:11])
        client.read_nowait(D.engine_id, "n-bad", [[D.layout.num_blocks + 3]],
                           sents[11].remote, sents[11].block_ids,
                           remote_tokens=sents[11].tokens)
        assert len(client._core.posted) == 12  # sent, none answered yet
    finally:
        d.proc.send_signal(signal.SIGCONT)
    rids = [s.request_id for s in sents[:11]]
    got = {rid: per[0] for rid, per in D.wait_for([*rids, "n-bad"]).items()}
    assert got["n-bad"].kind == "failed"
    assert got["n-bad"].reason.startswith("refused by the sidecar (bad_request)")
    assert "out of range" in got["n-bad"].reason
    assert d.metric(BATCHED, engine=D.engine_id) - before == 11
    for rid, rec in zip(rids, recs):
        assert got[rid].kind == "received", (rid, got[rid])
        assert not D.verify(rec.request_id), rid
    sent_back = {rid: per[0].kind for rid, per in P.wait_for(rids).items()}
    assert {sent_back[rid] for rid in rids} == {"sent"}
    P.clients[0].release(P.engine_id, sents[11].request_id)


def test_holds_sent_without_waiting_pin_what_reads_take(engines) -> None:
    """P's engine issues its tokens itself and holds with ``hold_nowait`` (no
    answer awaited); one hold is refused (a block id out of range). The held
    requests' reads land oracle-exact and their holds end ``sent``; the
    refused hold is a ``failed`` completion from P's poll, and once P's engine
    knows that (it may reuse the blocks), a read presenting that hold's token
    fails at D: P grants no lease on blocks the engine was told are not held."""
    P, D, _ = engines
    sents = [P.prefill(f"hn{i}", Request(seed=170 + i, prompt_tokens=8 + 5 * i), hold=False)
             for i in range(6)]
    P.hold_nowait(sents[:5])
    P.clients[0].hold_nowait(P.engine_id, "hn5", [[P.layout.num_blocks + 3]])
    assert len(P.clients[0]._core.posted) == 6  # sent, none answered yet
    refused = P.wait_for(["hn5"])["hn5"][0]  # P's engine learns of the refusal
    assert refused.kind == "failed", refused
    assert refused.reason.startswith("refused by the sidecar (bad_request)")
    assert len(P.clients[0]._core.posted) == 0
    recs = D.start_reads_nowait(sents)
    rids = [s.request_id for s in sents]
    got = {rid: per[0] for rid, per in D.wait_for(rids).items()}
    for rid, rec in zip(rids[:5], recs):
        assert got[rid].kind == "received", (rid, got[rid])
        assert not D.verify(rec.request_id), rid
    assert got["hn5"].kind == "failed", got["hn5"]
    assert "the hold was refused" in got["hn5"].reason, got["hn5"]
    assert got["hn5"].invalid_block_ids == recs[5].block_ids
    held = {rid: per[0] for rid, per in P.wait_for(rids[:5]).items()}
    assert {held[rid].kind for rid in rids[:5]} == {"sent"}


def test_batches_sent_without_waiting_report_refused_items_through_poll(engines) -> None:
    """P's engine holds a step's requests with one ``hold_many_nowait`` (its own
    tokens), one hold refused (a block out of range); D's engine reads them
    with one ``read_many_nowait``, one read refused (a local block out of
    range). Neither call waits; each refused item is a ``failed`` completion
    of its own request from its engine's poll, the others land oracle-exact,
    and the read of the refused hold's blocks fails."""
    P, D, _ = engines
    sents = [P.prefill(f"bn{i}", Request(seed=190 + i, prompt_tokens=8 + 5 * i), hold=False)
             for i in range(5)]
    bad_hold = Sent("bn-bad-hold", sents[4].remote, [[P.layout.num_blocks + 3]],
                    sents[4].req)
    P.hold_many([*sents[:3], bad_hold, *sents[3:]], wait=False)
    assert len(P.clients[0]._core.posted) == 1  # one message, not answered yet
    refused = P.wait_for(["bn-bad-hold"])["bn-bad-hold"][0]
    assert refused.kind == "failed" and "(bad_request)" in refused.reason
    recs = D.start_reads(sents[:4], wait=False)
    D.clients[0].read_many_nowait(D.engine_id, [ReadSpec(
        "bn-bad-read", [[D.layout.num_blocks + 3]], sents[4].remote, sents[4].block_ids,
        remote_request_id=sents[4].request_id, remote_tokens=sents[4].tokens)])
    rids = [s.request_id for s in sents[:4]]
    got = {rid: per[0] for rid, per in D.wait_for([*rids, "bn-bad-read"]).items()}
    assert got["bn-bad-read"].kind == "failed", got["bn-bad-read"]
    assert got["bn-bad-read"].reason.startswith("refused by the sidecar (bad_request)")
    for rid, rec in zip(rids, recs):
        assert got[rid].kind == "received", (rid, got[rid])
        assert not D.verify(rec.request_id), rid
    held = {rid: per[0] for rid, per in P.wait_for(rids).items()}
    assert {held[rid].kind for rid in rids} == {"sent"}
    P.clients[0].release(P.engine_id, sents[4].request_id)
