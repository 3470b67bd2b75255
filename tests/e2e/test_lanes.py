"""Posting lanes end to end (issue #12, parallel posting per P rank): real sidecar
processes with ``--post-lanes 2`` (two NIXL agents, each on its own worker
thread, per D engine rank), real NIXL, every byte checked with the LAYOUT.md
oracle; P sees each read's notification once, from the agent D declared; a read
that fails on a lane never writes D's blocks after it is reported; deregistration
and shutdown stop every lane."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvsidecar.sim.cluster import (
    SidecarProcess,
    SimEngine,
    all_running,
    engines,
    stop_once_posted,
)
from kvsidecar.sim.models import attn, hybrid
from kvsidecar.sim.models import stall as stall_layout
from kvsidecar.sim.oracle import Request

pytestmark = pytest.mark.e2e

LANES = ["--post-lanes", "2", "--metrics-port", "0"]

Sidecars = dict[str, list[SidecarProcess]]


@pytest.fixture(scope="module")
def lanes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecars]:
    """Two P sidecars; two D sidecars with two lanes, scattered and staged each."""
    work = tmp_path_factory.mktemp("lanes")
    out: Sidecars = {
        "p": [SidecarProcess(work, f"lp{i}", args=["--hold-timeout", "60", "--metrics-port",
                                                   "0"]) for i in range(2)],
        "off": [SidecarProcess(work, f"ld{i}", args=LANES) for i in range(2)],
        "always": [SidecarProcess(work, f"lsd{i}", args=[*LANES, "--staging", "always"])
                   for i in range(2)],
    }
    with all_running(out):
        yield out


_ids = itertools.count()


def _p_notes(ps: list[SidecarProcess]) -> tuple[float, float]:
    """(reads named by the notifications P received, notifications refused as not
    from the declared agent), summed over P's sidecars."""
    return (sum(p.metric("kvsidecar_notification_reads_sum") for p in ps),
            sum(p.metric("kvsidecar_notifications_received_total", outcome="wrong_sender")
                for p in ps))


@pytest.mark.parametrize("staging", ["off", "always"])
@pytest.mark.parametrize(("family", "p_tp", "d_tp"), [
    ("hybrid", 2, 1), ("hybrid", 1, 2), ("attn-K2", 2, 1), ("attn-K2", 1, 2)])
def test_reads_on_two_lanes_are_oracle_exact(lanes: Sidecars, family: str, p_tp: int,
                                             d_tp: int, staging: str) -> None:
    """2→1 spreads each read's two P ranks over the two lanes (P rank 1's transfer
    on lane 1, without a notification); 1→2 has one P rank per D rank and stays
    on lane 0. Either way D's blocks hold the oracle's bytes, and P ends every
    hold ``sent`` once, told by exactly one notification per read and P rank that
    reads it, all from the agent D's handshake declared."""
    ps, ds = lanes["p"], lanes[staging]
    make = {"hybrid": hybrid, "attn-K2": attn(2)}[family]
    reads0, wrong0 = _p_notes(ps[:p_tp])
    with engines(ps, ds, lambda p: f"{p}{next(_ids)}", make, p_tp, d_tp) as (P, (D,)):
        rids = D.read_exactly(P, f"ln-{family}-{p_tp}{d_tp}-{staging}", 5 * p_tp + 3 * d_tp)
        held = P.wait_for(rids)
        for rid in rids:
            assert sorted(held[rid]) == list(range(p_tp)), held[rid]
            assert {c.kind for c in held[rid].values()} == {"sent"}, held[rid]
        time.sleep(0.5)  # nothing more may arrive: a second notification would count
        reads1, wrong1 = _p_notes(ps[:p_tp])
        # each P rank is read by max(1, d_tp // p_tp) D ranks, each notifying once
        assert reads1 - reads0 == len(rids) * p_tp * max(1, d_tp // p_tp)
        assert wrong1 == wrong0
        engine = D.engine_id
    spread = [sum(d.metric("kvsidecar_lane_transfers_total", engine=engine, lane=str(k))
                  for d in ds[:d_tp]) for k in range(2)]
    assert spread == ([3, 3] if p_tp == 2 else [0, 0]), spread


@pytest.mark.parametrize("family", ["hybrid", "attn-K2"])
def test_a_batch_of_reads_on_two_lanes_is_oracle_exact(lanes: Sidecars, family: str) -> None:
    """The reads of one read_many over links already made run as one batch task;
    on two lanes each read's P ranks are spread over them too, and lane 0
    notifies each read once all its transfers ended: every read oracle-exact, each
    P rank's hold ``sent`` once, one notified read per read and rank."""
    ps, ds = lanes["p"], lanes["off"]
    make = {"hybrid": hybrid, "attn-K2": attn(2)}[family]
    with engines(ps, ds, lambda p: f"{p}{next(_ids)}", make, 2, 1) as (P, (D,)):
        D.start_read(P.prefill(f"bw-{family}", Request(seed=1, prompt_tokens=30)))  # links
        assert D.wait_for([f"bw-{family}"])[f"bw-{family}"][0].kind == "received"
        batched0 = ds[0].metric("kvsidecar_reads_batched_total", engine=D.engine_id)
        lane0 = ds[0].metric("kvsidecar_lane_transfers_total", engine=D.engine_id, lane="1")
        reads0, wrong0 = _p_notes(ps)
        sents = [P.prefill(f"bt-{family}-{i}", Request(seed=20 + i, prompt_tokens=40 + 9 * i))
                 for i in range(6)]
        rids = [x.request_id for x in sents]
        D.start_reads(sents)
        got = D.wait_for(rids)
        for rid in rids:
            assert got[rid][0].kind == "received", got[rid]
            problems = D.verify(rid)
            assert not problems, f"{rid}: " + "; ".join(problems[:3])
        held = P.wait_for(rids)
        assert {c.kind for per in held.values() for c in per.values()} == {"sent"}
        time.sleep(0.5)
        reads1, wrong1 = _p_notes(ps)
        assert reads1 - reads0 == 2 * len(rids) and wrong1 == wrong0
        assert ds[0].metric("kvsidecar_reads_batched_total", engine=D.engine_id) - batched0 \
            == len(rids)
        assert ds[0].metric("kvsidecar_lane_transfers_total", engine=D.engine_id,
                            lane="1") - lane0 == len(rids)


SENTINEL = 0x5A


def test_a_large_homogeneous_read_is_split_over_the_lanes(lanes: Sidecars) -> None:
    """A tp1→tp1 read of at least SPLIT_MIN_BYTES (20 MiB here) is one post to
    one P rank: cut in halves, one per lane, both without a notification, and
    lane 0 notifies P once both ended. Oracle-exact; P's hold ends ``sent``
    once, by one notified read; each lane posted one part."""
    ps, ds = lanes["p"], lanes["off"]
    with engines(ps, ds, lambda p: f"{p}{next(_ids)}", stall_layout, 1, 1,
                 blocks=16) as (P, (D,)):
        reads0, wrong0 = _p_notes(ps[:1])
        rid = "split-1"
        D.start_read(P.prefill(rid, Request(seed=11, prompt_tokens=64 * 5)))
        got = D.wait_for([rid], timeout_s=120)[rid][0]
        assert got.kind == "received", got
        assert got.nbytes == 5 * (4 << 20)  # 16 layers x 256 KiB per block
        problems = D.verify(rid)
        assert not problems, "; ".join(problems[:3])
        assert [c.kind for c in P.wait_for([rid])[rid].values()] == ["sent"]
        time.sleep(0.5)
        reads1, wrong1 = _p_notes(ps[:1])
        assert (reads1 - reads0, wrong1 - wrong0) == (1, 0)
        engine = D.engine_id
    assert [ds[0].metric("kvsidecar_lane_transfers_total", engine=engine, lane=str(k))
            for k in range(2)] == [1, 1]


def test_large_reads_of_one_batch_are_each_split_over_the_lanes(lanes: Sidecars) -> None:
    """Two such reads in one read_many over links already made: each starts
    alone (not in the batch's group, which would post it whole on lane 0) and
    is cut in halves, one per lane; both oracle-exact, each hold ``sent``."""
    ps, ds = lanes["p"], lanes["off"]
    with engines(ps, ds, lambda p: f"{p}{next(_ids)}", stall_layout, 1, 1,
                 blocks=16) as (P, (D,)):
        D.start_read(P.prefill("bsplit-w", Request(seed=12, prompt_tokens=64)))  # links
        assert D.wait_for(["bsplit-w"])["bsplit-w"][0].kind == "received"
        engine = D.engine_id
        lanes0 = [ds[0].metric("kvsidecar_lane_transfers_total", engine=engine, lane=str(k))
                  for k in range(2)]
        batched0 = ds[0].metric("kvsidecar_reads_batched_total", engine=engine)
        sents = [P.prefill(f"bsplit-{i}", Request(seed=13 + i, prompt_tokens=64 * 5))
                 for i in range(2)]
        rids = [x.request_id for x in sents]
        D.start_reads(sents)
        got = D.wait_for(rids, timeout_s=120)
        for rid in rids:
            assert got[rid][0].kind == "received", got[rid]
            problems = D.verify(rid)
            assert not problems, "; ".join(problems[:3])
        held = P.wait_for(rids)
        assert {c.kind for per in held.values() for c in per.values()} == {"sent"}
        assert [ds[0].metric("kvsidecar_lane_transfers_total", engine=engine, lane=str(k))
                - lanes0[k] for k in range(2)] == [2, 2]
        assert ds[0].metric("kvsidecar_reads_batched_total", engine=engine) == batched0


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("p_tp", "stopped"), [(2, 1), (2, 0), (1, 0)])
def test_a_read_failing_on_one_lane_never_writes_after_it_is_reported(tmp_path: Path,
                                                                      p_tp: int,
                                                                      stopped: int) -> None:
    """The one-lane test of this (test_recovery.py,
    test_no_byte_lands_after_a_read_is_reported_failed) on two lanes: D tp1 reads
    384 MiB over TCP from P tp2 (P rank 0 on lane 0, P rank 1 on lane 1) or from P
    tp1 (cut in halves, one per lane); P rank ``stopped``'s sidecar is stopped in
    the middle. The read fails after --read-timeout, reported only once the lane
    that carried the stuck transfer was reset; the engine writes a sentinel into
    the failed blocks, P resumes, and seconds later not one byte of them changed.
    Nothing was notified (a read on lanes notifies after all its transfers
    ended), so the other P rank's hold is abandoned, not ``sent``. D keeps serving
    on both lanes: the next read (fresh links; from a P that was never stopped, as
    the stopped one may not survive its reader's teardown) gets the oracle's
    bytes."""
    env = {"UCX_TLS": "tcp,self"}
    ps = [SidecarProcess(tmp_path, f"lst-p{i}", env=env).start() for i in range(p_tp)]
    d = SidecarProcess(tmp_path, "lst-d", env=env,
                       args=["--read-timeout", "1", *LANES]).start()
    qs = [SidecarProcess(tmp_path, f"lst-q{i}", env=env).start() for i in range(p_tp)]
    P = SimEngine("lst-P", stall_layout, p_tp, 100, ps, timeout_s=60)
    Q = SimEngine("lst-Q", stall_layout, p_tp, 100, qs, timeout_s=60)
    D = SimEngine("lst-D", stall_layout, 1, 100, [d], timeout_s=60)
    stop = ps[stopped]
    try:
        D.start_read(P.prefill("warm", Request(seed=1, prompt_tokens=8)))
        assert D.wait_for(["warm"])["warm"][0].kind == "received"
        assert not D.verify("warm")
        D.finish("warm")
        sent = P.prefill("stuck", Request(seed=2, prompt_tokens=64 * 96), fill=False)
        assert stop.proc is not None
        D.start_read(sent)
        stop_once_posted(d, stop, "lst-D", 2)  # warm + this
        try:
            got = D.wait_for(["stuck"], timeout_s=60)["stuck"][0]
            assert got.kind == "failed", got
            assert "timed out" in got.reason, got.reason
            assert got.invalid_block_ids == D.receiving["stuck"].block_ids
            page = D.layout.page_bytes
            pages = [buf[b * page:(b + 1) * page] for buf in D.buffers[0]
                     for group in got.invalid_block_ids for b in group]
            for pg in pages:  # the engine reuses the blocks at once
                pg[:] = SENTINEL
        finally:
            os.kill(stop.proc.pid, signal.SIGCONT)
        time.sleep(8)  # P's stalled sends go out now, to an agent that no longer exists
        landed = sum(int(np.count_nonzero(pg != SENTINEL)) for pg in pages)
        assert landed == 0, f"{landed} bytes landed in blocks reported failed"
        assert d.alive()
        # the stuck transfer's lane was reset (and only then the read reported); a
        # read cut in halves had both parts on the stopped P (one reset at least)
        resets = d.metric("kvsidecar_agent_resets_total", engine="lst-D")
        assert resets == 1 if p_tp == 2 else resets >= 1, resets
        # 2→1: the warm read and this one spread, 1→1: only this one (4 MiB warm)
        spread = 2 if p_tp == 2 else 1
        assert d.metric("kvsidecar_lane_transfers_total", engine="lst-D", lane="1") == spread
        if p_tp == 2:
            # The P rank that was never stopped was not told the read succeeded: D
            # abandoned its hold. (The stopped one may have died on resuming.)
            live, deadline = 1 - stopped, time.monotonic() + 60
            while not (ends := [c for c in P.clients[live].poll(P.engine_id)
                                if c.request_id == "stuck"]):
                assert time.monotonic() < deadline, "the live P rank's hold never ended"
                time.sleep(0.05)
            assert [c.kind for c in ends] == ["aborted"], ends
        D.finish("stuck")
        # 20 MiB: on both lanes again (spread over 2 P ranks, or cut in halves)
        D.start_read(Q.prefill("after", Request(seed=3, prompt_tokens=64 * 5)))
        assert D.wait_for(["after"])["after"][0].kind == "received"
        assert not D.verify("after")
        assert d.metric("kvsidecar_lane_transfers_total", engine="lst-D",
                        lane="1") == spread + 1
    finally:
        D.close()
        Q.close()
        if all(p.alive() for p in ps):
            P.close()
        assert d.stop() == 0
        for s in qs + ps:
            s.stop()


#: P's leases and engine lease outlast a P rank's stop in the reset tests below (the
#: failing read's retry first waits 5 s for a handshake with the killed Q rank)
P_LONG = ["--hold-lease", "60", "--engine-lease", "120"]


def _nixl_threads(pid: int) -> int:
    """Threads of ``pid`` named as NIXL worker threads (one per lane per engine rank)."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                n += f.read().strip() == "kvs-nixl"
        except OSError:
            continue
    return n


def test_deregistration_and_shutdown_stop_every_lane(tmp_path: Path) -> None:
    """Each D engine rank runs one worker thread per lane; deregistering it stops
    them all, and a sidecar stopped with engines registered leaves no thread
    running (clean exit) and no shared memory behind."""
    p = SidecarProcess(tmp_path, "lx-p").start()
    d = SidecarProcess(tmp_path, "lx-d", args=["--post-lanes", "3",
                                                 "--allow-unsealed-shm"]).start()
    assert d.proc is not None and p.proc is not None
    try:
        base, p_base = _nixl_threads(d.proc.pid), _nixl_threads(p.proc.pid)
        with engines([p], [d], lambda x: f"lx{x}{next(_ids)}", attn(2), 1, 1) as (P, (D,)):
            # one lane (P's sidecar) starts t threads (the worker and what NIXL/UCX
            # start from it, named after it); three lanes start 3 t
            per_lane = _nixl_threads(p.proc.pid) - p_base
            assert per_lane >= 1
            assert _nixl_threads(d.proc.pid) == base + 3 * per_lane
            D.start_read(P.prefill("one", Request(seed=9, prompt_tokens=40)))
            assert D.wait_for(["one"])["one"][0].kind == "received"
            assert not D.verify("one")
        deadline = time.monotonic() + 30
        while _nixl_threads(d.proc.pid) != base:
            assert time.monotonic() < deadline, "a lane's worker thread outlived its engine"
            time.sleep(0.05)
        # Registered again and left registered: shutdown stops every lane.
        P2 = SimEngine("lx-keep", attn(2), 1, 32, [d], timeout_s=2, memory="shm")
        assert _nixl_threads(d.proc.pid) == base + 3 * per_lane
        shm = [n for n in os.listdir("/dev/shm") if "lx-keep" in n]
        assert shm, "the engine's segments were not where this test looks"
        assert d.stop() == 0
        with contextlib.suppress(Exception):  # its sidecar is gone
            P2.close()
        assert not [n for n in os.listdir("/dev/shm") if "lx-keep" in n]
        assert "engine 'lx-keep' released (daemon shutting down)" in d.read_log()
    finally:
        d.stop()
        p.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("lanes", "q_tp", "lost"), [(3, 4, 2), (2, 2, 0)],
                         ids=["another-lane", "lane-0"])
def test_a_lane_reset_keeps_the_notifications_of_reads_in_flight(
        tmp_path: Path, lanes: int, q_tp: int, lost: int) -> None:
    """A read on lanes notifies its P ranks from lane 0 once all its transfers
    ended. D reads R from P tp2 (lanes 0 and 1), P rank 1 stopped mid-transfer
    after R's lane-0 transfer ended; a read from Q (its rank k on lane k mod
    lanes) then loses Q rank ``lost`` (killed): its transfer fails and lane
    ``lost`` is reset, which drops every link of D's rank. R's notifications
    failed ('unknown remote agent') once P rank 1 resumed, and P's holds lapsed
    instead of ending ``sent``:

    - another lane (2 of 3): R's agents, idle on lane 0, were unloaded from lane
      0 under R; they now stay loaded until no read over them runs;
    - lane 0 itself: its new agent knows none of R's P agents (and P knows it
      not); each notification now goes over a fresh link, whose handshake
      declares the new agent."""
    # The kill must land while Q's transfer is pending: on a loaded host the
    # test can see the post late, after Q's 96 MiB already went (then r2 ends
    # received and no lane is reset); that run proves nothing, and a fresh set
    # of sidecars tries again.
    for attempt in range(3):
        if _lane_reset_once(tmp_path / f"try{attempt}", lanes, q_tp, lost):
            return
    raise AssertionError("Q's transfer ended before its sidecar was killed, three times")


def _lane_reset_once(tmp_path: Path, lanes: int, q_tp: int, lost: int) -> bool:
    """One run of the scenario above; False if the kill came too late (r2
    received: nothing failed, so nothing was reset), else its checks pass."""
    tmp_path.mkdir()
    env = {"UCX_TLS": "tcp,self"}
    ps = [SidecarProcess(tmp_path, f"lr-p{i}", env=env, args=P_LONG).start()
          for i in range(2)]
    # Q idles from its warm-up read until it prefills r2, 25-35 s on a loaded
    # machine: a longer engine lease keeps the simulated engine (which never
    # pings) registered; what is tested is the lane reset, not the lease.
    qs = [SidecarProcess(tmp_path, f"lr-q{i}", env=env, args=["--engine-lease", "120"]).start()
          for i in range(q_tp)]
    d = SidecarProcess(tmp_path, "lr-d", env=env,
                       args=["--post-lanes", str(lanes), "--metrics-port", "0"]).start()
    P = SimEngine("lr-P", stall_layout, 2, 100, ps, timeout_s=60)
    Q = SimEngine("lr-Q", stall_layout, q_tp, 100, qs, timeout_s=10)  # one rank is killed
    D = SimEngine("lr-D", stall_layout, 1, 200, [d], timeout_s=60)
    killed, stopped = qs[lost], ps[1]
    assert killed.proc is not None and stopped.proc is not None
    try:
        for name, src in (("wp", P), ("wq", Q)):
            D.start_read(src.prefill(name, Request(seed=4, prompt_tokens=8)))
            assert D.wait_for([name])[name][0].kind == "received"
            assert not D.verify(name)
            D.finish(name)
        D.start_read(P.prefill("r", Request(seed=5, prompt_tokens=64 * 96)))
        stop_once_posted(d, stopped, "lr-D", 3)  # P rank 1's transfer (lane 1) stalls
        try:
            time.sleep(3)  # P rank 0's 192 MiB (lane 0) arrive meanwhile
            D.start_read(Q.prefill("r2", Request(seed=6, prompt_tokens=64 * 96)))
            stop_once_posted(d, killed, "lr-D", 4, after_s=0.0)
            os.kill(killed.proc.pid, signal.SIGKILL)  # its transfer fails
            got2 = D.wait_for(["r2"], timeout_s=60)["r2"][0]
            if got2.kind == "received" and not d.metric("kvsidecar_agent_resets_total",
                                                        engine="lr-D"):
                assert not D.verify("r2")  # all of Q's bytes had come before the kill
                return False
            assert got2.kind == "failed", got2
            assert d.metric("kvsidecar_agent_resets_total", engine="lr-D") == 1
            # Unloading the dropped links' agents retries each second while NIXL
            # refuses (a transfer in flight): time for a retry to run.
            time.sleep(3)
        finally:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        got = D.wait_for(["r"], timeout_s=60)["r"][0]
        assert got.kind == "received", got
        assert not D.verify("r")
        # Told by D's notifications at once (P's lease would end them in 60 s)
        held = P.wait_for(["r"], timeout_s=20)
        assert sorted(held["r"]) == [0, 1], held
        assert {c.kind for c in held["r"].values()} == {"sent"}, held
        assert d.metric("kvsidecar_notifications_sent_total", engine="lr-D",
                        result="failed") == 0
        return True
    finally:
        D.close()
        P.close()
        with contextlib.suppress(Exception):  # one of its sidecars was killed
            Q.close()
        assert d.stop() == 0
        for s in ps + qs:
            s.stop()
