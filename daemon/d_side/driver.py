"""D side: the async shell that carries a group of reads through their books' states.

::

    accepted ─▶ linking (handshake + add_remote per candidate P rank, shared)
             ─▶ planning (planner + addresses, on the planning thread)
             ─▶ posted (one NIXL READ per P rank with bytes, carrying the notification;
                        a bare notification to candidates we read nothing from)
             ─▶ received | failed | aborted

A group is the reads one task carries (an :class:`~kvsidecar.daemon.d_side.job.Attempt`
each), through the same steps as a list: link, claim and plan, post and
wait. A read alone is a group of one; the read table gathers several only
for the reads of one remote engine, over links already made, that one engine
message asks for or that messages queued together on one connection ask for
(see :meth:`~kvsidecar.daemon.d_side.table.ReadTable.together`). The states
and what is decided from them (abort, retry, completion) live in
:class:`~kvsidecar.daemon.d_side.book.ReadBook`; this module executes the steps.

Each read ends alone. A group of one (``settle`` None) returns its outcome
and raises its failure, so its owner may retry it in the same task; it alone
is traced, staged, verified, cut into parts per lane, and posted during its
claim (``--post-during-claim``: over links P confirmed recently the read
posts without waiting for the claim, and its notifications follow once the
transfers ended and the claim was granted). A group of several hands each
read's outcome or failure to ``settle`` as soon as it has one (a refused
claim, a plan error or an expired lease fails that read alone), issues every
read's claims as one control batch per P rank, plans them as one job, awaits
every claim before posting, and completes each read from its own transfers'
callbacks (:func:`~kvsidecar.daemon.d_side.waiting.post_all`).

An abort before posting cancels a group of one's task at once (a read of a
larger group is dropped by its owner instead, and skipped here). After
posting the read waits for every transfer to finish before it reports
``aborted``: the engine may only reuse its blocks once nothing writes into
them any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any, NoReturn

from kvsidecar.daemon.d_side.addresses import (
    INLINE_PLAN_PIECES_ALONE,
    PostList,
    plan_and_address,
)
from kvsidecar.daemon.d_side.futures import all_or_cancel, retrieve
from kvsidecar.daemon.d_side.job import (
    Attempt,
    ReadJob,
    ReadOutcome,
    Settle,
    agents_of,
    check_tokens,
    claims_of,
    same_layout,
)
from kvsidecar.daemon.d_side.rank import ReaderRank
from kvsidecar.daemon.d_side.waiting import post_all, post_and_wait
from kvsidecar.daemon.leases import ReaderLeases
from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.peers.links import Peer
from kvsidecar.daemon.planner import ReadPlan, candidate_ranks
from kvsidecar.daemon.planner.cost import plan_cost
from kvsidecar.daemon.staging import Area
from kvsidecar.daemon.staging_plan import StagedPlan
from kvsidecar.daemon.thread_groups import ThreadGroups
from kvsidecar.ipc.layout import Layout
from kvsidecar.metrics.registry import Metrics

#: a read alone of at most this many blocks (and cheap to plan) over confirmed
#: links is posted before its claim leaves (:func:`_post_first`); a larger one
#: claims first: its READ would otherwise wait for P, which progresses the
#: transfer's closing exchanges only once it granted the claim, and the D
#: worker polls for it meanwhile (sustained 16-block reads, one per message:
#: D's worker woke 3.0-4.5 times per read posting first, 1.8-2.2 claiming first)
POST_FIRST_BLOCKS = 4

#: the context of an untraced step: one shared instance (a generator-based
#: context manager per step was two objects and a generator per read)
_NOTHING = contextlib.nullcontext()

#: what planning gives a read: its plan, a post per P rank, a staged plan per post
_Planned = tuple[ReadPlan, list[PostList], list[StagedPlan | None]]
#: a read ready to post: its plan, posts, staged plans, and its claim when still running
_Ready = tuple[Attempt, ReadPlan, list[PostList], list[StagedPlan | None],
               "asyncio.Future[None] | None"]
#: what planning is given for a read: the planner's arguments, their cost, and
#: the local blocks the read names
_Inputs = tuple[tuple[Any, ...], int, int]


async def run_group(eng: ReaderRank, jobs: Sequence[ReadJob], planner: Executor,
                    plans: ThreadGroups, timeout_s: float | None, metrics: Metrics | None,
                    handshakes: HandshakeClient, settle: Settle | None = None
                    ) -> ReadOutcome | None:
    """Carry ``jobs`` (one engine rank, one remote engine) to their ends.

    ``settle`` None: ``jobs`` is one read; its outcome is returned and its
    failure raised (the caller turns it into a completion, or retries).
    Otherwise ``settle`` is called once per read that has not ``ended``
    meanwhile, with its outcome or its exception, and None is returned once
    every posted transfer has ended (so whoever awaits this task knows nothing
    of the group still writes).

    ``plans`` (over ``planner``, the planning thread) plans the reads that reach
    planning in one loop iteration, e.g. those of a group, as one job.

    Every read holds leases on the P ranks' blocks (see
    :mod:`~kvsidecar.daemon.leases`): claimed while the planning thread works
    and awaited before posting (a refusal fails the read with nothing posted),
    renewed while transfers are pending, and checked when they end: a read
    that ends past its lease fails. Over links P granted a claim on within
    ``eng.post_during_claim_s`` a read alone posts without awaiting its claim:
    the claim round trip (0.6-1 ms here, the largest part of a small read's
    latency) then overlaps the transfer, and the notifications wait for the
    grant; a small one is posted before its claim even leaves (:func:`_post_first`).
    """
    alone = settle is None
    fail: Settle = _raise if settle is None else settle
    group = [Attempt(eng, job, planner, timeout_s, metrics, handshakes)
             for job in jobs if alone or not job.ended]  # dropped before this step
    if not group:
        return None
    linked = await _link(group, fail)
    if linked is None:
        return None
    group, layout = linked
    inputs = [_inputs(a, layout) for a in group]
    if alone:
        a, (args, cost, blocks) = group[0], inputs[0]
        if (not args[-1] and cost <= INLINE_PLAN_PIECES_ALONE and blocks <= POST_FIRST_BLOCKS
                and _confirmed(a)):
            return await _post_first(a, handshakes, args)
    ready = await _claim_and_plan(group, plans, inputs, alone, fail)
    if alone:
        return await _post_alone(*ready[0])
    if ready:
        await post_all(eng, [(a.job, plan, posts) for a, plan, posts, _, _ in ready],
                       group[0].cands, group[0].peers, timeout_s, metrics, fail)
    return None


def _raise(job: ReadJob, got: ReadOutcome | BaseException) -> NoReturn:
    """A read alone's failure: raised (its outcome is returned, never settled)."""
    assert isinstance(got, BaseException)
    raise got


def _inputs(a: Attempt, layout: Layout) -> _Inputs:
    """What planning ``a`` takes, its cost, and the local blocks it names.
    Staging: host memory on both sides only (a GPU engine posts scattered
    descriptors)."""
    eng, req = a.eng, a.job.req
    modes = ({p: eng.staging_mode for p, peer in zip(a.cands, a.peers)
              if peer.info.mem_type == "DRAM"}
             if eng.staging is not None and eng.info.mem_type == "DRAM" else {})
    args = (eng.layout, eng.tp_rank, layout, req, eng.bases,
            {p: peer.bases for p, peer in zip(a.cands, a.peers)}, modes)
    blocks = sum(len(ids) for ids in req.local_block_ids)
    return args, plan_cost(eng.layout, layout.tp_size, blocks), blocks


async def _post_alone(a: Attempt, plan: ReadPlan, posts: list[PostList],
                      staged: list[StagedPlan | None],
                      claiming: asyncio.Future[None] | None) -> ReadOutcome:
    """Post a read alone (staged, verified, cut per lane as it needs) and wait."""
    eng, job, metrics = a.eng, a.job, a.metrics
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


async def _link(group: list[Attempt], fail: Settle) -> tuple[list[Attempt], Layout] | None:
    """Link every candidate P rank for the group (links made already are held,
    not made again), check each read's tokens and that the ranks agree on the
    layout: the reads that go on and the remote layout (None: none)."""
    first = group[0]
    eng, job = first.eng, first.job
    remote = job.req.remote
    cands = candidate_ranks(eng.layout.tp_size, eng.tp_rank, remote.tp_size)
    for a in group:
        a.cands = cands
        a.job.book.link()
    tr = job.tracing
    with tr.child("kvsidecar.handshake", job.trace_id, job.span) if tr else _NOTHING:
        known = [eng.peers.cached(remote.handshake[p], remote.engine_id, remote.tp_size, p)
                 for p in cands]
        holding = group
        if None in known:
            try:
                peers: list[Peer] = await all_or_cancel(
                    [eng.peers.get(remote.handshake[p], remote.engine_id, remote.tp_size, p,
                                   user=job.links)
                     for p in cands])
            except Exception as e:
                for a in group:
                    fail(a.job, e)
                return None
            holding = group[1:]
        else:
            peers = [peer for peer in known if peer is not None]
        for a in holding:
            eng.peers.hold(peers, a.job.links)
    checked = []
    for a in group:
        a.peers = list(peers)
        a.job.peers = list(peers)
        a.job.book.linked()
        try:
            check_tokens(a.job.req, cands, peers, time.time())  # before anything is posted
        except Exception as e:
            fail(a.job, e)
        else:
            checked.append(a)
    if not checked:
        return None
    try:
        layout = same_layout(remote.engine_id, cands, peers)
    except RuntimeError as err:
        for a in checked:
            fail(a.job, err)
        return None
    return checked, layout


def _confirmed(a: Attempt) -> bool:
    """The read may post during its claim: the feature is on, its tokens are
    not replayed, and P confirmed every link within the window."""
    window = a.eng.post_during_claim_s
    return (window > 0 and not a.job.replayed
            and a.eng.peers.confirmed_within(a.peers, window, time.monotonic()))


async def _claim_and_plan(group: list[Attempt], plans: ThreadGroups, inputs: list[_Inputs],
                          alone: bool, fail: Settle) -> list[_Ready]:
    """Issue every read's claims (one control batch per P rank), then plan
    every read (one planning job): the claims' messages leave first in the
    next loop iteration, ahead of the planning thread's wake-up. The reads
    granted and planned, each with its plan, posts, staged plans and (a read
    alone posting during its claim) the claim still running; a refusal or a
    plan error fails its read alone."""
    first = group[0]
    eng, job, metrics = first.eng, first.job, first.metrics
    assert first.handshakes is not None
    tr = job.tracing if alone else None
    with tr.child("kvsidecar.planning", job.trace_id, job.span) if tr else _NOTHING:
        claimed_at = time.monotonic()
        sent = []
        for a in group:
            a.job.leases = claims_of(first.handshakes, eng, a.job.req, agents_of(a.cands, a.peers))
            sent.append(a.job.leases.send_claims())
        planning = [plans.submit(plan_and_address, *args, cost=cost) for args, cost, _ in inputs]
        for planned in planning:
            planned.add_done_callback(retrieve)
        if alone:
            return [(first, *await _claim_and_plan_alone(first, sent[0], planning[0],
                                                         claimed_at))]
        waits: list[asyncio.Future[Any]] = [f for s in sent for _, _, f in s]
        await asyncio.wait(waits + planning)
    now = time.monotonic()
    claim_series = (metrics.series(metrics.lease_claim_seconds, eng.engine_id)
                    if metrics is not None else None)
    ready: list[_Ready] = []
    for a, claims, planned in zip(group, sent, planning):
        leases = a.job.leases
        assert leases is not None
        if a.job.ended:  # aborted while claiming and planning: already completed
            for _, _, answer in claims:  # a failed claim of it is news to no one
                retrieve(answer)
            continue
        try:
            leases.settle(claims)  # a refusal fails this read with nothing posted
            if claim_series is not None:
                claim_series.observe(now - claimed_at)
            plan, posts, staged = planned.result()
            leases.check(now)  # never start on an expired lease
        except Exception as e:
            fail(a.job, e)
            continue
        ready.append((a, plan, posts, staged, None))
    if ready and eng.post_during_claim_s > 0:
        eng.peers.confirm(first.peers, now)  # P granted over these links just now
    return ready


async def _claim_and_plan_alone(a: Attempt, sent: list[Any],
                                planning: asyncio.Future[_Planned], claimed_at: float
                                ) -> tuple[ReadPlan, list[PostList], list[StagedPlan | None],
                                           asyncio.Future[None] | None]:
    """A read alone's claim and plan: the claim is awaited unless the read
    posts during it (then returned, still running)."""
    eng, leases = a.eng, a.job.leases
    assert leases is not None
    if _confirmed(a):
        return await _plan_during_claim(a, leases, sent, planning, claimed_at)
    # Claim first (a task and a link confirmation only when the feature is
    # on): a refusal fails the read with nothing posted.
    await (_claim(a, leases, sent) if eng.post_during_claim_s > 0 else leases.claim(sent))
    if a.metrics is not None:
        a.metrics.series(a.metrics.lease_claim_seconds, eng.engine_id).observe(
            time.monotonic() - claimed_at)
    return (*await planning, None)  # planned while the claim travelled


async def _plan_during_claim(a: Attempt, leases: ReaderLeases, sent: list[Any],
                             planning: asyncio.Future[_Planned], claimed_at: float
                             ) -> tuple[ReadPlan, list[PostList], list[StagedPlan | None],
                                        asyncio.Future[None] | None]:
    """Await the plan only; the claim goes on (None once it was granted already)."""
    claiming: asyncio.Future[None] | None = asyncio.ensure_future(
        _claim(a, leases, sent, claimed_at))
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
    """A small read over links P confirmed recently, all in the read task's
    first step: its claims sent (on the spot where nothing else waits to go
    to that P sidecar), then planned right here (a few blocks plan in ~40 us)
    and posted. Why this order: posted during its claim, the read completes
    once its transfer ended and its claim was granted, and the grant is what
    it waits for: P's worker answers the READ's closing flush only once the
    grant woke it. A claim left for the next loop iteration waited there
    behind the post's hand-off (the NIXL worker thread then holding the GIL)."""
    eng, job = a.eng, a.job
    tr = job.tracing
    leases = job.leases = claims_of(handshakes, eng, job.req, agents_of(a.cands, a.peers))
    claimed_at = time.monotonic()
    claiming = asyncio.ensure_future(_claim(a, leases, leases.send_claims(now=True),
                                            claimed_at))
    try:
        with tr.child("kvsidecar.planning", job.trace_id, job.span) if tr else _NOTHING:
            plan, posts, staged = plan_and_address(*args)
    except BaseException:
        claiming.add_done_callback(retrieve)  # its outcome is news to no one now
        raise
    if a.metrics is not None:
        a.metrics.series(a.metrics.posted_during_claim, eng.engine_id).inc()
    return await post_and_wait(a, plan, posts, staged, [None] * len(posts), claiming)


async def _claim(a: Attempt, leases: ReaderLeases, sent: list[Any] | None = None,
                 claimed_at: float | None = None) -> None:
    """Claim every rank (or await the claims ``sent`` issued); a grant confirms
    the links' agents were current (see
    :meth:`~kvsidecar.daemon.peers.links.PeerLinks.confirmed_within`).
    ``claimed_at``: when a read posted during its claim issued it; the round
    trip to the last grant is observed (``kvsidecar_lease_claim_seconds``)."""
    await leases.claim(sent)
    now = time.monotonic()
    a.eng.peers.confirm(a.peers, now)
    if claimed_at is not None and a.metrics is not None:
        a.metrics.series(a.metrics.lease_claim_seconds, a.eng.engine_id).observe(
            now - claimed_at)


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
            reason = (why if not ok else
                      "full" if pool.fits(sp.staging_bytes) else "too_large")
            metrics.staging_fallbacks.labels(eng.engine_id, reason).inc()
    return areas
