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
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

from kvsidecar.daemon import digest, verify
from kvsidecar.daemon.d_side.addresses import INLINE_PLAN_BLOCKS, PostList, plan_and_address
from kvsidecar.daemon.d_side.futures import all_or_cancel, in_executor, outcomes, retrieve
from kvsidecar.daemon.d_side.job import (
    ReadJob,
    ReadOutcome,
    agents_of,
    check_tokens,
    claims_of,
    same_layout,
)
from kvsidecar.daemon.d_side.parts import joined, lane_of, pipeline, split_post
from kvsidecar.daemon.d_side.posting import (
    check_results,
    notify_after_grant,
    notify_ended,
    outcome_of,
    post_read,
)
from kvsidecar.daemon.engines import EngineRank
from kvsidecar.daemon.leases import ReaderLeases, Renewals
from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.peers.control import Digest
from kvsidecar.daemon.peers.links import Peer
from kvsidecar.daemon.planner import ReadPlan, candidate_ranks
from kvsidecar.daemon.staging import Area, scatter
from kvsidecar.daemon.staging_plan import StagedPlan
from kvsidecar.daemon.thread_groups import ThreadGroups
from kvsidecar.metrics.registry import Metrics

T = TypeVar("T")

#: the context of an untraced step: one shared instance (a generator-based
#: context manager per step was two objects and a generator per read)
_NOTHING = contextlib.nullcontext()


async def run_read(eng: EngineRank, job: ReadJob, planner: Executor, plans: ThreadGroups,
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
    req = job.req
    remote = req.remote
    cands = candidate_ranks(eng.layout.tp_size, eng.tp_rank, remote.tp_size)
    job.book.link()
    tr = job.tracing
    with tr.child("kvsidecar.handshake", job.trace_id, job.span) if tr else _NOTHING:
        known = [eng.peers.cached(remote.handshake[p], remote.engine_id, remote.tp_size, p)
                 for p in cands]
        if None in known:
            peers: list[Peer] = await all_or_cancel(
                [eng.peers.get(remote.handshake[p], remote.engine_id, remote.tp_size, p,
                               user=job.links)
                 for p in cands])
        else:
            peers = [peer for peer in known if peer is not None]
            eng.peers.hold(peers, job.links)
    job.peers = peers
    job.book.linked()
    check_tokens(req, cands, peers, time.time())
    layout = same_layout(remote.engine_id, cands, peers)
    # Staging: host memory on both sides only (a GPU engine posts scattered descriptors).
    modes = ({p: eng.staging_mode for p, peer in zip(cands, peers)
              if peer.info.mem_type == "DRAM"}
             if eng.staging is not None and eng.info.mem_type == "DRAM" else {})
    args = (eng.layout, eng.tp_rank, layout, req, eng.bases,
            {p: peer.bases for p, peer in zip(cands, peers)}, modes)
    cost = sum(len(ids) for ids in req.local_block_ids)
    if (handshakes is not None and not modes and cost <= INLINE_PLAN_BLOCKS
            and eng.post_during_claim_s > 0 and not job.replayed
            and eng.peers.confirmed_within(peers, eng.post_during_claim_s, time.monotonic())):
        return await _post_first(eng, job, planner, timeout_s, metrics, handshakes, cands, peers,
                                 args)
    with tr.child("kvsidecar.planning", job.trace_id, job.span) if tr else _NOTHING:
        leases = None
        claiming: asyncio.Future[None] | None = None
        sent = None
        claimed_at = 0.0
        if handshakes is not None:
            leases = job.leases = claims_of(handshakes, eng, req, agents_of(cands, peers))
            # Issued before the planning job: the claim's message leaves first in
            # the next loop iteration, ahead of the planning thread's wake-up.
            claimed_at = time.monotonic()
            sent = leases.send_claims()
        planning = plans.submit(plan_and_address, *args, cost=cost)
        planning.add_done_callback(retrieve)
        if leases is not None:
            window = eng.post_during_claim_s
            if (window > 0 and not job.replayed
                    and eng.peers.confirmed_within(peers, window, time.monotonic())):
                claiming = asyncio.ensure_future(_claim(eng, leases, peers, sent))
                try:
                    plan, posts, staged = await planning
                except BaseException:
                    claiming.add_done_callback(retrieve)  # its refusal is news to no one now
                    raise
                if claiming.done():
                    claiming.result()  # a refusal fails the read with nothing posted
                    claiming = None
            else:
                # Claim first (a task and a link confirmation only when the
                # feature is on): a refusal fails the read with nothing posted.
                await (_claim(eng, leases, peers, sent) if window > 0 else leases.claim(sent))
                if metrics is not None:
                    metrics.series(metrics.lease_claim_seconds, eng.engine_id).observe(
                        time.monotonic() - claimed_at)
                plan, posts, staged = await planning  # planned while the claim travelled
        else:
            plan, posts, staged = await planning
    if job.abort_reason is not None:
        if claiming is not None:
            claiming.add_done_callback(retrieve)
        raise asyncio.CancelledError
    if leases is not None and claiming is None:
        leases.check(time.monotonic())  # never start on an expired lease
    areas = await _take_areas(eng, staged, metrics)
    if claiming is not None and metrics is not None:
        metrics.series(metrics.posted_during_claim, eng.engine_id).inc()
    try:
        return await _post_and_wait(eng, job, planner, timeout_s, metrics, cands, peers, plan,
                                    posts, staged, areas, claiming)
    finally:
        if eng.staging is not None:
            for area in areas:
                if area is not None:
                    eng.staging.release(area)


async def _post_first(eng: EngineRank, job: ReadJob, planner: Executor,
                      timeout_s: float | None, metrics: Metrics | None,
                      handshakes: HandshakeClient, cands: Sequence[int], peers: list[Peer],
                      args: tuple[Any, ...]) -> ReadOutcome:
    """A small read over links P confirmed recently: planned right here (a few
    blocks plan in ~40 us), posted, and only then its claim sent, all in the
    read task's first step. Why this order: posted during its claim, the read
    completes when both its transfer ended and its claim was granted, and on a
    loaded host each loop iteration between acceptance and post cost hundreds
    of microseconds (the claim's ZMQ send wakes ZMQ's I/O thread and P, which
    compete for the two cores with the loop); the claim leaves one callback
    after the post's hand-off instead of before the planning job."""
    req = job.req
    tr = job.tracing
    leases = job.leases = claims_of(handshakes, eng, req, agents_of(cands, peers))
    with tr.child("kvsidecar.planning", job.trace_id, job.span) if tr else _NOTHING:
        plan, posts, staged = plan_and_address(*args)
    # Its first step (issuing the claims) runs next iteration, ahead of the
    # post's hand-off to the worker; the claims' send is queued behind both.
    claiming = asyncio.ensure_future(_claim(eng, leases, peers))
    if metrics is not None:
        metrics.series(metrics.posted_during_claim, eng.engine_id).inc()
    return await _post_and_wait(eng, job, planner, timeout_s, metrics, cands, peers, plan,
                                posts, staged, [None] * len(posts), claiming)


async def _claim(eng: EngineRank, leases: ReaderLeases, peers: list[Peer],
                 sent: list[Any] | None = None) -> None:
    """Claim every rank (or await the claims ``sent`` issued); a grant confirms
    the links' agents were current (see
    :meth:`~kvsidecar.daemon.peers.links.PeerLinks.confirmed_within`)."""
    await leases.claim(sent)
    eng.peers.confirm(peers, time.monotonic())


async def _take_areas(eng: EngineRank, staged: list[StagedPlan | None],
                      metrics: Metrics | None) -> list[Area | None]:
    """A staging area per staged post; a post that finds none goes scattered (counted)."""
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


async def _post_and_wait(eng: EngineRank, job: ReadJob, planner: Executor,
                         timeout_s: float | None, metrics: Metrics | None,
                         cands: Sequence[int],
                         peers: list[Peer], plan: ReadPlan, posts: list[PostList],
                         staged: list[StagedPlan | None], areas: list[Area | None],
                         claiming: asyncio.Future[None] | None = None) -> ReadOutcome:
    """Post every P rank's transfer, wait for all, scatter what was staged.

    ``claiming``: the lease claim, when the read is posted before P answered it
    (links P confirmed recently, ``--post-during-claim``). The transfers then
    carry no notification: P must not count the read done before it granted
    the lease, or the late claim would find the hold ended and be refused. The
    notifications go once every transfer ended and the claim was granted; a
    refusal fails the read (its bytes landed but nothing vouched for them).
    Over a stale link (a P rank that re-registered or restarted within the
    window) the READ fails like any failed transfer (agent reset) or reads
    memory that is no longer the hold's; the claim's refusal then says so and
    the read is retried whole over fresh links (nothing was notified, see
    :func:`_notify_after_grant`). The recency condition bounds how often that
    costs an agent reset.

    Staging areas (``areas[i]`` for ``posts[i]``) are released by the caller
    when this returns or raises with every transfer's outcome known: DONE, or
    failed (the worker reports a failure only once the agent carrying it was
    destroyed). If this task is cancelled while transfers are in flight, their
    areas are quarantined until the generation of the lane that carried each
    moves on instead.

    Lanes (``--post-lanes``): a read with bytes from several P ranks posts them
    on several lanes (:func:`lane_of`), which P does not accept notifications
    from (the handshake declares lane 0's agent alone). Such a read carries no
    notification either, as if posted during its claim: lane 0 notifies every
    P rank once all of its transfers ended DONE (:func:`_notify_after_grant`).
    So a failure of one rank has notified none: the read fails (or is retried)
    whole, never as a :class:`PartialReadError`; and a failed transfer is
    reported only once the lane that carried it was reset, as on one lane.
    A read whose bytes come from one P rank is cut into a part per lane when
    large enough (:func:`split_post`, never a staged one), posted the same way;
    its parts' outcomes join back into the post's (:func:`joined`).
    """
    leases = job.leases
    lanes = lane_of(len(eng.lanes), posts)
    split = (split_post(len(eng.lanes), posts)
             if lanes is None and not any(a is not None for a in areas) else None)
    verifying = job.verify is not None
    notify = claiming is None and lanes is None and split is None and not verifying
    pipe = (pipeline(posts, plan, job.verify.chunk_bytes)
            if job.verify is not None and lanes is None and split is None
            and not any(a is not None for a in areas) else None)
    if pipe is not None:
        split = pipe[0], pipe[1]
    if split is None:
        ops, note, agents, merge = post_read(eng, job, timeout_s, metrics, cands, peers, posts,
                                             staged, areas, notify=notify, lanes=lanes)
    else:
        parts = split[0]
        none = [None] * len(parts)
        ops, note, agents, merge = post_read(eng, job, timeout_s, metrics, cands, peers, parts,
                                             none, none, notify=False,
                                             lanes=lane_of(len(eng.lanes), parts))
    # Verified: P hashes its pieces while the bytes travel (its hold pins them
    # until this read notifies, which it does only after comparing).
    asked = _ask_digests(eng, job, cands, peers, plan) if verifying else None
    landed = None
    if pipe is not None:
        assert job.verify is not None
        landed = verify.landing(job.verify, eng.engine_id, job.req.request_id,
                                digest.digester_for(eng.info.mem_type),
                                [r.numpy() for r in eng.regions],
                                [ops[i] for i in pipe[2]], pipe[3])
    # Renewals end at the read's own deadline (its transfers time out there):
    # whatever happens to a transfer, P's hold ends one lease later at most.
    # They start once the claim was granted (a renewal before it would find no
    # bound to extend).
    until = job.book.renew_until
    renewing: Renewals | None = None

    def renew(claim: asyncio.Future[None] | None = None) -> None:
        nonlocal renewing
        if leases is not None and (claim is None or (not claim.cancelled()
                                                      and claim.exception() is None)):
            renewing = leases.renew_later(until)

    if claiming is None:
        renew()
    else:
        claiming.add_done_callback(renew)
    generations = [w.generation for w in eng.lanes]
    try:
        results: list[Any] = await outcomes(ops)
        if split is not None:
            results = joined(results, split[1], len(posts))
        if asked is not None:
            if claiming is not None:
                await claiming  # notified once verified, below
        elif not notify:
            results = await notify_after_grant(eng, job, claiming, posts, agents, note, merge,
                                                results, metrics)
    except BaseException:
        # Cancelled with transfers maybe in flight: their areas stay out of use
        # until a reset of the lane carrying each has provably killed them.
        if eng.staging is not None:
            for i, area in enumerate(areas):
                if area is not None:
                    lane = 0 if lanes is None else lanes[i]
                    eng.staging.quarantine(area, generations[lane], lane)
                    areas[i] = None
        raise
    finally:
        if claiming is not None:
            claiming.remove_done_callback(renew)
            claiming.add_done_callback(retrieve)
        if renewing is not None:
            renewing.cancel()
    check_results(eng, job, metrics, posts, results, notified=notify)
    if job.abort_reason is None and any(a is not None for a in areas):
        # Only now, every transfer DONE and the lease valid, do engine blocks get
        # the staged bytes. Off the loop; never abandoned half way (the engine
        # must not get a completion while its blocks are still being written).
        t_scatter = time.perf_counter()
        scattering = in_executor(planner, _scatter_all, eng, staged, areas)
        try:
            await asyncio.shield(scattering)
        except asyncio.CancelledError:
            await asyncio.wait([scattering])
            raise
        if metrics is not None:
            metrics.series(metrics.scatter_seconds, eng.engine_id).observe(
                time.perf_counter() - t_scatter)
    if asked is not None and job.abort_reason is None:
        await _verified(eng, job, asked, metrics, landed)
        notify_ended(eng, job, posts, agents, note, merge, results, metrics)
    return outcome_of(plan, posts, results)


def _ask_digests(eng: EngineRank, job: ReadJob, cands: Sequence[int], peers: list[Peer],
                 plan: ReadPlan) -> list[verify.Asked]:
    """Ask each P rank this read takes bytes from for the digest of its pieces."""
    assert job.verify is not None
    req = job.req
    r = req.remote
    rid = req.remote_request_id or req.request_id
    agents = {p: peer.info.agent_name for p, peer in zip(cands, peers)}

    def request(rank: int, ranges: bytes, chunk_bytes: int) -> Digest:
        return Digest(engine_id=r.engine_id, tp_rank=rank, agent_name=agents[rank],
                      request_id=rid, reader_engine=eng.engine_id, reader_rank=eng.tp_rank,
                      reader_tp=eng.layout.tp_size, ranges=ranges, chunk_bytes=chunk_bytes,
                      token=req.remote_tokens[rank] if rank < len(req.remote_tokens) else "")

    return verify.ask(job.verify, plan, {p: r.handshake[p] for p in cands}, request)


async def _verified(eng: EngineRank, job: ReadJob, asked: list[verify.Asked],
                    metrics: Metrics | None,
                    landed: asyncio.Future[bytes] | None = None) -> None:
    """Hash what landed and compare with P's digests (counted); raises
    :class:`~kvsidecar.daemon.verify.VerifyFailed` when they differ or P gave none."""
    assert job.verify is not None
    views = [r.numpy() for r in eng.regions]
    try:
        nbytes = await verify.check(job.verify, eng.engine_id, job.req.request_id,
                                    digest.digester_for(eng.info.mem_type), views, asked,
                                    landed)
    except verify.VerifyFailed as e:
        if metrics is not None:
            metrics.verify_failures.labels(eng.engine_id, e.reason).inc()
        raise
    if metrics is not None:
        metrics.verified_bytes.labels(eng.engine_id).inc(nbytes)



def _scatter_all(eng: EngineRank, staged: list[StagedPlan | None],
                 areas: list[Area | None]) -> None:
    """Copy every staged piece into the engine's blocks (planning thread)."""
    pool = eng.staging
    assert pool is not None
    views = [r.numpy() for r in eng.regions]
    for sp, area in zip(staged, areas):
        if sp is not None and area is not None:
            scatter(pool.view(area), sp.src, sp.dst, sp.size, eng.bases, views)
