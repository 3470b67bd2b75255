"""End to end: races, restarts and stalls (found by review, kept as regressions)."""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any

import numpy as np
import pytest

from kvsidecar.ipc.client import BadRequest, SidecarClient
from kvsidecar.ipc.protocol import (
    Completion,
    Error,
    Poll,
    RemoteEngine,
    decode_reply,
    encode_request,
)
from kvsidecar.ipc.seqpacket import BlockingChannel
from kvsidecar.sim.cluster import SidecarProcess, SimEngine, stop_once_posted
from kvsidecar.sim.models import attn, hybrid
from kvsidecar.sim.models import stall as stall_layout
from kvsidecar.sim.oracle import Request

pytestmark = pytest.mark.e2e


def test_release_right_after_read_always_completes_and_frees_the_id(pool) -> None:
    """A Release can cancel a read task before its first step; it must still report,
    and tell P: each read has its own hold, which ends ``sent`` when the read won
    the race and ``aborted`` (the reader's abandon) when it was cancelled before
    anything was posted."""
    with pool.engines(attn(8), 1, 1) as (P, (D,)):
        c = D.clients[0]
        rids = [f"race-{i}" for i in range(20)]
        used = []
        for i, rid in enumerate(rids):
            sent = P.prefill(f"p-{rid}", Request(seed=1 + i, prompt_tokens=8))
            ids = D.alloc(1)
            used.append(ids)
            c.read(D.engine_id, rid, [ids], sent.remote, sent.block_ids,
                   remote_request_id=f"p-{rid}", remote_tokens=sent.tokens)
            c.release(D.engine_id, rid)
        got = D.wait_for(rids)
        held = P.wait_for([f"p-{r}" for r in rids])
        for rid in rids:
            d, p = got[rid][0], held[f"p-{rid}"][0]
            assert d.kind in ("aborted", "received"), d
            if d.kind == "received" or "transfers had finished" in d.reason:
                assert p.kind == "sent", (d, p)
            else:
                assert "nothing had been posted" in d.reason, d
                assert p.kind == "aborted" and "gave up" in p.reason, (d, p)
        D.free(used)  # re-poison what the reads that won the race wrote
        # Every id is free again: a new read under the same id is accepted.
        sent = P.prefill("race-again", Request(seed=1, prompt_tokens=24))
        D.start_read(sent, request_id=rids[0])
        assert D.wait_for([rids[0]])[rids[0]][0].kind == "received"
        assert not D.verify(rids[0])


def test_a_release_that_loses_the_race_to_its_read_is_a_no_op(pool) -> None:
    """Engines abort requests whose reads may just have finished (vLLM's abort path):
    while the outcome waits to be acknowledged, a release is accepted and changes
    nothing; once acknowledged, the id is unknown again."""
    with pool.engines(attn(8), 1, 1) as (P, (D,)):
        sent = P.prefill("late", Request(seed=1, prompt_tokens=24))
        c = D.clients[0]
        D.start_read(sent, request_id="late-0")
        got = D.wait_for(["late-0"])  # polled, not yet acknowledged
        assert got["late-0"][0].kind == "received"
        c.release(D.engine_id, "late-0")
        assert not D.verify("late-0")  # the release touched nothing
        D.poll()  # acknowledges the completion
        with pytest.raises(BadRequest, match="no read or hold 'late-0'"):
            c.release(D.engine_id, "late-0")


def test_reads_recover_after_the_prefill_engine_re_registers(pool) -> None:
    """Cached handshakes and NIXL links go stale when a peer re-registers; the first
    read that trips over them refreshes them and is retried once."""
    with pool.engines(hybrid, 2, 1) as (P, (D,)):
        D.start_read(P.prefill("before", Request(seed=1, prompt_tokens=40)))
        assert {c.kind for c in D.wait_for(["before"])["before"].values()} == {"received"}
        engine_id = P.engine_id
        P.close()
        P2 = SimEngine(engine_id, hybrid, 2, 96, pool.p[:2])
        try:
            # Several reads at once trip over the same stale links; each recovers.
            rids = [f"after-{i}" for i in range(4)]
            for i, rid in enumerate(rids):
                D.start_read(P2.prefill(rid, Request(seed=2 + i, prompt_tokens=40)))
            got = D.wait_for(rids)
            for rid in rids:
                assert {c.kind for c in got[rid].values()} == {"received"}, got[rid]
                assert not D.verify(rid)
            sent = P2.wait_for(rids)
            assert {c.kind for r in rids for c in sent[r].values()} == {"sent"}
        finally:
            P2.close()


def test_a_new_decode_engine_reads_from_a_prefill_engine_that_re_registered(pool) -> None:
    """Issue 7 item 3: P re-registers (new NIXL agent) after D's sidecar cached its
    handshake. A D engine that registers afterwards must not inherit the stale
    handshake (it used to fail every read with NIXL_ERR_BACKEND naming the old
    agent); the old D engine recovers too. Bytes checked by the oracle."""
    P = SimEngine(pool.uid("P"), attn(8), 1, 96, pool.p[:1])
    D1 = SimEngine(pool.uid("D"), attn(8), 1, 96, pool.d[:1])
    D2: SimEngine | None = None
    P2: SimEngine | None = None
    try:
        D1.start_read(P.prefill("before", Request(seed=1, prompt_tokens=24)))
        assert D1.wait_for(["before"])["before"][0].kind == "received"
        D1.finish("before")
        engine_id = P.engine_id
        P.close()
        P2 = SimEngine(engine_id, attn(8), 1, 96, pool.p[:1])
        D2 = SimEngine(pool.uid("D"), attn(8), 1, 96, pool.d[:1])
        for i in range(3):  # every read, not just the first, is received
            rid = f"new-{i}"
            D2.start_read(P2.prefill(rid, Request(seed=10 + i, prompt_tokens=24)))
            got = D2.wait_for([rid])[rid][0]
            assert got.kind == "received", got
            assert not D2.verify(rid)
            D2.finish(rid)
        D1.start_read(P2.prefill("old", Request(seed=20, prompt_tokens=24)))
        assert D1.wait_for(["old"])["old"][0].kind == "received"
        assert not D1.verify("old")
    finally:
        for e in (D2, D1, P2):
            if e is not None:
                e.close()


def test_reads_work_after_the_prefill_sidecar_restarts_on_the_same_address(pool, tmp_path
                                                                         ) -> None:
    """Issue 7 item 3: P's sidecar restarts on the same handshake address (new
    daemon id, new agents). Old and new D engines read correct bytes afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = SidecarProcess(tmp_path, "restart-p", args=["--handshake-port", str(port)]).start()
    D1 = SimEngine(pool.uid("D"), attn(8), 1, 96, pool.d[:1])
    made: list[SimEngine] = [D1]
    try:
        P = SimEngine("restart-P", attn(8), 1, 96, [p])
        made.append(P)
        D1.start_read(P.prefill("before", Request(seed=1, prompt_tokens=24)))
        assert D1.wait_for(["before"])["before"][0].kind == "received"
        D1.finish("before")
        P.close()
        made.remove(P)
        assert p.stop() == 0
        p = SidecarProcess(tmp_path, "restart-p2", args=["--handshake-port", str(port)]).start()
        assert p.handshake.endswith(f":{port}")
        P2 = SimEngine("restart-P", attn(8), 1, 96, [p])
        made.append(P2)
        D2 = SimEngine(pool.uid("D"), attn(8), 1, 96, pool.d[:1])
        made.append(D2)
        for D, rid in ((D2, "new"), (D1, "old")):
            D.start_read(P2.prefill(rid, Request(seed=5, prompt_tokens=24)))
            got = D.wait_for([rid])[rid][0]
            assert got.kind == "received", got
            assert not D.verify(rid)
    finally:
        for e in reversed(made):
            e.close()
        p.stop()


def test_a_rank_that_re_registered_is_caught_by_the_lease_before_anything_is_posted(
        pool) -> None:
    """P rank 1 re-registers under D's feet while rank 0 stays. Before leases the read
    from rank 0 went through and the request could only fail half-done; now
    rank 1's hold token does not check against the key of the registration D
    linked to (a new registration has a new hold key) before anything is
    posted, so the read re-links and receives the right bytes."""
    with pool.engines(attn(8), 2, 1) as (P, (D,)):
        D.start_read(P.prefill("warm", Request(seed=1, prompt_tokens=24)))
        assert D.wait_for(["warm"])["warm"][0].kind == "received"
        P.register_again(1)
        D.start_read(P.prefill("after", Request(seed=2, prompt_tokens=24)))
        got = D.wait_for(["after"])["after"][0]
        assert got.kind == "received", got
        assert not D.verify("after")
        assert ("remote rank 1: the hold token was not issued for request 'after'"
                in pool.d[0].read_log())
        assert "retrying with a fresh handshake" in pool.d[0].read_log()


def test_a_batch_over_a_rank_that_re_registered_re_links_each_read(pool) -> None:
    """The same within a ``read_many``: every read's token fails against the key
    D linked with, and each read goes on in a task of its own, re-links and
    receives, as a read alone does (the batch completed them failed, unretried)."""
    with pool.engines(attn(8), 2, 1) as (P, (D,)):
        D.start_read(P.prefill("warm", Request(seed=1, prompt_tokens=24)))
        assert D.wait_for(["warm"])["warm"][0].kind == "received"
        P.register_again(1)
        sents = [P.prefill(f"again{i}", Request(seed=3 + i, prompt_tokens=24))
                 for i in range(3)]
        D.start_reads(sents)
        got = D.wait_for([s.request_id for s in sents])
        for s in sents:
            c = got[s.request_id][0]
            assert c.kind == "received", c
            assert not D.verify(s.request_id)
        assert "retrying with a fresh handshake" in pool.d[0].read_log()


SENTINEL = 0x5A


def _failed_pages(D: SimEngine, got: Completion) -> list[np.ndarray]:
    """Views of every page of every block the completion listed as invalid."""
    page = D.layout.page_bytes
    return [buf[b * page:(b + 1) * page] for buf in D.buffers[0]
            for group in got.invalid_block_ids for b in group]


@pytest.mark.timeout(300)
def test_no_byte_lands_after_a_read_is_reported_failed(tmp_path) -> None:
    """Issue #7 item 1. Over TCP, P's sidecar is stopped in the middle of a 384 MiB
    read; D reports it failed after --read-timeout, the engine writes a sentinel
    into the failed blocks, P resumes, and seconds later the sentinel is intact:
    the failure was reported only after D's agent was destroyed (which kills the
    transfer). D keeps serving: a fresh read afterwards gets the oracle's bytes."""
    env = {"UCX_TLS": "tcp,self"}
    p = SidecarProcess(tmp_path, "stall-p", env=env).start()
    d = SidecarProcess(tmp_path, "stall-d", env=env,
                       args=["--read-timeout", "1", "--metrics-port", "0"]).start()
    q = SidecarProcess(tmp_path, "stall-q", env=env).start()
    P = SimEngine("stall-P", stall_layout, 1, 100, [p], timeout_s=60)
    Q = SimEngine("stall-Q", stall_layout, 1, 100, [q], timeout_s=60)
    D = SimEngine("stall-D", stall_layout, 1, 100, [d], timeout_s=60)
    X = SimEngine("stall-X", stall_layout, 1, 100, [q], timeout_s=60)
    try:
        D.start_read(P.prefill("warm", Request(seed=1, prompt_tokens=8)))
        assert D.wait_for(["warm"])["warm"][0].kind == "received"
        D.finish("warm")
        # Held without the oracle's fill (384 MiB of hashing is minutes on 2 cores):
        # P's bytes are POISON, anything but the sentinel.
        sent = P.prefill("stuck", Request(seed=2, prompt_tokens=64 * 96), fill=False)
        assert p.proc is not None
        D.start_read(sent)
        # Stop P only once D posted the read: 384 MiB over TCP takes seconds.
        stop_once_posted(d, p, "stall-D", 2)  # warm + this
        try:
            got = D.wait_for(["stuck"], timeout_s=60)["stuck"][0]
            assert got.kind == "failed", got
            assert "timed out" in got.reason, got.reason
            assert got.invalid_block_ids == D.receiving["stuck"].block_ids
            pages = _failed_pages(D, got)
            for page in pages:  # the engine reuses the blocks at once
                page[:] = SENTINEL
        finally:
            os.kill(p.proc.pid, signal.SIGCONT)
        time.sleep(8)  # P's stalled sends go out now, to an agent that no longer exists
        landed = sum(int(np.count_nonzero(page != SENTINEL)) for page in pages)
        assert landed == 0, f"{landed} bytes landed in blocks reported failed"
        assert d.alive()
        with SidecarClient(d.socket) as c:
            assert "stall-D" in c.ping().engines
        D.finish("stuck")  # the engine frees the failed blocks (poisons them again)
        # D still serves: a fresh read (new agent, fresh links) gets the oracle's bytes.
        # From a P sidecar that was never stopped: the stopped one may not survive its
        # reader's teardown (UCX aborts P when it resumes; docs/failure-handling.md).
        D.start_read(Q.prefill("after", Request(seed=3, prompt_tokens=64 * 2)))
        assert D.wait_for(["after"])["after"][0].kind == "received"
        assert not D.verify("after")
        assert "reset as" in d.log_path.read_text()
        # The held-back read is counted where operators look (exactly this one read).
        assert d.metric("kvsidecar_late_completions_quarantined_total", engine="stall-D") == 1
        assert d.metric("kvsidecar_agent_resets_total", engine="stall-D") == 1
        # The reset engine still serves as a source: its handshake kept the hold key
        # (rebuilt from scratch it had none, and every read from it was refused).
        X.start_read(D.prefill("back", Request(seed=4, prompt_tokens=8)))
        back = X.wait_for(["back"])["back"][0]
        assert back.kind == "received", back
        assert not X.verify("back")
    finally:
        X.close()
        D.close()
        Q.close()
        if p.alive():
            P.close()
        assert d.stop() == 0
        q.stop()
        p.stop()


def test_bad_remote_description_fails_the_read_not_the_daemon(pool) -> None:
    with pool.engines(attn(8), 1, 1) as (P, (D,)):
        sent = P.prefill("far", Request(seed=1, prompt_tokens=16))
        n = P.layout.num_blocks
        c = D.clients[0]
        ids = D.alloc(2)
        far = [[n + 5, 2**62]]  # a token for them (P's engine issues it): the peer's layout refuses
        c.read(D.engine_id, "far", [ids], sent.remote, far, remote_request_id="far-x",
               remote_tokens=P.issue_tokens("far-x", far))
        got = D.wait_for(["far"])["far"][0]
        assert got.kind == "failed" and "remote group 0: block id" in got.reason
        # An address that is not host:port is refused at the door, nothing accepted.
        with pytest.raises(BadRequest, match="expected host:port"):
            c.read(D.engine_id, "far2", [ids], RemoteEngine(P.engine_id, 1, ["not-an-address"]),
                   sent.block_ids)
        assert c.ping().version == 1


def test_a_poll_reply_lost_to_a_timeout_is_delivered_again(pool) -> None:
    """Completions stay until acknowledged by the next poll of the same epoch."""
    with pool.engines(attn(8), 1, 1) as (P, _):
        P.prefill("lost", Request(seed=1, prompt_tokens=8), timeout_s=0.2)
        c = P.clients[0]
        deadline = time.monotonic() + 20
        while not (first := c.poll(P.engine_id)):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert [x.kind for x in first] == ["expired"]
        # Pretend that reply never arrived: the client acknowledges what it had before.
        epoch, last = c._core.acks[P.engine_id]
        c._core.acks[P.engine_id] = (epoch, last - 1)
        assert [x.request_id for x in c.poll(P.engine_id)] == ["lost"]
        assert c.poll(P.engine_id) == []
        # Another registration's numbers are never taken as acknowledgements.
        c._core.acks[P.engine_id] = ("other-epoch", 10**6)
        assert c.poll(P.engine_id) == []


def test_an_ack_past_the_newest_completion_is_refused_and_drops_nothing(pool) -> None:
    """An engine that acknowledges a number no reply ever carried (a bug, or an
    out-of-range id from an attacker of its own uid) gets a clear error, and the
    completions waiting stay to be polled. Before: everything numbered up to the
    bogus ack was dropped unseen, that poll's and every later one's."""
    with pool.engines(attn(8), 1, 1) as (P, _):
        c = P.clients[0]
        assert c.poll(P.engine_id) == []
        epoch, last = c._core.acks[P.engine_id]
        P.prefill("kept", Request(seed=1, prompt_tokens=8), timeout_s=0.2)
        deadline = time.monotonic() + 20
        with BlockingChannel(pool.p[0].socket, timeout_s=30) as chan:
            def poll(ack: int) -> Any:
                chan.send(encode_request(Poll(P.engine_id, ack, epoch, id=ack % 1000 + 1)))
                return decode_reply(chan.recv())

            while not poll(last).items:  # acknowledges nothing new: the item stays
                assert time.monotonic() < deadline
                time.sleep(0.02)
            for bogus in (last + 2, 10**12):
                err = poll(bogus)
                assert isinstance(err, Error) and err.code == "bad_request", err
                assert "past the newest completion" in err.message and "nothing" in err.message
        assert [x.kind for x in c.poll(P.engine_id)] == ["expired"]
        assert c.poll(P.engine_id) == []


@pytest.mark.parametrize("reserve", [False, True], ids=["allocated", "reserved"])
def test_an_engine_released_by_its_lease_hears_unknown_engine_only_after_its_reads_ended(
        tmp_path, reserve: bool) -> None:
    """A D engine silent past --engine-lease (frozen) while its read is in the middle
    of a transfer (P's sidecar stopped, over TCP). ``unknown_engine`` tells an engine
    that nothing of its registration can still touch its memory (the vLLM connector
    then reuses the read's blocks), so the sidecar must not say it while that
    transfer may still land: until it ended the engine is told ``unavailable``
    (releasing), a registration of its id is refused so too, and blocks it reuses
    after ``unknown_engine`` stay as it wrote them. ``reserved``: its memory is a
    reservation (the vLLM connector's), which nothing may free meanwhile (the
    stale-reservation sweep once freed it under the landing transfer)."""
    from kvsidecar.ipc.client import Unavailable, UnknownEngine
    env = {"UCX_TLS": "tcp,self"}
    p = SidecarProcess(tmp_path, "lease-p", env=env).start()
    d = SidecarProcess(tmp_path, "lease-d", env=env, args=[
        "--engine-lease", "2", "--read-timeout", "8", "--metrics-port", "0"]).start()
    P = SimEngine("lease-P", stall_layout, 1, 100, [p], timeout_s=60)
    D = SimEngine("lease-D", stall_layout, 1, 100, [d], timeout_s=60, reserve=reserve)
    try:
        sent = P.prefill("stuck", Request(seed=2, prompt_tokens=64 * 96), fill=False)
        assert p.proc is not None
        D.start_read(sent)
        stop_once_posted(d, p, "lease-D", 1)
        try:
            deadline = time.monotonic() + 60
            while "'lease-D' is gone" not in d.read_log():  # D's engine stays silent
                assert time.monotonic() < deadline, "D's sidecar never released D"
                time.sleep(0.1)
            (client,) = D.clients
            refused: list[str] = []
            while True:  # the engine continued: it polls until told its fate
                try:
                    client.poll(D.engine_id)
                except Unavailable as e:
                    refused.append(str(e))
                    if len(refused) == 1:  # nor may it register again, or free it
                        with pytest.raises(Unavailable, match="is releasing"):
                            client.register(D.engine_id, 0, D.layout, allocate=True)
                        with pytest.raises(Unavailable, match="is releasing"):
                            client.deregister(D.engine_id)
                    time.sleep(0.2)
                    continue
                except UnknownEngine:
                    break
                raise AssertionError("a released engine's poll was answered")
            pages = [buf[b * D.layout.page_bytes:(b + 1) * D.layout.page_bytes]
                     for buf in D.buffers[0] for g in D.receiving["stuck"].block_ids
                     for b in g]
            for page in pages:  # lost: the engine reuses the read's blocks at once
                page[:] = SENTINEL
        finally:
            os.kill(p.proc.pid, signal.SIGCONT)
        assert refused and all("is releasing" in r for r in refused), refused
        time.sleep(8)  # whatever P still had to send goes out now
        landed = sum(int(np.count_nonzero(page != SENTINEL)) for page in pages)
        assert landed == 0, f"{landed} bytes landed in blocks after unknown_engine"
        assert d.alive()
        assert "releasing the reservation" not in d.read_log()
    finally:
        D.close()
        if p.alive():
            P.close()
        assert d.stop() == 0
        p.stop()
