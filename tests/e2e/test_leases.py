"""End to end: hold leases both sides know (issue #7 item 2), real sidecars.

A D sidecar claims the hold on each P rank before it posts, renews while it
reads, and abandons on failure; P refuses claims for holds that ended."""

from __future__ import annotations

import socket
import time

import pytest

from kvsidecar.daemon.d_side.addresses import INLINE_PLAN_PIECES_ALONE
from kvsidecar.ipc.client import HoldSpec
from kvsidecar.ipc.layout import Layout, attention_layout
from kvsidecar.ipc.protocol import KeepItem, RemoteEngine
from kvsidecar.sim.cluster import Sent, SidecarProcess, SimEngine, stop_mid_read
from kvsidecar.sim.models import attn
from kvsidecar.sim.oracle import Request

pytestmark = pytest.mark.e2e


def test_a_read_after_the_hold_expired_is_refused_before_anything_is_posted(pool) -> None:
    with pool.engines(attn(8), 2, 1) as (P, (D,)):
        sent = P.prefill("late", Request(seed=1, prompt_tokens=24), timeout_s=0.3)
        got_p = P.wait_for(["late"])["late"]
        assert {c.kind for c in got_p.values()} == {"expired"}
        D.start_read(sent)
        got = D.wait_for(["late"])["late"][0]
        assert got.kind == "failed", got
        assert "refused the lease" in got.reason and "has ended (expired)" in got.reason
        assert got.invalid_block_ids


def test_a_failed_read_releases_the_hold_at_once_not_at_its_deadline(pool) -> None:
    """The hold would live 1000 s; the reader's abandon ends it (aborted, naming
    the failure) as soon as the read failed."""
    with pool.engines(attn(8), 1, 2) as (P, (D,)):
        sent = P.prefill("doomed", Request(seed=2, prompt_tokens=24), timeout_s=1000)
        n = P.layout.num_blocks
        for c in D.clients:
            c.read(D.engine_id, "doomed", [D.alloc(1)], sent.remote, [[n + 5]],
                   remote_tokens=sent.tokens)
        got = D.wait_for(["doomed"])["doomed"]
        assert {c.kind for c in got.values()} == {"failed"}
        held = P.wait_for(["doomed"])["doomed"][0]
        assert held.kind == "aborted", held
        # Refused before posting: the read names blocks the hold's token does not pin.
        assert "gave up" in held.reason and "other blocks than the hold token pins" in held.reason


def test_the_hold_reply_carries_the_lease_for_the_decode_side(pool) -> None:
    with pool.engines(attn(8), 1, 1) as (P, _):
        ids = P.blocks_for(8)
        held = P.clients[0].hold(P.engine_id, "h", ids, timeout_s=5)
        assert held.lease_s == 10.0 and held.timeout_s == 5
        P.clients[0].release(P.engine_id, "h")


def test_a_read_aborted_before_its_first_claim_still_tells_p(pool) -> None:
    """The read links to both P ranks before it claims; P rank 1's address is a
    socket that never answers, so the read is still linking when the engine
    releases it. It ends ``aborted`` and abandons every P rank at once: the
    hold on rank 0 (which would live 1000 s) ends ``aborted`` naming the abort,
    not by its deadline."""
    with pool.engines(attn(8), 2, 1) as (P, (D,)):
        sent = P.prefill("early-abort", Request(seed=3, prompt_tokens=24), timeout_s=1000)
        silent = socket.socket()  # accepts TCP connections, never speaks ZMQ
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        try:
            good = sent.remote
            sent.remote = RemoteEngine(good.engine_id, 2,
                                       [good.handshake[0], f"127.0.0.1:{silent.getsockname()[1]}"])
            rec = D.start_read(sent)
            D.clients[0].release(D.engine_id, "early-abort")
            got = D.wait_for(["early-abort"])["early-abort"][0]
            assert got.kind == "aborted" and "nothing had been posted" in got.reason, got
            assert got.invalid_block_ids == rec.block_ids
            # Rank 1's abandon went to the silent socket: the engine releases that rank.
            P.clients[1].release(P.engine_id, "early-abort")
            held = P.wait_for(["early-abort"], timeout_s=60)["early-abort"]
            assert held[0].kind == "aborted", held[0]
            assert "gave up" in held[0].reason and "aborted" in held[0].reason, held[0]
            assert held[1].kind == "aborted" and "released by the engine" in held[1].reason
        finally:
            silent.close()


def _big(tp: int, nb: int) -> Layout:
    """16 layers x 256 KiB per block: a 96-block read moves 384 MiB (seconds over TCP)."""
    return attention_layout(model="lease", num_layers=16, total_kv_heads=8, head_dim=128,
                            block_tokens=64, tp_size=tp, num_blocks=nb)



def test_a_lease_that_runs_out_mid_read_fails_the_read_and_ends_the_hold(tmp_path) -> None:
    """Over TCP P's sidecar is stopped once D posted a 384 MiB read; P grants 1 s
    leases, so D's renewals go unanswered and the lease runs out mid-read. When
    P resumes the transfer finishes (well inside D's 60 s read timeout), but D
    reports ``failed`` naming the lease, never ``received``; P's hold (60 s
    timeout) ends with the transfer, not at its deadline, ``sent``: the
    transfer carried its notification, so D sends no abandon (beside the
    notification it could reach P first and end the hold ``aborted``). A read
    whose transfer ended before the stop landed (~0.2 s after the post here)
    is not the case under test: it is read, and the test tries again."""
    env = {"UCX_TLS": "tcp,self"}
    p = SidecarProcess(tmp_path, "lease-p", env=env,
                       args=["--hold-lease", "1", "--metrics-port", "0"]).start()
    # Claim first (--post-during-claim 0): this test is about renewals after a
    # grant; posted during its claim, the read could meet the stopped P before
    # the grant, and fail on the unanswered claim instead (see the test below).
    d = SidecarProcess(tmp_path, "lease-d", env=env, args=[
        "--read-timeout", "60", "--handshake-timeout", "1", "--metrics-port", "0",
        "--post-during-claim", "0"]).start()
    P = SimEngine("lease-P", _big, 1, 100, [p], timeout_s=60)
    D = SimEngine("lease-D", _big, 1, 100, [d], timeout_s=60)
    try:
        D.start_read(P.prefill("warm", Request(seed=1, prompt_tokens=8)))
        assert D.wait_for(["warm"])["warm"][0].kind == "received"
        assert D.verify("warm") == []
        D.finish("warm")
        big = Request(seed=2, prompt_tokens=64 * 96)  # P's pages stay POISON (no oracle fill)
        for attempt in range(5):
            rid = f"lapse{attempt}"
            sent = Sent(rid, P.remote, P.blocks_for(big.prompt_tokens), big)
            sent.tokens.append(P.clients[0].hold(P.engine_id, rid, sent.block_ids, readers=1,
                                                 timeout_s=60).token)
            lost = d.metric("kvsidecar_leases_lost_total", engine="lease-D")
            D.start_read(sent)
            if stop_mid_read(d, p, D, 2 + attempt, [rid], lapses=1):  # warm + this
                break
            # The transfer ended before P stopped: not the case under test; again.
            D.wait_for([rid])
            D.finish(rid)
            P.wait_for([rid])
            P.free(sent.block_ids)
        else:
            pytest.fail("each of 5 transfers of 384 MiB ended before P could be stopped")
        got = D.wait_for([rid], timeout_s=120)[rid][0]
        assert got.kind == "failed", got
        assert "lease ran out" in got.reason, got.reason
        assert got.invalid_block_ids == D.receiving[rid].block_ids
        # P's hold ends with the read: NIXL sends the completion notification inside
        # D's check_xfer_state when it sees the transfer DONE, and D sends no
        # abandon after it (below). So P's outcome is "sent": the blocks were read
        # and are free.
        held = P.wait_for([rid], timeout_s=60)[rid][0]
        assert held.kind == "sent", held
        assert d.metric("kvsidecar_leases_lost_total", engine="lease-D") == lost + 1
        assert d.metric("kvsidecar_agent_resets_total", engine="lease-D") == 0  # it finished
        D.finish(rid)
        # A later read's claim travels behind any abandon D sent for the read (one
        # control connection, answered in order): once it is received, P has
        # answered every abandon D sent, and there was none.
        D.start_read(P.prefill("after", Request(seed=3, prompt_tokens=8)))
        assert D.wait_for(["after"])["after"][0].kind == "received"
        assert D.verify("after") == []
        assert p.metric("kvsidecar_lease_requests_total", op="abandon") == 0
        D.finish("after")
    finally:
        D.close()
        P.close()
        assert d.stop() == 0
        p.stop()


def test_reads_over_a_recently_confirmed_link_post_during_their_claim(tmp_path) -> None:
    """The first read over a link claims first; the next ones (P granted a claim
    over that link moments ago) post while their claim is on its way, and notify
    P only after the grant: their bytes are oracle-exact and P's holds end
    ``sent``. A read whose claim P refuses (the engine released the hold) fails
    although its bytes landed, and leaves the link good for the next read. With
    ``--post-during-claim 0`` every read claims first."""
    p = SidecarProcess(tmp_path, "pdc-p", args=["--metrics-port", "0"]).start()
    # A window no loaded CI host outlasts between these reads (the default, 2 s,
    # is a deployment's choice, not what this test is about): 30 s was seen to
    # lapse between D's last granted claim and the read after the refused one
    # (the whole test took 125 s at load 2).
    d = SidecarProcess(tmp_path, "pdc-d", args=["--metrics-port", "0",
                                                "--post-during-claim", "600"]).start()
    d0 = SidecarProcess(tmp_path, "pdc-d0", args=["--metrics-port", "0",
                                                  "--post-during-claim", "0"]).start()
    # room for a read planned on the planning thread (over
    # INLINE_PLAN_PIECES_ALONE: this 3-layer layout has 6 pieces a page)
    big_pages = INLINE_PLAN_PIECES_ALONE // 6 + 8
    P = SimEngine("pdc-P", attn(8), 1, big_pages + 64, [p])
    D = SimEngine("pdc-D", attn(8), 1, big_pages + 64, [d])
    D0 = SimEngine("pdc-D0", attn(8), 1, 64, [d0])
    early = "kvsidecar_reads_posted_during_claim_total"
    try:
        for i, reader in enumerate((D0, D0, D, D)):
            rid = f"r{i}"
            reader.start_read(P.prefill(rid, Request(seed=i, prompt_tokens=24)))
            got = reader.wait_for([rid])[rid][0]
            assert got.kind == "received", got
            assert reader.verify(rid) == []
            assert P.wait_for([rid], timeout_s=10)[rid][0].kind == "sent"
            reader.finish(rid)
        assert d.metric(early, engine="pdc-D") == 1  # D's second read
        assert d0.metric(early, engine="pdc-D0") == 0
        # every read's claim round trip is observed, posted during it or not
        claims = "kvsidecar_lease_claim_seconds_count"
        assert d.metric(claims, engine="pdc-D") == 2
        assert d0.metric(claims, engine="pdc-D0") == 2

        sent = P.prefill("gone", Request(seed=9, prompt_tokens=24), timeout_s=60)
        P.clients[0].release(P.engine_id, "gone")
        assert P.wait_for(["gone"])["gone"][0].kind == "aborted"
        rec = D.start_read(sent)
        got = D.wait_for(["gone"])["gone"][0]
        assert got.kind == "failed" and "refused the lease" in got.reason, got
        assert got.invalid_block_ids == rec.block_ids
        assert d.metric(early, engine="pdc-D") == 2  # posted, then refused
        D.finish("gone")

        D.start_read(P.prefill("after", Request(seed=10, prompt_tokens=24)))
        assert D.wait_for(["after"])["after"][0].kind == "received"
        assert D.verify("after") == []
        assert P.wait_for(["after"], timeout_s=10)["after"][0].kind == "sent"
        assert d.metric(early, engine="pdc-D") == 3
        # A read larger than what is planned on the loop goes through the
        # planning thread (the small ones above are planned and posted in the
        # read task's first step, their claim sent after); it posts during its
        # claim only if the grant has not come back before its plan did.
        D.start_read(P.prefill("big", Request(seed=11, prompt_tokens=8 * big_pages)))
        assert D.wait_for(["big"])["big"][0].kind == "received"
        assert D.verify("big") == []
        assert P.wait_for(["big"], timeout_s=10)["big"][0].kind == "sent"
        assert d.metric("kvsidecar_agent_resets_total", engine="pdc-D") == 0
        # One notification per received read (none for the refused one): a read
        # posted during its claim never carries one on its transfer as well.
        assert p.metric("kvsidecar_notifications_received_total", outcome="ok") == 6
    finally:
        for e in (D0, D, P):
            e.close()
        for s in (d0, d, p):
            assert s.stop() == 0


def test_reads_posted_during_their_claim_over_a_rank_that_re_registered_re_link(
        tmp_path) -> None:
    """P rank 1 re-registers (new agent, new memory, new hold key) right after D
    confirmed both links. Four reads follow at once; those that find the
    confirmed links would post during their claims over the stale link, but
    rank 1's hold token does not check against the key D linked with, so
    nothing is posted: the read re-links and is retried whole. Every read is
    received, oracle-exact, and P's holds on both ranks end ``sent``; no
    failure is a PartialReadError (nothing was notified)."""
    ps = [SidecarProcess(tmp_path, f"rr-p{i}", args=["--metrics-port", "0"]).start()
          for i in range(2)]
    d = SidecarProcess(tmp_path, "rr-d", args=["--metrics-port", "0",
                                               "--post-during-claim", "600"]).start()
    P = SimEngine("rr-P", attn(8), 2, 96, ps)
    D = SimEngine("rr-D", attn(8), 1, 96, [d])
    early = "kvsidecar_reads_posted_during_claim_total"
    try:
        D.start_read(P.prefill("warm", Request(seed=1, prompt_tokens=24)))
        assert D.wait_for(["warm"])["warm"][0].kind == "received"
        D.finish("warm")
        assert d.metric(early, engine="rr-D") == 0  # the first read over a link claims first
        P.register_again(1)
        rids = [f"after-{i}" for i in range(4)]
        sents = [P.prefill(rid, Request(seed=2 + i, prompt_tokens=24), timeout_s=60)
                 for i, rid in enumerate(rids)]
        for sent in sents:  # one read call each: --post-during-claim is the per-read path
            D.start_read(sent)
        got = D.wait_for(rids)
        for rid in rids:
            assert got[rid][0].kind == "received", got[rid][0]
            assert D.verify(rid) == []
        held = P.wait_for(rids, timeout_s=30)
        assert {c.kind for rid in rids for c in held[rid].values()} == {"sent"}
        # Caught by the token check over the stale link, before anything was posted.
        assert "remote rank 1: the hold token was not issued" in d.read_log()
        assert "retrying with a fresh handshake" in d.read_log()
        assert "PartialReadError" not in d.read_log()
    finally:
        D.close()
        P.close()
        assert d.stop() == 0
        for p in ps:
            assert p.stop() == 0


def test_a_late_claim_stays_refused_after_many_more_holds_ended(tmp_path) -> None:
    """P remembers why a hold ended for its last 65,536 ends; a claim for an
    older one must still be refused while its token lives, or D would read
    blocks the engine reused and report them ``received``. Both kinds of token:
    the sidecar's (``hold``) and the engine's own (placed with ``hold_nowait``)."""
    p = SidecarProcess(tmp_path, "late-p", args=["--metrics-port", "0"]).start()
    d = SidecarProcess(tmp_path, "late-d").start()
    P = SimEngine("late-P", attn(8), 1, 96, [p])
    D = SimEngine("late-D", attn(8), 1, 96, [d])
    try:
        by_sidecar = P.prefill("by-sidecar", Request(seed=1, prompt_tokens=24), timeout_s=0.5)
        by_engine = P.prefill("by-engine", Request(seed=2, prompt_tokens=16), hold=False)
        P.hold_nowait([by_engine])
        P.clients[0].release(P.engine_id, "by-engine")
        ended = P.wait_for(["by-sidecar", "by-engine"], timeout_s=30)
        assert ended["by-sidecar"][0].kind == "expired" and ended["by-engine"][0].kind == "aborted"
        for sent in (by_sidecar, by_engine):
            P.free(sent.block_ids)  # reused: poison
        c = P.clients[0]
        for n in range(0, 65_536 + 256, 256):  # more ends than P remembers why
            ids = [f"churn-{n + i}" for i in range(256)]
            assert not any(isinstance(o, Exception) for o in c.hold_many(
                P.engine_id, [HoldSpec(r, [[95]]) for r in ids]))
            c.release_many(P.engine_id, ids)
            c.poll(P.engine_id)
        for sent in (by_sidecar, by_engine):
            D.start_read(sent)
            got = D.wait_for([sent.request_id])[sent.request_id][0]
            assert got.kind == "failed" and "refused the lease" in got.reason, got
            assert "ended" in got.reason, got.reason
            D.finish(sent.request_id)
        assert p.metric("kvsidecar_limit_refusals_total", engine="late-P",
                        limit="ended_holds") == 2
    finally:
        D.close()
        P.close()
        assert d.stop() == 0
        assert p.stop() == 0


def test_a_hold_waits_for_every_claimants_lease_before_it_ends(tmp_path) -> None:
    """A hold for one reader that two decode engines claimed: the first to read
    does not end it while the other's lease may still have it copying the
    blocks. The hold then refuses the other engine's read as read already (not
    as ended: nothing was freed), and ends ``sent`` when that lease runs out
    (``--hold-lease 10``)."""
    p = SidecarProcess(tmp_path, "two-p",
                       args=["--hold-lease", "10", "--metrics-port", "0"]).start()
    ds = [SidecarProcess(tmp_path, f"two-d{i}").start() for i in range(2)]
    P = SimEngine("two-P", attn(8), 1, 96, [p])
    D1, D2 = (SimEngine(f"two-D{i}", attn(8), 1, 96, [d]) for i, d in enumerate(ds, 1))
    try:
        sent = P.prefill("r", Request(seed=3, prompt_tokens=24), timeout_s=60)
        # D2 admitted the request and keeps its hold: a claim, no read yet.
        D2.clients[0].keep(D2.engine_id, [KeepItem(sent.remote, "r", sent.tokens)])
        deadline = time.monotonic() + 30
        while p.metric("kvsidecar_lease_requests_total", op="claim", result="granted") < 1:
            assert time.monotonic() < deadline, "D2's keep never claimed"
            time.sleep(0.02)
        D1.start_read(sent)
        assert D1.wait_for(["r"])["r"][0].kind == "received"
        assert D1.verify("r") == []
        D2.start_read(sent)  # its claim comes while its own keep's lease runs
        late = D2.wait_for(["r"])["r"][0]
        assert late.kind == "failed" and "refused the lease" in late.reason, late
        assert "was read by its 1 reading engine(s) already" in late.reason, late.reason
        got = P.wait_for(["r"], timeout_s=60)["r"][0]
        assert got.kind == "sent", got
    finally:
        for e in (D1, D2, P):
            e.close()
        for s in (*ds, p):
            assert s.stop() == 0
