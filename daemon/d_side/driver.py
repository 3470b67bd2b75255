"""D side: the async shell that carries one read through its book's states.

::

    accepted ─▶ linking (handshake + add_remote per candidate P rank, shared)
             ─▶ planning (planner + addresses, on the planning thread)
             ─▶ posted (one NIXL READ per P rank with bytes, carrying the notification;
                        a bare notification to candidates we read nothing from)
             ─▶ received | failed | aborted

The states and what is decided from them (abort, retry, completion) live in
:class:`~kvsidecar.daemon.d_side.book.ReadBook`; this module executes the
steps: link, claim, plan, post, wait, notify. The lease claim goes out with
planning. Over links P confirmed recently (``--post-during-claim``) the read
posts without waiting for it, and its notifications follow once the
transfers ended and the claim was granted.

An abort before posting cancels the job at once. After posting the job waits
for every transfer to finish before it reports ``aborted``: the engine may
only reuse its blocks once nothing writes into them any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import Executor
from typing import Any

from kvsidecar.daemon.d_side.addresses import INLINE_PLAN_BLOCKS, PostList, plan_and_address
from kvsidecar.daemon.d_side.futures import all_or_cancel, retrieve
from kvsidecar.daemon.d_side.job import (
    Attempt,
    ReadJob,
    ReadOutcome,
    agents_of,
    check_tokens,
    claims_of,
    same_layout,
)
from kvsidecar.daemon.d_side.rank import ReaderRank
from kvsidecar.daemon.d_side.waiting import post_and_wait
from kvsidecar.daemon.leases import ReaderLeases
from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.peers.links import Peer
from kvsidecar.daemon.planner import ReadPlan, candidate_ranks
from kvsidecar.daemon.staging import Area
from kvsidecar.daemon.staging_plan import StagedPlan
from kvsidecar.daemon.thread_groups import ThreadGroups
from kvsidecar.ipc.layout import Layout
from kvsidecar.metrics.registry import Metrics

#: the context of an untraced step: one shared instance (a generator-based
#: context manager per step was two objects and a generator per read)
_NOTHING = contextlib.nullcontext()

#: what planning gives a read: its plan, a post per P rank, a staged plan per post
_Planned = tuple[ReadPlan, list[PostList], list[StagedPlan | None]]


async def run_read(eng: ReaderRank, job: ReadJob, planner: Executor, plans: ThreadGroups,
                   timeout_s: float | None = None, metrics: Metrics | None = None,
                   handshakes: HandshakeClient | None = None) -> ReadOutcome:
    """Carry one read through; raises on failure (the caller turns it into a completion).

    ``plans`` (over ``planner``, the planning thread) plans the reads that reach
    planning in one loop iteration, e.g. those of one Batch, as one job.

    With ``handshakes`` the read holds leases on the P ranks' blocks (see
    :mod:`~kvsidecar.daemon.leases`): claimed while the planning thread works
    and awaited before posting (a refusal fails the read with nothing posted),
    renewed while transfers are pending, and checked when they end: a read
    that ends past its lease fails. Over links P granted a claim on within
    ``eng.post_during_claim_s`` the read posts without awaiting its claim: the
    claim round trip (0.6-1 ms here, the largest part of a small read's latency)
    then overlaps the transfer, and the notifications wait for the grant; a
    small one is posted before its claim even leaves (:func:`_post_first`).
    """
    a = Attempt(eng, job, planner, timeout_s, metrics, handshakes)
    layout = await _link(a)
    req = job.req
    # Staging: host memory on both sides only (a GPU engine posts scattered descriptors).
    modes = ({p: eng.staging_mode for p, peer in zip(a.cands, a.peers)
              if peer.info.mem_type == "DRAM"}
             if eng.staging is not None and eng.info.mem_type == "DRAM" else {})
    args = (eng.layout, eng.tp_rank, layout, req, eng.bases,
            {p: peer.bases for p, peer in zip(a.cands, a.peers)}, modes)
    cost = sum(len(ids) for ids in req.local_block_ids)
    if handshakes is not None and not modes and cost <= INLINE_PLAN_BLOCKS and _confirmed(a):
        return await _post_first(a, handshakes, args)
    plan, posts, staged, claiming = await _claim_and_plan(a, plans, args, cost)
    if job.abort_reason is not None:
        if claiming is not None:
            claiming.add_done_callback(retrieve)
        raise asyncio.CancelledError
    if job.leases is not None and claiming is None:
        job.leases.check(time.monotonic())  # never start on an expired lease
    areas = await _take_areas(a, staged)
    if claiming is not None and metrics is not None:
        metrics.series(metrics.posted_during_claim, eng.engine_id).inc()
    try:
        return await post_and_wait(a, plan, posts, staged, areas, claiming)
    finally:
        if eng.staging is not None:
            for area in areas:
                if area is not None:
                    eng.staging.release(area)


async def _link(a: Attempt) -> Layout:
    """Link every candidate P rank (links made already are held, not made
    again), check the read's tokens and that the ranks agree on the layout."""
    eng, job = a.eng, a.job
    remote = job.req.remote
    a.cands = candidate_ranks(eng.layout.tp_size, eng.tp_rank, remote.tp_size)
    job.book.link()
    tr = job.tracing
    with tr.child("kvsidecar.handshake", job.trace_id, job.span) if tr else _NOTHING:
        known = [eng.peers.cached(remote.handshake[p], remote.engine_id, remote.tp_size, p)
                 for p in a.cands]
        if None in known:
            peers: list[Peer] = await all_or_cancel(
                [eng.peers.get(remote.handshake[p], remote.engine_id, remote.tp_size, p,
                               user=job.links)
                 for p in a.cands])
        else:
            peers = [peer for peer in known if peer is not None]
            eng.peers.hold(peers, job.links)
    a.peers = job.peers = peers
    job.book.linked()
    check_tokens(job.req, a.cands, peers, time.time())
    return same_layout(remote.engine_id, a.cands, peers)


def _confirmed(a: Attempt) -> bool:
    """The read may post during its claim: the feature is on, its tokens are
    not replayed, and P confirmed every link within the window."""
    window = a.eng.post_during_claim_s
    return (window > 0 and not a.job.replayed
            and a.eng.peers.confirmed_within(a.peers, window, time.monotonic()))


async def _claim_and_plan(a: Attempt, plans: ThreadGroups, args: tuple[Any, ...], cost: int
                          ) -> tuple[ReadPlan, list[PostList], list[StagedPlan | None],
                                     asyncio.Future[None] | None]:
    """Claim (when the read holds leases) and plan at once; the claim is
    awaited unless the read posts during it (then returned, still running)."""
    eng, job = a.eng, a.job
    tr = job.tracing
    with tr.child("kvsidecar.planning", job.trace_id, job.span) if tr else _NOTHING:
        if a.handshakes is None:
            planning = plans.submit(plan_and_address, *args, cost=cost)
            planning.add_done_callback(retrieve)
            return (*await planning, None)
        leases = job.leases = claims_of(a.handshakes, eng, job.req, agents_of(a.cands, a.peers))
        # Issued before the planning job: the claim's message leaves first in
        # the next loop iteration, ahead of the planning thread's wake-up.
        claimed_at = time.monotonic()
        sent = leases.send_claims()
        planning = plans.submit(plan_and_address, *args, cost=cost)
        planning.add_done_callback(retrieve)
        if _confirmed(a):
            return await _plan_during_claim(a, leases, sent, planning)
        # Claim first (a task and a link confirmation only when the feature is
        # on): a refusal fails the read with nothing posted.
        await (_claim(a, leases, sent) if eng.post_during_claim_s > 0 else leases.claim(sent))
        if a.metrics is not None:
            a.metrics.series(a.metrics.lease_claim_seconds, eng.engine_id).observe(
                time.monotonic() - claimed_at)
        return (*await planning, None)  # planned while the claim travelled


async def _plan_during_claim(a: Attempt, leases: ReaderLeases, sent: list[Any],
                             planning: asyncio.Future[_Planned]
                             ) -> tuple[ReadPlan, list[PostList], list[StagedPlan | None],
                                        asyncio.Future[None] | None]:
    """Await the plan only; the claim goes on (None once it was granted already)."""
    claiming: asyncio.Future[None] | None = asyncio.ensure_future(_claim(a, leases, sent))
    assert claiming is not None
    try:
        plan, posts, staged = await planning
    except BaseException:
        claiming.add_done_callback(retrieve)  # its refusal is news to no one now
        raise
    if claiming.done():
        claiming.result()  # a refusal fails the read with nothing posted
        claiming = None
    return plan, posts, staged, claiming


async def _post_first(a: Attempt, handshakes: HandshakeClient,
                      args: tuple[Any, ...]) -> ReadOutcome:
    """A small read over links P confirmed recently: planned right here (a few
    blocks plan in ~40 us), posted, and only then its claim sent, all in the
    read task's first step. Why this order: posted during its claim, the read
    completes when both its transfer ended and its claim was granted, and on a
    loaded host each loop iteration between acceptance and post cost hundreds
    of microseconds (the claim's ZMQ send wakes ZMQ's I/O thread and P, which
    compete for the two cores with the loop); the claim leaves one callback
    after the post's hand-off instead of before the planning job."""
    eng, job = a.eng, a.job
    tr = job.tracing
    leases = job.leases = claims_of(handshakes, eng, job.req, agents_of(a.cands, a.peers))
    with tr.child("kvsidecar.planning", job.trace_id, job.span) if tr else _NOTHING:
        plan, posts, staged = plan_and_address(*args)
    # Its first step (issuing the claims) runs next iteration, ahead of the
    # post's hand-off to the worker; the claims' send is queued behind both.
    claiming = asyncio.ensure_future(_claim(a, leases))
    if a.metrics is not None:
        a.metrics.series(a.metrics.posted_during_claim, eng.engine_id).inc()
    return await post_and_wait(a, plan, posts, staged, [None] * len(posts), claiming)


async def _claim(a: Attempt, leases: ReaderLeases, sent: list[Any] | None = None) -> None:
    """Claim every rank (or await the claims ``sent`` issued); a grant confirms
    the links' agents were current (see
    :meth:`~kvsidecar.daemon.peers.links.PeerLinks.confirmed_within`)."""
    await leases.claim(sent)
    a.eng.peers.confirm(a.peers, time.monotonic())


async def _take_areas(a: Attempt, staged: list[StagedPlan | None]) -> list[Area | None]:
    """A staging area per staged post; a post that finds none goes scattered (counted)."""
    eng, metrics = a.eng, a.metrics
    pool = eng.staging
    areas: list[Area | None] = [None] * len(staged)
    if pool is None or not any(staged):
        return areas
    if eng.staging_mode == "always":
        ok = await pool.ensure()
        why = "unavailable"
    else:  # auto: never make a read wait for the pool (mapping 256 MiB takes ~1 s)
        pool.prepare()
        ok = pool.ready
        why = "unavailable" if pool.failed else "preparing"
    for i, sp in enumerate(staged):
        if sp is None:
            continue
        areas[i] = pool.acquire(sp.staging_bytes) if ok else None
        if areas[i] is None and metrics is not None:
            metrics.staging_fallbacks.labels(eng.engine_id, "full" if ok else why).inc()
    return areas
