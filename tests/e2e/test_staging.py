"""Staged reads end to end (issue #12, descriptor economy): real sidecar processes
with ``--staging always``, real NIXL, every byte checked with the LAYOUT.md oracle;
and a staged read that fails never writes the engine's blocks."""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvsidecar.sim.cluster import SidecarProcess, SimEngine, engines, stop_once_posted
from kvsidecar.sim.models import attn, hybrid
from kvsidecar.sim.models import stall as stall_layout
from kvsidecar.sim.oracle import POISON, Request

pytestmark = pytest.mark.e2e

STAGED = ["--staging", "always", "--metrics-port", "0"]


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[list[SidecarProcess], list[SidecarProcess]]]:
    work = tmp_path_factory.mktemp("staged")
    ps = [SidecarProcess(work, f"sp{i}", args=["--hold-timeout", "60"]) for i in range(2)]
    ds = [SidecarProcess(work, f"sd{i}", args=STAGED) for i in range(2)]
    try:
        for s in ps + ds:
            s.start()
        yield ps, ds
    finally:
        codes = {s.name: s.stop() for s in ps + ds}
        assert not {k: v for k, v in codes.items() if v != 0}, codes


_ids = itertools.count()


@pytest.mark.parametrize(("family", "p_tp", "d_tp"), [
    ("hybrid", 1, 2), ("hybrid", 2, 1), ("attn-K2", 1, 2), ("attn-K2", 2, 1)])
def test_staged_hetero_reads_are_oracle_exact(staged, family: str, p_tp: int,
                                              d_tp: int) -> None:
    ps, ds = staged
    make = {"hybrid": hybrid, "attn-K2": attn(2)}[family]
    before = sum(d.metric("kvsidecar_staged_transfers_total") for d in ds[:d_tp])
    with engines(ps, ds, lambda p: f"{p}{next(_ids)}", make, p_tp, d_tp) as (P, (D,)):
        rids = D.read_exactly(P, f"st-{family}-{p_tp}{d_tp}", 7 * p_tp + 3 * d_tp)
        assert {c.kind for per in P.wait_for(rids).values() for c in per.values()} == {"sent"}
    staged_now = sum(d.metric("kvsidecar_staged_transfers_total") for d in ds[:d_tp])
    # every transfer of these reads went through staging (3 reads x P ranks per D rank)
    assert staged_now - before == 3 * d_tp * max(1, p_tp // d_tp)
    for d in ds[:d_tp]:
        assert d.metric("kvsidecar_staging_bytes_in_use") == 0


def test_auto_pool_is_mapped_at_registration_and_first_reads_stage(staged,
                                                                    tmp_path: Path) -> None:
    """``--staging auto`` maps, faults in and registers the pool when the engine rank
    registers, before any read: the first reads then stage (no 'preparing'
    fallback) and no read pays for the mapping. Mapped lazily at the first read,
    the first burst posted scattered while the mapping ate its CPU (hetero 2→1:
    494 ms with nothing staged against 314 ms with staging off)."""
    ps, _ = staged
    pool = 32 << 20
    d = SidecarProcess(tmp_path, "sauto-d", args=["--staging", "auto", "--staging-bytes",
                                                   str(pool), "--metrics-port", "0"]).start()
    try:
        with engines(ps, [d], lambda p: f"auto{p}{next(_ids)}", attn(2), 2, 1) as (P, (D,)):
            deadline = time.monotonic() + 60
            while d.metric("kvsidecar_staging_bytes_mapped", engine=D.engine_id) != pool:
                assert time.monotonic() < deadline, "staging pool never mapped"
                time.sleep(0.05)
            rids = [f"auto-first-{i}" for i in range(3)]
            for i, rid in enumerate(rids):
                D.start_read(P.prefill(rid, Request(seed=40 + i, prompt_tokens=60 + 30 * i)))
            got = D.wait_for(rids)
            for rid in rids:
                assert {c.kind for c in got[rid].values()} == {"received"}, got[rid]
                assert not D.verify(rid)
            # every transfer of the first reads staged: 3 reads x 2 P ranks
            assert d.metric("kvsidecar_staged_transfers_total", engine=D.engine_id) == 6
            assert d.metric("kvsidecar_staging_fallbacks_total", engine=D.engine_id) == 0
            engine_id = D.engine_id
        # the engine left: its pool is unmapped and its gauge gone
        assert d.metric("kvsidecar_staging_bytes_mapped", engine=engine_id) == 0
    finally:
        assert d.stop() == 0



def test_a_transfer_larger_than_the_whole_pool_falls_back_as_too_large(
        staged, tmp_path: Path) -> None:
    """A staged run that could never fit (more than --staging-bytes) posts
    scattered, exact, and is counted as ``too_large``, not as ``full`` (a busy
    pool), so an operator knows to raise the pool rather than wait it out."""
    ps, _ = staged
    d = SidecarProcess(tmp_path, "stl-d", args=["--staging", "always", "--staging-bytes",
                                                 "4096", "--metrics-port", "0"]).start()
    try:
        with engines(ps, [d], lambda p: f"tl{p}{next(_ids)}", attn(2), 2, 1) as (P, (D,)):
            D.start_read(P.prefill("too-large", Request(seed=71, prompt_tokens=64)))
            got = D.wait_for(["too-large"])["too-large"]
            assert {c.kind for c in got.values()} == {"received"}, got
            assert not D.verify("too-large")
            m = "kvsidecar_staging_fallbacks_total"
            assert d.metric(m, engine=D.engine_id, reason="too_large") == 2  # one per P rank
            assert d.metric(m, engine=D.engine_id, reason="full") == 0
    finally:
        assert d.stop() == 0


SENTINEL = 0x5A


@pytest.mark.timeout(300)
def test_failed_staged_read_never_writes_engine_blocks(tmp_path: Path) -> None:
    """With staging, a READ lands only in staging memory and the engine's blocks are
    written after it finished and the lease held. Over TCP, P's sidecar is stopped
    in the middle of a 384 MiB staged read; D reports it failed after
    --read-timeout. The engine's blocks carry a sentinel from BEFORE the read: not
    one byte of them changed, not before the failure (a scattered read would have
    landed part of its bytes) and not after P resumes. D keeps serving."""
    env = {"UCX_TLS": "tcp,self"}
    p = SidecarProcess(tmp_path, "sst-p", env=env).start()
    d = SidecarProcess(tmp_path, "sst-d", env=env,
                       args=["--read-timeout", "2", "--staging", "always",
                             "--staging-bytes", str(512 << 20), "--metrics-port", "0"]).start()
    P = SimEngine("sst-P", stall_layout, 1, 100, [p], timeout_s=60)
    D = SimEngine("sst-D", stall_layout, 1, 100, [d], timeout_s=60)
    try:
        D.start_read(P.prefill("warm", Request(seed=1, prompt_tokens=8)))
        assert D.wait_for(["warm"])["warm"][0].kind == "received"
        assert not D.verify("warm")
        D.finish("warm")
        sent = P.prefill("stuck", Request(seed=2, prompt_tokens=64 * 96), fill=False)
        assert p.proc is not None
        for buf in D.buffers[0]:  # every block of D's engine, before the read starts
            buf[:] = SENTINEL
        rec = D.start_read(sent)
        page = D.layout.page_bytes
        pages = [buf[b * page:(b + 1) * page] for buf in D.buffers[0]
                 for group in rec.block_ids for b in group]
        stop_once_posted(d, p, "sst-D", 2)  # warm + this
        try:
            got = D.wait_for(["stuck"], timeout_s=60)["stuck"][0]
            assert got.kind == "failed", got
            assert "timed out" in got.reason, got.reason
            changed = sum(int(np.count_nonzero(pg != SENTINEL)) for pg in pages)
            assert changed == 0, f"{changed} bytes of engine blocks written by a failed read"
        finally:
            os.kill(p.proc.pid, signal.SIGCONT)
        time.sleep(5)  # P's stalled sends go out now, to an agent that no longer exists
        changed = sum(int(np.count_nonzero(pg != SENTINEL)) for pg in pages)
        assert changed == 0, f"{changed} bytes landed in blocks after the failure"
        assert d.metric("kvsidecar_staged_transfers_total", engine="sst-D") == 2
        assert d.metric("kvsidecar_staging_bytes_in_use", engine="sst-D") == 0
        assert d.alive()
        D.finish("stuck")
        for buf in D.buffers[0]:  # free blocks are POISON again, as the oracle expects
            buf[:] = POISON
        # D still serves, staged, from its new agent (a fresh P: the stopped one may
        # not survive its reader's teardown; docs/failure-handling.md).
        q = SidecarProcess(tmp_path, "sst-q", env=env).start()
        Q = SimEngine("sst-Q", stall_layout, 1, 100, [q], timeout_s=60)
        try:
            D.start_read(Q.prefill("after", Request(seed=3, prompt_tokens=64 * 2)))
            assert D.wait_for(["after"])["after"][0].kind == "received"
            assert not D.verify("after")
        finally:
            Q.close()
            q.stop()
    finally:
        D.close()
        if p.alive():
            P.close()
        d.stop()
        p.stop()


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verified"])
def test_staged_read_refused_after_posting_gives_its_area_back(staged, verify: bool) -> None:
    """A staged read posted during its claim (links P confirmed just now) whose
    claim P then refuses (the hold was released before the read) fails, and its
    staging area goes back to the pool: its transfer had ended, so nothing can
    write there any more. It was quarantined instead (until an agent reset
    that never comes), 28 KiB of the pool lost per refused read."""
    ps, ds = staged
    d = ds[0]
    with engines(ps, ds, lambda p: f"refused{p}{next(_ids)}", attn(2), 1, 1) as (P, (D,)):
        eid = D.engine_id
        for i in range(3):
            D.start_read(P.prefill(f"ok-{i}", Request(seed=60 + i, prompt_tokens=30)),
                         verify=verify)
            assert D.wait_for([f"ok-{i}"])[f"ok-{i}"][0].kind == "received"
            posted = d.metric("kvsidecar_reads_posted_during_claim_total", engine=eid)
            sent = P.prefill(f"gone-{i}", Request(seed=70 + i, prompt_tokens=30))
            P.clients[0].release(P.engine_id, f"gone-{i}")  # no lease yet: ends at once
            rec = D.start_read(sent, verify=verify)
            got = D.wait_for([f"gone-{i}"])[f"gone-{i}"][0]
            assert got.kind == "failed" and "refused the lease" in got.reason, got
            assert got.invalid_block_ids == rec.block_ids
            D.finish(f"gone-{i}")
            if d.metric("kvsidecar_reads_posted_during_claim_total", engine=eid) > posted:
                break  # this one was posted before its refusal came
        else:
            pytest.fail("no refused read was posted during its claim")
        assert d.metric("kvsidecar_staging_bytes_quarantined", engine=eid) == 0
        assert d.metric("kvsidecar_staging_bytes_in_use", engine=eid) == 0
        # the pool still stages: a read after it is staged and exact
        before = d.metric("kvsidecar_staged_transfers_total", engine=eid)
        D.read_exactly(P, "after-refusal", 80, tokens=(40,))
        assert d.metric("kvsidecar_staged_transfers_total", engine=eid) == before + 1


def test_staged_read_across_a_region_boundary_is_exact(staged) -> None:
    """P's blocks are its last one and its first ones, and P's regions are views
    of one reservation a page apart (the vLLM pool's layout): pieces of
    adjacent regions lie a few KiB apart. A staged run merged them into one
    READ over two registrations, which NIXL refused (NIXL_ERR_NOT_FOUND) on
    every attempt: the read failed, retried, failed. Each run reads one region now."""
    ps, ds = staged
    with engines(ps, ds, lambda p: f"edge{p}{next(_ids)}", attn(2), 1, 1,
                 reserve=True) as (P, (D,)):
        last = P.layout.num_blocks - 1
        P.release_blocks([P.alloc(last)])  # free list now: the last block, then 0, 1, ...
        sent = P.prefill("edge", Request(seed=90, prompt_tokens=30))
        assert sent.block_ids == [[last, 0, 1, 2]]
        before = ds[0].metric("kvsidecar_staged_transfers_total", engine=D.engine_id)
        D.start_read(sent)
        got = D.wait_for(["edge"])["edge"][0]
        assert got.kind == "received", got
        assert not D.verify("edge")
        assert ds[0].metric("kvsidecar_staged_transfers_total", engine=D.engine_id) > before
