"""D side: one accepted read request, from handshake to completion.

::

    accepted ─▶ linking (handshake + add_remote per candidate P rank, shared)
             ─▶ planning (planner + addresses, on the planning thread)
             ─▶ posted (one NIXL READ per P rank with bytes, carrying the notification;
                        a bare notification to candidates we read nothing from)

The lease claim goes out with planning. Over links P confirmed recently
(``--post-during-claim``) the read posts without waiting for it, and its
notifications follow once the transfers ended and the claim was granted.
             ─▶ received | failed | aborted

An abort before posting cancels the job at once. After posting the job waits
for every transfer to finish before it reports ``aborted``: the engine may
only reuse its blocks once nothing writes into them any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import math
import time
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from kvsidecar.daemon import digest, notifications, verify
from kvsidecar.daemon.engines import EngineRank
from kvsidecar.daemon.leases import LeaseLost, LeaseRefused, ReaderLeases, Renewals
from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.peers.control import Claim, Digest
from kvsidecar.daemon.peers.links import Peer
from kvsidecar.daemon.planner import (
    Addresses,
    PlanError,
    ReadPlan,
    candidate_ranks,
    check_block_ids,
    plan_many,
    plan_many_addressed,
    plan_read,
)
from kvsidecar.daemon.spent_tokens import SpentTokens
from kvsidecar.daemon.staging import Area, scatter
from kvsidecar.daemon.staging_plan import StagedPlan, plan_staging
from kvsidecar.daemon.thread_groups import ThreadGroups
from kvsidecar.daemon.tracing import Tracing
from kvsidecar.daemon.transport.worker import (
    NixlAgentReset,
    NixlError,
    NixlKilledByReset,
    NixlTimeout,
    NotifyOp,
    ReadOp,
    TransferStats,
)
from kvsidecar.ipc import hold_token
from kvsidecar.ipc.layout import Layout
from kvsidecar.ipc.protocol import (
    BAD_REQUEST,
    DUPLICATE,
    UNAVAILABLE,
    Completion,
    Read,
    RequestError,
    TransferReport,
)
from kvsidecar.metrics.registry import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")

I64 = NDArray[np.int64]


class PartialReadError(RuntimeError):
    """Some P ranks were read and notified, others failed: never retried."""


@dataclass
class ReadJob:
    req: Read
    accepted_at: float = field(default_factory=time.monotonic)
    posted: bool = False
    abort_reason: str | None = None
    #: its notifications went out: with its DONE transfers, or after its claim was
    #: granted (posted during the claim); P ends the holds ``sent``, so a
    #: failure (lease ran out) or abort after that abandons nothing
    notified: bool = False
    peers: list[Peer] = field(default_factory=list)
    #: links this read holds (PeerLinks.get(user=...)); released when it ends
    links: list[Peer] = field(default_factory=list)
    leases: ReaderLeases | None = None
    task: asyncio.Task[None] | None = None
    #: the request's kvsidecar.read span and its tracer (None when tracing is off)
    span: Any = None
    tracing: Tracing | None = None
    #: its completion is out (set by ReadTable._finish)
    ended: bool = False
    #: how to abort it before posting when it shares its task with other reads
    #: (a batch, see read_batch): cancelling the task would abort them all
    on_abort: Callable[[ReadJob], None] | None = None
    #: set when its bytes are verified (``--verify-bytes`` or ``Read.verify``)
    verify: verify.Verifier | None = None
    #: its hold tokens were presented by an earlier read on this sidecar: it is
    #: never posted during its claim (see spent_tokens.py)
    replayed: bool = False

    @property
    def trace_id(self) -> str:
        """The id both P and D know (the prefill request id): it names the trace."""
        return self.req.remote_request_id or self.req.request_id

    def abort(self, reason: str) -> None:
        """Abort now if nothing is posted yet; else report ``aborted`` once transfers end."""
        if self.abort_reason is None:
            self.abort_reason = reason
        if self.posted or self.ended:
            return
        if self.on_abort is not None:
            self.on_abort(self)
        elif self.task is not None:
            self.task.cancel()


@dataclass(frozen=True)
class PostList:
    """Absolute addresses for one P rank; empty arrays mean notify only."""

    rank: int
    local: I64
    remote: I64
    length: I64
    descriptors_before: int = 0
    #: the bytes the plan reads from this rank (``length``'s sum, taken on the
    #: planning thread: a numpy reduction on the loop per read cost ~1.6 us)
    nbytes: int = 0


@dataclass(frozen=True)
class ReadOutcome:
    nbytes: int
    descriptors: int
    descriptors_before: int
    stats: list[TransferStats]
    #: one per remote rank that bytes were read from (what the completion reports)
    transfers: list[TransferReport] = field(default_factory=list)


def posts_of(plan: ReadPlan, addrs: Addresses) -> list[PostList]:
    """:func:`build_posts` of a plan whose addresses the planner added
    (:func:`~kvsidecar.daemon.planner.plan_many_addressed`)."""
    by_rank = {r.remote_rank: r for r in plan.reads}
    out = []
    for p in plan.notify:
        rr = by_rank.get(p)
        if rr is None:
            out.append(PostList(p, _EMPTY, _EMPTY, _EMPTY))
        else:
            local, remote = addrs[p]
            out.append(PostList(p, local, remote, rr.length, rr.descriptors_before_coalescing,
                                rr.nbytes))
    return out


_EMPTY = np.empty(0, np.int64)
_EMPTY.setflags(write=False)


def build_posts(plan: ReadPlan, local_bases: I64, remote_bases: dict[int, I64]) -> list[PostList]:
    """Turn region-relative plan offsets into addresses (vectorised; planning thread)."""
    return posts_of(plan, {rr.remote_rank: (local_bases[rr.region] + rr.local_offset,
                                            remote_bases[rr.remote_rank][rr.region]
                                            + rr.remote_offset)
                           for rr in plan.reads})


def _plan_and_address(local: Layout, rank: int, remote: Layout, req: Read,
                      local_bases: I64, remote_bases: dict[int, I64],
                      staging: dict[int, str] | None = None,
                      ) -> tuple[ReadPlan, list[PostList], list[StagedPlan | None]]:
    """Plan, addresses, and per P rank the staged plan (``staging``: mode per rank)."""
    plan = plan_read(local, rank, remote, req.local_block_ids, req.remote_block_ids,
                     skip_tokens=req.skip_tokens, num_tokens=req.num_tokens, check=False)
    return _address(plan, local_bases, remote_bases, staging)


def _address(plan: ReadPlan, local_bases: I64, remote_bases: dict[int, I64],
             staging: dict[int, str] | None,
             ) -> tuple[ReadPlan, list[PostList], list[StagedPlan | None]]:
    posts = build_posts(plan, local_bases, remote_bases)
    modes = staging or {}
    return plan, posts, [plan_staging(p.local, p.remote, p.length, mode=modes[p.rank])
                         if p.length.size and modes.get(p.rank, "off") != "off" else None
                         for p in posts]


def _plan_and_address_many(calls: list[tuple[Any, ...]]) -> list[tuple[bool, Any]]:
    """:func:`_plan_and_address` for the reads of one planning job (a Batch), each
    call's outcome in its place: the reads between the same two layouts are
    planned together (:func:`~kvsidecar.daemon.planner.plan_many`); those with
    nothing staged over the very same base arrays get their addresses added by
    the planner in one pass (:func:`~kvsidecar.daemon.planner.plan_many_addressed`)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, (local, rank, remote, _, local_bases, remote_bases, *staging) in enumerate(calls):
        staged = bool(staging and staging[0])
        key = (id(local), rank, id(remote), staged, id(local_bases),
               *((p, id(b)) for p, b in remote_bases.items()))
        groups.setdefault(key, []).append(i)
    out: list[tuple[bool, Any]] = [(False, None)] * len(calls)
    for key, idx in groups.items():
        local, rank, remote, _, local_bases, remote_bases, *_ = calls[idx[0]]
        many = [(r.local_block_ids, r.remote_block_ids, r.skip_tokens, r.num_tokens)
                for r in (calls[i][3] for i in idx)]
        if not key[3]:
            try:
                addressed = plan_many_addressed(local, rank, remote, many, local_bases,
                                                remote_bases)
            except Exception:  # planned one by one below: a failure stays its read's own
                log.exception("planning %d reads with their addresses failed", len(idx))
            else:
                for i, got in zip(idx, addressed):
                    if isinstance(got, PlanError):
                        out[i] = (False, got)
                    else:
                        posts = posts_of(*got)
                        out[i] = (True, (got[0], posts, [None] * len(posts)))
                continue
        plans = plan_many(local, rank, remote, many)
        for i, plan in zip(idx, plans):
            if isinstance(plan, PlanError):
                out[i] = (False, plan)
                continue
            _, _, _, _, local_bases, remote_bases, *staging = calls[i]
            try:
                out[i] = (True, _address(plan, local_bases, remote_bases,
                                         staging[0] if staging else None))
            except Exception as e:
                out[i] = (False, e)
    return out


def claims_of(handshakes: HandshakeClient, eng: EngineRank, req: Read,
              ranks: Iterable[tuple[int, str]]) -> ReaderLeases:
    """The leases ``req`` claims from P: one claim per ``(P rank, its agent
    name)`` (an empty name where no link is known; P then skips the agent
    check), on the hold under the request id P knows it by."""
    r = req.remote
    rid = req.remote_request_id or req.request_id
    return ReaderLeases(handshakes, [
        (r.handshake[p], Claim(
            engine_id=r.engine_id, tp_rank=p, agent_name=agent, request_id=rid,
            reader_engine=eng.engine_id, reader_rank=eng.tp_rank,
            reader_tp=eng.layout.tp_size,
            token=req.remote_tokens[p] if p < len(req.remote_tokens) else ""))
        for p, agent in ranks])


def check_tokens(req: Read, cands: Sequence[int], peers: Sequence[Peer], now: float) -> None:
    """Before anything is posted: each P rank read from issued the read's token
    for this request and exactly the blocks it names (checked with the rank's
    checking key from its handshake; see :mod:`~kvsidecar.ipc.hold_token`).
    Raises :class:`~kvsidecar.ipc.hold_token.TokenError` naming the rank."""
    rid = req.remote_request_id or req.request_id
    for p, peer in zip(cands, peers):
        if not peer.info.hold_key:
            raise hold_token.TokenError(f"remote rank {p}'s sidecar issues no hold tokens "
                                        "(an older kvsidecar): upgrade it")
        try:
            hold_token.check_for_reader(peer.info.hold_key, req.remote.engine_id, rid,
                                        req.remote_block_ids, req.remote_tokens[p], now)
        except hold_token.TokenError as e:
            raise hold_token.TokenError(f"remote rank {p}: {e}") from None


def agents_of(cands: Sequence[int], peers: list[Peer]) -> Iterator[tuple[int, str]]:
    """Each candidate P rank with the agent name of its link."""
    return ((p, peer.info.agent_name) for p, peer in zip(cands, peers))


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
    tr = job.tracing
    with tr.child("kvsidecar.handshake", job.trace_id, job.span) if tr else _NOTHING:
        known = [eng.peers.cached(remote.handshake[p], remote.engine_id, remote.tp_size, p)
                 for p in cands]
        if None in known:
            peers: list[Peer] = await _all_or_cancel(
                [eng.peers.get(remote.handshake[p], remote.engine_id, remote.tp_size, p,
                               user=job.links)
                 for p in cands])
        else:
            peers = [peer for peer in known if peer is not None]
            eng.peers.hold(peers, job.links)
    job.peers = peers
    check_tokens(req, cands, peers, time.time())
    layout = peers[0].info.layout
    for p, peer in zip(cands[1:], peers[1:]):
        if peer.info.layout != layout:
            raise RuntimeError(
                f"remote engine {remote.engine_id!r} ranks {cands[0]} and {p} report different "
                "layouts (cache sizes differ between ranks)"
            )
    # Staging: host memory on both sides only (a GPU engine posts scattered descriptors).
    modes = ({p: eng.staging_mode for p, peer in zip(cands, peers)
              if peer.info.mem_type == "DRAM"}
             if eng.staging is not None and eng.info.mem_type == "DRAM" else {})
    args = (eng.layout, eng.tp_rank, layout, req, eng.bases,
            {p: peer.bases for p, peer in zip(cands, peers)}, modes)
    cost = sum(len(ids) for ids in req.local_block_ids)
    if (handshakes is not None and not modes and cost <= _INLINE_PLAN_BLOCKS
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
        planning = plans.submit(_plan_and_address, *args, cost=cost)
        planning.add_done_callback(_retrieve)
        if leases is not None:
            window = eng.post_during_claim_s
            if (window > 0 and not job.replayed
                    and eng.peers.confirmed_within(peers, window, time.monotonic())):
                claiming = asyncio.ensure_future(_claim(eng, leases, peers, sent))
                try:
                    plan, posts, staged = await planning
                except BaseException:
                    claiming.add_done_callback(_retrieve)  # its refusal is news to no one now
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
            claiming.add_done_callback(_retrieve)
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
        plan, posts, staged = _plan_and_address(*args)
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
    until = math.inf if timeout_s is None else time.monotonic() + timeout_s
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
        results: list[Any] = await _outcomes(ops)
        if split is not None:
            results = joined(results, split[1], len(posts))
        if asked is not None:
            if claiming is not None:
                await claiming  # notified once verified, below
        elif not notify:
            results = await _notify_after_grant(eng, job, claiming, posts, agents, note, merge,
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
            claiming.add_done_callback(_retrieve)
        if renewing is not None:
            renewing.cancel()
    check_results(eng, job, metrics, posts, results, notified=notify)
    if job.abort_reason is None and any(a is not None for a in areas):
        # Only now, every transfer DONE and the lease valid, do engine blocks get
        # the staged bytes. Off the loop; never abandoned half way (the engine
        # must not get a completion while its blocks are still being written).
        t_scatter = time.perf_counter()
        scattering = _in_executor(planner, _scatter_all, eng, staged, areas)
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


_LANE = [str(k) for k in range(16)]  # label values, not formatted per post

#: a read's one post (bytes from one P rank) of at least this many bytes is split
#: over the lanes, a part per lane. Raw NIXL, one READ vs its halves on two agents
#: and threads (benchmarks/raw_lanes.py, 2 vCPUs): 8 MiB 0.89x (no gain), 16 MiB
#: 1.65x, 32 MiB 1.50x, 256 MiB 1.61x.
SPLIT_MIN_BYTES = 16 << 20
_SPLIT_ALIGN = 4096


def split_post(n: int, posts: Sequence[PostList], min_bytes: int = SPLIT_MIN_BYTES
               ) -> tuple[list[PostList], list[int]] | None:
    """A read's only post with bytes cut into ``n`` parts of about equal bytes
    (cuts page aligned, descriptors cut where a part ends), one per lane, and
    which post each part belongs to; None unless there are ``n`` > 1 lanes, one
    post with bytes (others notify only; they are kept as their own parts) and
    at least ``min_bytes`` of it. Pure and vectorised.

    Why: a homogeneous read has one post, so :func:`lane_of` leaves it on lane
    0, where its CMA copy runs on one thread; cut in halves on two lanes it
    copies on two cores. The parts cover exactly the post's bytes, each local
    byte paired with the same remote byte as before."""
    full = [i for i, p in enumerate(posts) if p.length.size]
    if n < 2 or len(full) != 1:
        return None
    post = posts[full[0]]
    total = int(post.nbytes or post.length.sum())
    if total < min_bytes:
        return None
    ends = np.cumsum(post.length)
    starts = ends - post.length
    cuts = (np.arange(1, n, dtype=np.int64) * total // n) // _SPLIT_ALIGN * _SPLIT_ALIGN
    points = np.union1d(starts, cuts)  # where a piece begins, in the post's byte order
    points = points[(points >= 0) & (points < total)]
    idx = np.searchsorted(ends, points, side="right")  # the descriptor each piece is in
    off = points - starts[idx]
    size = np.append(points[1:], total) - points
    local, remote = post.local[idx] + off, post.remote[idx] + off
    chunk = np.searchsorted(cuts, points, side="right")
    parts: list[PostList] = []
    owner: list[int] = []
    for i, p in enumerate(posts):
        if i != full[0]:
            parts.append(p)
            owner.append(i)
            continue
        for k in range(n):
            mine = chunk == k
            if mine.any():
                parts.append(PostList(p.rank, local[mine], remote[mine], size[mine], 0,
                                      int(size[mine].sum())))
                owner.append(i)
    return parts, owner


#: a verified read's only post of at least this many bytes is cut into parts of
#: whole digest chunks, about this many bytes each and at most PIPELINE_MAX_PARTS,
#: posted one after the other on its lane: D hashes each part once it landed,
#: beside the next part's copy (:func:`pipeline`). Measured (64 MiB, 2 vCPUs
#: shared by both sidecars): D's hashing after the last byte landed 2.5 ms in 4
#: parts, 7-10 ms hashing the whole read after it landed.
PIPELINE_MIN_BYTES = 16 << 20
PIPELINE_MAX_PARTS = 16


def pipeline(posts: Sequence[PostList], plan: ReadPlan, chunk_bytes: int,
             min_bytes: int = PIPELINE_MIN_BYTES, max_parts: int = PIPELINE_MAX_PARTS
             ) -> tuple[list[PostList], list[int], list[int],
                        list[tuple[I64, I64, I64]]] | None:
    """A verified read's only post with bytes cut for hashing as it lands: its
    parts and the post each belongs to (as :func:`split_post`), which parts
    carry the cut post, and the region-relative pieces (D's side) of each of
    them. None unless one post has bytes, at least ``min_bytes`` of them, in
    one digest request's pieces (:data:`~kvsidecar.daemon.digest.MAX_RANGES`)
    and the cut gives 2 parts or more (about ``min_bytes`` each, at most
    ``max_parts``). Cuts fall on whole chunks of the post's stream, so the
    parts' digests joined are the post's. Pure."""
    full = [i for i, p in enumerate(posts) if p.length.size]
    if len(full) != 1:
        return None
    post = posts[full[0]]
    rr = next((r for r in plan.reads if r.remote_rank == post.rank), None)
    if (rr is None or post.nbytes < min_bytes or rr.length.size > digest.MAX_RANGES
            or not np.array_equal(rr.length, post.length)):
        return None
    cuts = digest.chunk_cuts(post.length, chunk_bytes,
                             max(2, min(max_parts, post.nbytes // min_bytes)))
    if not cuts.size:
        return None
    idx, off, size, run = digest.cut_stream(post.length, cuts)
    local, remote = post.local[idx] + off, post.remote[idx] + off
    region, loff = rr.region[idx].astype(np.int64), rr.local_offset[idx] + off
    out: list[PostList] = []
    owner: list[int] = []
    mine: list[int] = []
    pieces: list[tuple[I64, I64, I64]] = []
    for i, p in enumerate(posts):
        if i != full[0]:
            out.append(p)
            owner.append(i)
            continue
        for k in range(cuts.size + 1):
            sel = run == k
            mine.append(len(out))
            out.append(PostList(p.rank, local[sel], remote[sel], size[sel], 0,
                                int(size[sel].sum())))
            owner.append(i)
            pieces.append((region[sel], loff[sel], size[sel]))
    return out, owner, mine, pieces


def joined(results: list[Any], owner: list[int], n: int) -> list[Any]:
    """The outcome of each of ``n`` posts from its parts' (:func:`split_post`): the
    first failure of its parts, else their bytes and descriptors summed, the
    longest post and transfer times."""
    out: list[Any] = [None] * n
    for r, i in zip(results, owner):
        have = out[i]
        if isinstance(have, BaseException):
            continue  # its first failure stands
        if have is None or isinstance(r, BaseException):
            out[i] = r
        elif isinstance(r, TransferStats):
            out[i] = TransferStats(have.bytes + r.bytes, have.descriptors + r.descriptors,
                                   max(have.post_us, r.post_us), max(have.xfer_us, r.xfer_us),
                                   have.telemetry and r.telemetry)
    return out


def lane_of(n: int, posts: Sequence[PostList]) -> list[int] | None:
    """The lane of each post when a read spreads over ``n`` lanes: its i-th post
    with bytes on lane i mod n (P rank by P rank, in candidate order), bare
    notifications on lane 0; None when every post would go on lane 0 anyway (one
    lane, or bytes from one P rank: a homogeneous read stays on lane 0 with its
    notification attached).

    Why per P rank: each P rank's transfer is one NIXL post whose CMA copy runs
    inside ``transfer()`` on the posting thread; posts to different P ranks on
    different threads copy in parallel (raw NIXL, 2 x 16,384 scattered 4 KiB
    descriptors from two P processes: 1.50x with two agents on two threads,
    ``benchmarks/raw_lanes.py``)."""
    if n <= 1:
        return None
    out, k = [], 0
    for post in posts:
        if post.length.size:
            out.append(k % n)
            k += 1
        else:
            out.append(0)
    return out if k > 1 else None


@dataclass(frozen=True)
class Targets:
    """What a post needs of each candidate P rank's link (agent, generation,
    peer info, merge limit): looked up once per read, or once for a batch."""

    agents: dict[int, str]
    gens: dict[int, int]
    infos: dict[int, Any]
    merge: dict[int, int]
    #: each rank's link, for the generation of a lane other than 0
    peers: dict[int, Peer] = field(default_factory=dict)


def targets_of(cands: Sequence[int], peers: list[Peer]) -> Targets:
    # Peers that accept batched notifications get a read's posts merged with
    # other reads' of the same flush (one transfer, one notification).
    return Targets({p: peer.agent for p, peer in zip(cands, peers)},
                   {p: peer.generation for p, peer in zip(cands, peers)},
                   {p: peer.info for p, peer in zip(cands, peers)},
                   {p: min(peer.info.notif_batch_reads, notifications.MAX_NOTIF_READS)
                    for p, peer in zip(cands, peers)},
                   dict(zip(cands, peers)))


def post_read(eng: EngineRank, job: ReadJob, timeout_s: float | None,
              metrics: Metrics | None, cands: Sequence[int], peers: list[Peer],
              posts: list[PostList], staged: Sequence[StagedPlan | None],
              areas: Sequence[Area | None], *, notify: bool = True,
              targets: Targets | None = None, lanes: Sequence[int] | None = None,
              ) -> tuple[list[asyncio.Future[Any]], bytes, dict[int, str], dict[int, int]]:
    """Hand every P rank's post of one read to the worker (nothing here awaits):
    the futures of their outcomes, in ``posts`` order, with the notification and
    the agents and merge limits it went to. ``notify=False`` (posted during the
    claim): no notification rides with the transfers and bare notifications are
    left out (an already-done future stands in for them); see
    :func:`_post_and_wait`. Staged posts (``areas[i]`` given) read into their
    area: ``posts[i]`` is replaced by the staged addresses. ``targets``: of
    ``cands`` and ``peers``, when the caller already has them (a batch).
    ``lanes``: the lane of each post (:func:`lane_of`; None: all on lane 0);
    only with ``notify=False``, as P accepts notifications from lane 0 alone."""
    if lanes is not None and notify:
        raise ValueError("posts spread over lanes carry no notification")
    req = job.req
    remote = req.remote
    job.posted = True
    if metrics is not None:
        metrics.series(metrics.read_queue_seconds, eng.engine_id).observe(
            time.monotonic() - job.accepted_at)
    note = notifications.encode(remote.engine_id, req.remote_request_id or req.request_id,
                                eng.engine_id, eng.tp_rank, eng.layout.tp_size)
    t = targets or targets_of(cands, peers)
    agents, gens, infos, merge = t.agents, t.gens, t.infos, t.merge
    attached = note if notify else None
    todo: list[ReadOp | NotifyOp | None] = []  # None: notified after the grant
    workers = [eng.worker] * len(posts)
    for i, post in enumerate(posts):
        sp, area = staged[i], areas[i]
        if sp is not None and area is not None:
            post = posts[i] = PostList(post.rank, sp.post_local(area.address), sp.remote,
                                       sp.length, post.descriptors_before, post.nbytes)
            if metrics is not None:
                metrics.series(metrics.staged_transfers, eng.engine_id).inc()
        if post.length.size:
            far = infos[post.rank]
            gen = gens[post.rank]
            if lanes is not None:
                if lanes[i]:
                    workers[i] = eng.lanes[lanes[i]]
                    gen = t.peers[post.rank].generation_of(lanes[i])
                if metrics is not None:
                    metrics.series(metrics.lane_transfers, eng.engine_id, _LANE[lanes[i]]).inc()
            todo.append(ReadOp(agents[post.rank], post.local, post.remote, post.length,
                               notif=attached, timeout_s=timeout_s, generation=gen,
                               mem_type=eng.info.mem_type, dev_id=eng.info.dev_id,
                               remote_mem_type=far.mem_type, remote_dev_id=far.dev_id,
                               merge=merge[post.rank]))
        else:
            todo.append(NotifyOp(agents[post.rank], note, merge[post.rank])
                        if notify else None)
    # All or nothing of this read is handed over (nothing above posts), together
    # with every other read's posts of this loop iteration as one worker job;
    # each keeps its own outcome. Posts to a peer that advertised batched
    # notifications share one transfer and notification with the other reads'
    # posts to that agent (a failed transfer fails every read in it); a read
    # refused at claim time never gets here, so it never joins one.
    ops = [w.post_soon(op) if op is not None else _nothing_posted()
           for w, op in zip(workers, todo)]
    return ops, note, agents, merge


def check_results(eng: EngineRank, job: ReadJob, metrics: Metrics | None,
                  posts: list[PostList], results: list[Any], *, notified: bool = True) -> None:
    """Count one read's transfers, then raise unless every one succeeded and the
    lease still holds (bytes that landed after the lease are not trusted).
    ``notified``: the transfers carried the read's notifications (claimed
    first); a read posted during its claim notified no rank yet, so a failure
    of some ranks is not partial (the read may be retried whole)."""
    req = job.req
    tr = job.tracing
    leases = job.leases
    if metrics is not None:
        count_transfers(metrics, eng.engine_id, req.remote.engine_id, posts, results,
                        request_id=req.request_id)
    if tr is not None:
        for post, r in zip(posts, results):
            if isinstance(r, TransferStats) and post.length.size:
                tr.interval("kvsidecar.transfer", job.trace_id, job.span,
                            (r.post_us + r.xfer_us) / 1e6, remote_rank=post.rank, bytes=r.bytes,
                            descriptors=r.descriptors, post_s=r.post_us / 1e6,
                            wire_s=r.xfer_us / 1e6)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors and len(errors) < len(results) and notified:
        # Some ranks were read and notified: their holds may be released already,
        # so this read must not be retried as a whole. (Posted during its claim,
        # nothing was notified: a failure there fails or retries it whole.)
        raise PartialReadError(
            f"{len(errors)} of {len(results)} remote ranks failed ({errors[0]}); the others "
            "were read and notified"
        ) from errors[0]
    if errors:
        raise errors[0]
    if notified:
        # Every transfer carried its notification and is DONE: P has been told
        # this read ended. A failure from here on (the lease ran out) sends no
        # abandon; beside the notification it could reach P first and end a
        # hold that was read as aborted (P's outcome would depend on which of
        # its threads woke first).
        job.notified = True
    if leases is not None:
        leases.check(time.monotonic())


def outcome_of(plan: ReadPlan, posts: list[PostList], results: list[Any]) -> ReadOutcome:
    """What a read that succeeded reports (its completion's figures): the
    plan's bytes and descriptors, summed from its posts (``posts_of`` took them
    from the plan's reads on the planning thread)."""
    posted = sum(int(p.length.size) for p in posts)
    return ReadOutcome(sum(p.nbytes for p in posts), posted,
                       sum(p.descriptors_before for p in posts),
                       [r for r in results if isinstance(r, TransferStats)],
                       [TransferReport(post.rank, r.bytes, r.descriptors, r.post_us / 1e6,
                                       r.xfer_us / 1e6)
                        for post, r in zip(posts, results)
                        if isinstance(r, TransferStats) and post.length.size])


async def _notify_after_grant(eng: EngineRank, job: ReadJob,
                              claiming: asyncio.Future[None] | None,
                              posts: list[PostList], agents: dict[int, str], note: bytes,
                              merge: dict[int, int],
                              results: list[Any], metrics: Metrics | None) -> list[Any]:
    """Every transfer of a read posted during its claim has ended: wait for the
    claim (a refusal raises), then notify every P rank, without waiting for the
    notifications to leave: the bytes are in and the lease vouches for them, so
    the read is received now. A notification that fails is counted and logged;
    P then ends that hold by its lease instead (``results``, per post, as given).

    A failed transfer notifies no one, but the claim is still awaited and its
    refusal raised first: a P rank that re-registered or restarted within the
    window fails the READ over the stale link, and its refusal (``stale_link``)
    is what tells the read to re-link and retry. Nothing was notified, so a
    retry of the whole read is safe; every transfer of this attempt has ended
    (DONE, or dead with the agent reset that failed it), so nothing of it can
    write into the blocks the retry fills.

    ``claiming`` None: a read spread over lanes whose claim was granted before
    posting (:func:`lane_of`); only lane 0 (``eng.worker``) notifies, as P
    accepts notifications from the agent its handshake declared alone."""
    if claiming is not None:
        await claiming
    notify_ended(eng, job, posts, agents, note, merge, results, metrics)
    return results


def notify_ended(eng: EngineRank, job: ReadJob, posts: list[PostList], agents: dict[int, str],
                 note: bytes, merge: dict[int, int], results: list[Any],
                 metrics: Metrics | None) -> None:
    """Every transfer of a read posted without notifications ended (and its claim,
    if any, was granted): unless one failed, notify every P rank from lane 0
    (``eng.worker``, the agent P's handshake declared), without waiting for the
    notifications to leave. A failed transfer notifies no one: the read fails or
    is retried whole, and the abandon tells P."""
    if any(isinstance(r, BaseException) for r in results):
        return
    job.notified = True
    # Lane 0 reset since a link was made (another read failed on it meanwhile,
    # while this one's transfers ran on other lanes): its new agent knows no
    # remote agent and P knows it not, so that rank is notified over a fresh link
    # (whose handshake declares the new agent). Seen: both notifications of such
    # a read failed with 'unknown remote agent' and P's holds lapsed.
    stale = {peer.key[2]: peer for peer in job.peers
             if peer.generation != eng.worker.generation}
    for post in posts:
        if post.rank in stale:
            _relinking.add(task := asyncio.ensure_future(_notify_relinked(
                eng, stale[post.rank], note, merge[post.rank], metrics)))
            task.add_done_callback(_relinking.discard)
            continue
        sent = eng.worker.post_soon(NotifyOp(agents[post.rank], note, merge[post.rank]))
        sent.add_done_callback(functools.partial(_notified, eng.engine_id, post.rank, metrics))


#: notifications waiting for a fresh link (referenced until done)
_relinking: set[asyncio.Future[None]] = set()


async def _notify_relinked(eng: EngineRank, old: Peer, note: bytes, merge: int,
                           metrics: Metrics | None) -> None:
    """Notify ``old``'s P rank over a link made into lane 0's current agent."""
    address, engine_id, rank = old.key
    sent: asyncio.Future[Any]
    try:
        peer = await eng.peers.get(address, engine_id, old.info.tp_size, rank)
        sent = eng.worker.post_soon(NotifyOp(peer.agent, note, merge))
        await sent
    except Exception as e:
        sent = asyncio.get_running_loop().create_future()
        sent.set_exception(e)
    _notified(eng.engine_id, rank, metrics, sent)


def _notified(engine_id: str, rank: int, metrics: Metrics | None,
              sent: asyncio.Future[Any]) -> None:
    """A deferred notification left, or failed (counted; P's lease ends the hold)."""
    if sent.cancelled() or sent.exception() is None:
        return
    log.warning("engine %r: the notification to P rank %d failed: %s (P ends the hold when "
                "the lease runs out)", engine_id, rank, sent.exception())
    if metrics is not None:
        metrics.notifications_sent.labels(engine_id, "failed").inc()


async def _all_or_cancel(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Every result, in order; on the first failure (or this task's cancel) the
    others are cancelled before it is raised: a read that cannot link one P rank
    gives up the rest of its links at once, and with them the handshakes they
    wait for (other engines may need those peer connections)."""
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # a failure, or this task cancelled: the rest are not needed
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    for t in tasks:
        err = None if t.cancelled() else t.exception()
        if err is not None:
            raise err
    return [t.result() for t in tasks]


async def _outcomes(ops: list[asyncio.Future[Any]]) -> list[Any]:
    """``gather(*ops, return_exceptions=True)``; one op (the usual case, P and
    D of the same tp) is awaited directly, without a gathering future."""
    if len(ops) != 1:
        return list(await asyncio.gather(*ops, return_exceptions=True))
    try:
        return [await ops[0]]
    except asyncio.CancelledError as e:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # this read was cancelled, not its op
        return [e]  # as gather reports an op cancelled by someone else
    except Exception as e:
        return [e]


def _nothing_posted() -> asyncio.Future[None]:
    """The outcome of a rank nothing was posted to yet (notified after the grant)."""
    f: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    f.set_result(None)
    return f


def _in_executor(executor: Executor, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    return asyncio.get_running_loop().run_in_executor(executor, fn, *args)


def _scatter_all(eng: EngineRank, staged: list[StagedPlan | None],
                 areas: list[Area | None]) -> None:
    """Copy every staged piece into the engine's blocks (planning thread)."""
    pool = eng.staging
    assert pool is not None
    views = [r.numpy() for r in eng.regions]
    for sp, area in zip(staged, areas):
        if sp is not None and area is not None:
            scatter(pool.view(area), sp.src, sp.dst, sp.size, eng.bases, views)


def _retrieve(f: asyncio.Future[Any]) -> None:
    """Mark an abandoned future's outcome as seen (no 'never retrieved' noise)."""
    if not f.cancelled():
        f.exception()


@dataclass(frozen=True)
class _TransferSeries:
    """The labelled series count_transfers touches for one (engine, peer): looked
    up once, not ``labels()`` (a lock and a label tuple each) eight times per
    transfer. Only gauges are ever removed from the registry, so these stay valid."""

    failures: Any
    seconds: Any
    post_seconds: Any
    nbytes: Any
    descriptors: Any
    planned: Any
    read_bytes: Any
    notif_failed: Any
    reads: Any


#: A planning job (the reads of one loop iteration) naming at most this many local
#: blocks in all is planned on the loop, not on the planning thread (see
#: ThreadGroups): a 1-block read plans in ~40 us, less than the thread's round trip.
_INLINE_PLAN_BLOCKS = 4
#: more tries for a read whose link the local agent's reset made stale before it
#: posted anything (see ReadTable._attempts)
_RESET_RETRIES = 2
_SERIES_CACHE_MAX = 4096  # (engine, peer) pairs per daemon; cleared whole past it
_series_cache: weakref.WeakKeyDictionary[Metrics, dict[tuple[str, str], _TransferSeries]] = (
    weakref.WeakKeyDictionary())


def _transfer_series(m: Metrics, engine: str, peer: str) -> _TransferSeries:
    cache = _series_cache.setdefault(m, {})
    got = cache.get((engine, peer))
    if got is None:
        if len(cache) >= _SERIES_CACHE_MAX:
            cache.clear()
        labels = (engine, peer)
        # Failure series exist (at 0) from the first transfer on, so dashboards and
        # alerts see "no failures" rather than "no data".
        got = cache[(engine, peer)] = _TransferSeries(
            m.transfer_failures.labels(*labels), m.transfer_seconds.labels(*labels),
            m.transfer_post_seconds.labels(*labels), m.transfer_bytes.labels(*labels),
            m.transfer_descriptors.labels(*labels),
            m.transfer_descriptors_planned.labels(*labels), m.read_bytes.labels(*labels),
            m.notifications_sent.labels(engine, "failed"),
            m.transfer_reads.labels(*labels))
    return got


def count_transfers(m: Metrics, engine: str, peer: str, posts: list[PostList],
                    results: list[TransferStats | BaseException | None], *,
                    request_id: str = "") -> None:
    """Per transfer (one remote rank of one read): the vLLM-compatible histograms
    and counters. Bare notifications (nothing read from that rank) count as
    notifications, not transfers. The request id rides along as an exemplar on
    the latency histogram (OpenMetrics), never as a label."""
    series = _transfer_series(m, engine, peer)
    exemplar = {"request_id": request_id[:64]} if request_id else None
    for post, r in zip(posts, results):
        if not post.length.size:
            if isinstance(r, BaseException):
                series.notif_failed.inc()
            else:  # rare (nothing to read from that rank): not worth a cached series
                m.notifications_sent.labels(engine, "ok").inc()
        elif isinstance(r, BaseException):
            series.failures.inc()
        elif isinstance(r, TransferStats):
            series.seconds.observe(r.xfer_us / 1e6, exemplar)
            series.post_seconds.observe(r.post_us / 1e6)
            series.nbytes.observe(r.bytes)
            series.descriptors.observe(r.descriptors)
            if r.first:  # one observation per NIXL transfer, merged or not
                series.reads.observe(r.reads)
            series.planned.observe(post.descriptors_before)
            series.read_bytes.inc(r.bytes)


def _event(eng: EngineRank, req: Read, outcome: str, reason: str) -> dict[str, object]:
    """The identifiers a log line of this read carries (JSON log fields)."""
    return {"request_id": req.request_id, "engine": eng.engine_id, "rank": eng.tp_rank,
            "peer": req.remote.engine_id, "outcome": outcome, "reason": reason}


#: the context of an untraced step: one shared instance (a generator-based
#: context manager per step was two objects and a generator per read)
_NOTHING = contextlib.nullcontext()


def failed(req: Read, reason: str) -> Completion:
    return Completion(req.request_id, "failed", reason,
                      invalid_block_ids=[list(g) for g in req.local_block_ids])


def _aborted_before_posting(job: ReadJob) -> Completion:
    return aborted(job.req, f"{job.abort_reason or 'cancelled'}; nothing had been posted")


def aborted(req: Read, reason: str) -> Completion:
    return Completion(req.request_id, "aborted", reason,
                      invalid_block_ids=[list(g) for g in req.local_block_ids])


@dataclass(slots=True)
class _Gathering:
    """One :meth:`ReadTable.together` under way: its table, the reads accepted so
    far, and whether it is still open. A task created inside it copies the
    context and keeps seeing it after it ended: a read such a task accepts then
    must start at once, not join a group already started (it would never run)."""

    table: ReadTable
    reads: list[tuple[EngineRank, ReadJob]]
    open: bool = True


#: the :meth:`ReadTable.together` the current task is inside
_GATHERING: contextvars.ContextVar[_Gathering | None] = (
    contextvars.ContextVar("kvsidecar_read_gathering", default=None))


class ReadTable:
    """Every accepted read of this sidecar, from acceptance to its completion.

    It owns the read jobs and their tasks; completions go out through
    ``deliver`` (which drops them if the engine has gone meanwhile). Failures
    over links made before the request (a peer that restarted) drop those
    links and retry once, unless some rank was already read and notified.
    """

    def __init__(self, planner: Executor, handshakes: HandshakeClient, read_timeout_s: float,
                 deliver: Callable[[EngineRank, Completion], None],
                 metrics: Metrics) -> None:
        self._planner = planner
        #: the planning of reads that reach it in one loop iteration, as one job
        self._plans = ThreadGroups(planner, many={_plan_and_address: _plan_and_address_many},
                                   inline_cost=_INLINE_PLAN_BLOCKS)
        self._metrics = metrics
        #: set by the Sidecar when tracing is configured
        self.tracing: Tracing | None = None
        self._handshakes = handshakes
        self._timeout_s = read_timeout_s
        self._deliver = deliver
        self._jobs: dict[tuple[str, str], ReadJob] = {}
        self._per_engine: dict[str, int] = {}
        self._abandons: set[asyncio.Task[None]] = set()
        #: set by the Sidecar: what verified reads use (``--verify-bytes``, ``Read.verify``)
        self.verifier: verify.Verifier | None = None
        self._spent = SpentTokens()

    def count(self, engine_id: str) -> int:
        """Reads of ``engine_id`` accepted and not yet completed."""
        return self._per_engine.get(engine_id, 0)

    def __len__(self) -> int:
        return len(self._jobs)

    def oldest_age(self, engine_id: str, now: float) -> float:
        """Seconds since ``engine_id``'s oldest read in flight was accepted (0.0: none)."""
        return max((now - job.accepted_at for (e, _), job in self._jobs.items()
                    if e == engine_id), default=0.0)

    def by_engine(self) -> dict[str, int]:
        """Reads in flight per engine id (for the in-flight gauge)."""
        out: dict[str, int] = {}
        for engine_id, _ in self._jobs:
            out[engine_id] = out.get(engine_id, 0) + 1
        return out

    def accept(self, eng: EngineRank, req: Read) -> None:
        """Validate what can be checked locally (raises RequestError) and start the read."""
        key = (req.engine_id, req.request_id)
        if key in self._jobs:
            raise RequestError(DUPLICATE, f"read {req.request_id!r} is already in progress")
        r = req.remote
        if len(r.handshake) != r.tp_size:
            raise RequestError(BAD_REQUEST, f"remote engine {r.engine_id!r} has tp_size "
                                            f"{r.tp_size} but {len(r.handshake)} handshake "
                                            "addresses")
        try:
            candidate_ranks(eng.layout.tp_size, eng.tp_rank, r.tp_size)
            check_block_ids(eng.layout, req.local_block_ids, "local")
            if len(req.remote_block_ids) != len(eng.layout.groups):
                raise PlanError(f"remote block ids name {len(req.remote_block_ids)} groups, "
                                f"the layout has {len(eng.layout.groups)}")
        except PlanError as e:
            raise RequestError(BAD_REQUEST, str(e)) from None
        if len(req.remote_tokens) != r.tp_size:
            raise RequestError(BAD_REQUEST, (
                f"read {req.request_id[:200]!r} carries {len(req.remote_tokens)} hold tokens "
                f"for {r.tp_size} remote ranks: pass the token each P rank's hold issued "
                "(remote_tokens; vLLM: kv_transfer_params['remote_tokens'])"))
        job = ReadJob(req)
        if req.verify or eng.verify_bytes:
            job.verify = self._verifier_for(eng)
        job.replayed = not self._spent.first_use(req.remote_tokens, time.time())
        self._jobs[key] = job
        self._per_engine[req.engine_id] = self._per_engine.get(req.engine_id, 0) + 1
        self._route(eng, job)

    def _verifier_for(self, eng: EngineRank) -> verify.Verifier:
        """What a verified read of ``eng`` uses; RequestError when its memory has no
        digester (GPU memory, for now) or this table verifies nothing."""
        if self.verifier is None:
            raise RequestError(UNAVAILABLE, "this sidecar cannot verify bytes")
        try:
            digest.digester_for(eng.info.mem_type)
        except digest.DigestUnavailable as e:
            raise RequestError(BAD_REQUEST, str(e)) from None
        return self.verifier

    def _route(self, eng: EngineRank, job: ReadJob) -> None:
        """Start an accepted read now, or at the end of the :meth:`together` of
        the task that accepted it."""
        gathering = self._gathering()
        if gathering is not None:
            gathering.reads.append((eng, job))
        else:
            self._start_one(eng, job)

    def _gathering(self) -> _Gathering | None:
        """The :meth:`together` of this table the current task is inside, if open."""
        gathering = _GATHERING.get()
        if gathering is not None and gathering.open and gathering.table is self:
            return gathering
        return None

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Reads accepted inside start together when it ends (one engine message's,
        e.g. a Batch): those of one engine rank that read the same remote engine
        over links already made share one task (:mod:`~kvsidecar.daemon.read_batch`),
        the others start one task each as :meth:`accept` alone would.

        What is gathered lives in a context variable, i.e. per asyncio task: should
        a handler inside ever suspend, the reads other connections' tasks accept
        meanwhile start at once as usual, instead of joining this message's
        group and waiting for its end."""
        if self._gathering() is not None:
            yield  # nested: the outer one starts them
            return
        gathering = _Gathering(self, [])
        token = _GATHERING.set(gathering)
        try:
            yield
        finally:
            _GATHERING.reset(token)
            gathering.open = False  # for the tasks created inside, which still see it
            self._start(gathering.reads)

    def _start(self, gathered: list[tuple[EngineRank, ReadJob]]) -> None:
        groups: dict[tuple[int, str, int, tuple[str, ...]], list[tuple[EngineRank, ReadJob]]] = {}
        for eng, job in gathered:
            r = job.req.remote
            groups.setdefault((id(eng), r.engine_id, r.tp_size, tuple(r.handshake)),
                              []).append((eng, job))
        for group in groups.values():
            eng = group[0][0]
            jobs = [job for _, job in group if not self._aborted_unstarted(eng, job)]
            if any(job.verify is not None for job in jobs):  # verified reads go alone
                for job in jobs:
                    if job.verify is not None:
                        self._start_one(eng, job)
                jobs = [job for job in jobs if job.verify is None]
            links = self._batch_links(eng, jobs) if len(jobs) > 1 else None
            if links is None:
                for job in jobs:
                    self._start_one(eng, job)
            else:
                self._start_batch(eng, jobs, *links)

    def _aborted_unstarted(self, eng: EngineRank, job: ReadJob) -> bool:
        """A read released in the message that asked for it ends before it starts."""
        if job.abort_reason is None:
            return False
        c = _aborted_before_posting(job)
        self._tell_p(eng, job, c)
        self._finish(eng, job, c)
        return True

    def _batch_links(self, eng: EngineRank, jobs: list[ReadJob]
                     ) -> tuple[Sequence[int], list[Peer]] | None:
        """The candidate P ranks and their links when ``jobs`` may go as one batch:
        links all made, nothing staged, nothing traced; else None."""
        if eng.staging is not None or (self.tracing is not None and self.tracing.enabled):
            return None
        r = jobs[0].req.remote
        cands = candidate_ranks(eng.layout.tp_size, eng.tp_rank, r.tp_size)
        peers = []
        for p in cands:
            peer = eng.peers.cached(r.handshake[p], r.engine_id, r.tp_size, p)
            if peer is None:
                return None
            peers.append(peer)
        return cands, peers

    def _start_one(self, eng: EngineRank, job: ReadJob) -> None:
        job.task = asyncio.ensure_future(self._run(eng, job))
        # A task cancelled before its first step never runs its body; the
        # callback still reports it and frees the request id.
        job.task.add_done_callback(functools.partial(self._task_done, eng, job))

    def _start_batch(self, eng: EngineRank, jobs: list[ReadJob], cands: Sequence[int],
                     peers: list[Peer]) -> None:
        from kvsidecar.daemon.read_batch import run_batch  # it builds on this module

        t0 = time.perf_counter()
        task = asyncio.ensure_future(run_batch(
            eng, jobs, cands, peers, self._plans, self._timeout_s, self._metrics,
            self._handshakes, functools.partial(self._settle, eng, t0)))
        self._metrics.series(self._metrics.batched_reads, eng.engine_id).inc(len(jobs))
        drop = functools.partial(self._drop, eng)
        for job in jobs:
            job.task = task
            job.on_abort = drop
        task.add_done_callback(functools.partial(self._batch_done, eng, jobs))

    def _settle(self, eng: EngineRank, t0: float, job: ReadJob,
                got: ReadOutcome | BaseException) -> None:
        """A read of a batch ended: complete it, or, when the failure is one a
        fresh handshake may cure, carry it on alone (:meth:`_attempts` decides)."""
        if job.ended:
            return
        if isinstance(got, (NixlError, LeaseRefused, PartialReadError)):
            job.on_abort = None
            job.task = asyncio.ensure_future(self._run(eng, job, failed=got))
            job.task.add_done_callback(functools.partial(self._task_done, eng, job))
            return
        self._complete(eng, job, got, t0)

    def _drop(self, eng: EngineRank, job: ReadJob) -> None:
        """Abort a read of a batch that posted nothing yet, alone and at once."""
        c = _aborted_before_posting(job)
        self._tell_p(eng, job, c)
        self._finish(eng, job, c)

    def _batch_done(self, eng: EngineRank, jobs: list[ReadJob], task: asyncio.Task[None]
                    ) -> None:
        """Nothing of the batch runs any more: a read it still owns (cancelled,
        or a bug) gets its completion here, so none is lost."""
        err = None if task.cancelled() else task.exception()
        if err is not None:
            log.error("a batch of %d reads of engine %r failed", len(jobs), eng.engine_id,
                      exc_info=err)
        for job in jobs:
            if job.ended or job.task is not task:
                continue
            self._complete(eng, job, asyncio.CancelledError() if err is None else err,
                           time.perf_counter())

    def abort(self, engine_id: str, request_id: str, reason: str) -> bool:
        job = self._jobs.get((engine_id, request_id))
        if job is None:
            return False
        job.abort(reason)
        return True

    async def abort_all(self, engine_id: str | None, reason: str, timeout_s: float, *,
                        posted_too: bool = True) -> None:
        """Abort the reads of one engine (or all), then wait until none can still write."""
        jobs = [j for (e, _), j in self._jobs.items() if engine_id is None or e == engine_id]
        for j in jobs:
            if posted_too or not j.posted:
                j.abort(reason)
        tasks = [j.task for j in jobs if j.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    def _task_done(self, eng: EngineRank, job: ReadJob, task: asyncio.Task[None]) -> None:
        if task.cancelled() and not job.ended:
            c = _aborted_before_posting(job)
            self._tell_p(eng, job, c)
            self._finish(eng, job, c)

    def _tell_p(self, eng: EngineRank, job: ReadJob, c: Completion) -> None:
        """A read that did not receive abandons every P rank it would have read, at
        once and in the background, so P ends the hold (``aborted``) instead of
        waiting for its deadline. Called only when nothing of the read is in flight.
        Without claims yet (it ended while linking, or before its first step) the
        abandon names no agent unless the link is known (P skips the check then).
        A read that fails or is aborted after it was notified (every transfer
        DONE with its notification, or posted during its claim, every transfer
        done and the claim granted) abandons nothing: the notification ends the
        holds ``sent``, and an abandon sent beside it over the peer channel could
        reach P first and end them ``aborted`` although they were read."""
        if c.kind == "received" or job.notified:
            return
        leases = job.leases or self._unclaimed(eng, job)
        if leases is None:
            return
        for t in leases.abandon(f"{c.kind}: {c.reason}"):
            self._abandons.add(t)
            t.add_done_callback(self._abandons.discard)

    def _unclaimed(self, eng: EngineRank, job: ReadJob) -> ReaderLeases | None:
        req = job.req
        r = req.remote
        try:
            cands = candidate_ranks(eng.layout.tp_size, eng.tp_rank, r.tp_size)
        except PlanError:
            return None
        agents = {peer.key[2]: peer.agent for peer in job.peers}
        return claims_of(self._handshakes, eng, req,
                         ((p, agents.get(p, "")) for p in cands if p < len(r.handshake)))

    def _finish(self, eng: EngineRank, job: ReadJob, c: Completion) -> None:
        job.ended = True
        eng.peers.release(job.links)
        if job.tracing is not None:
            job.tracing.end(job.span, outcome=c.kind, bytes=c.nbytes)
        key = (eng.engine_id, job.req.request_id)
        if self._jobs.get(key) is job:
            del self._jobs[key]
            left = self._per_engine[key[0]] - 1
            if left:
                self._per_engine[key[0]] = left
            else:
                del self._per_engine[key[0]]
        self._deliver(eng, c)

    async def _run(self, eng: EngineRank, job: ReadJob,
                   failed: BaseException | None = None) -> None:
        req = job.req
        t0 = time.perf_counter()
        if self.tracing is not None and self.tracing.enabled and job.span is None:
            job.tracing = self.tracing
            job.span = self.tracing.start("kvsidecar.read", job.trace_id, engine=eng.engine_id,
                                          rank=eng.tp_rank, peer=req.remote.engine_id,
                                          decode_request_id=req.request_id)
        got: ReadOutcome | BaseException
        try:
            got = await self._attempts(eng, job, failed)
        except asyncio.CancelledError as e:
            got = e
        except Exception as e:  # every failure becomes a completion, never a crash
            got = e
        self._complete(eng, job, got, t0)

    def _complete(self, eng: EngineRank, job: ReadJob, got: ReadOutcome | BaseException,
                  t0: float) -> None:
        """The read's one completion from its outcome (or why it failed; cancelled:
        aborted before posting), P told when it did not receive."""
        req = job.req
        if isinstance(got, asyncio.CancelledError):
            c = _aborted_before_posting(job)
        elif isinstance(got, BaseException):
            e = got
            reason = f"{type(e).__name__}: {e}"
            log.warning("read %r of engine %r failed: %s", req.request_id, eng.engine_id, reason,
                        extra=_event(eng, req, "failed", reason))
            c = failed(req, reason)
            if isinstance(e, LeaseLost):
                self._metrics.leases_lost.labels(eng.engine_id).inc()
        else:
            out = got
            if job.abort_reason is not None:
                c = aborted(req, f"{job.abort_reason}; its transfers had finished")
            else:
                c = Completion(req.request_id, "received", nbytes=out.nbytes,
                               descriptors=out.descriptors, transfers=out.transfers)
                if log.isEnabledFor(logging.DEBUG):  # not even its fields otherwise
                    log.debug("read %r of engine %r received %d bytes", req.request_id,
                              eng.engine_id, out.nbytes, extra=_event(eng, req, "received", ""))
                self._metrics.series(self._metrics.read_seconds, eng.engine_id).observe(
                    time.perf_counter() - t0, {"request_id": req.request_id[:64]})
        self._tell_p(eng, job, c)  # nothing of this read is in flight any more
        self._finish(eng, job, c)

    async def _attempts(self, eng: EngineRank, job: ReadJob,
                        failed: BaseException | None = None) -> ReadOutcome:
        """Run the read, again after a failure a stale link explains (``failed``:
        its first attempt, made in a batch, failed so).

        Retry once only over links older than the request (or made before the
        local agent was reset), and never after a timeout (the peer is stalled,
        not restarted). A P engine that registered again refuses leases taken
        over an old link; other refusals (the hold ended) leave the shared links
        alone. :class:`NixlAgentReset` posted nothing (the agent was reset under
        a link, typically because a concurrent read over the same stale peer
        failed) and :class:`NixlKilledByReset` died with an agent another read's
        failure reset (nothing of it lands any more): either may happen to the
        retry too, when several reads trip over the same stale peer at once, so
        they alone earn up to ``_RESET_RETRIES`` more tries.
        """
        req = job.req
        retries, resets = 1, _RESET_RETRIES
        while True:
            try:
                if failed is not None:
                    first, failed = failed, None
                    raise first
                return await run_read(eng, job, self._planner, self._plans, self._timeout_s,
                                      self._metrics, self._handshakes)
            except PartialReadError:
                self._forget_peers(eng, job)  # the next request re-links the failed ranks
                raise
            except (NixlError, LeaseRefused, hold_token.TokenError) as e:
                # A token refused over a link older than the request may be the
                # rank's previous registration's key: re-link once, like a lease.
                if isinstance(e, LeaseRefused) and not e.stale_link:
                    raise
                reset = isinstance(e, (NixlAgentReset, NixlKilledByReset))
                stale = self._forget_peers(eng, job) or reset
                if not stale or isinstance(e, NixlTimeout) or job.abort_reason is not None:
                    raise
                if retries:
                    retries -= 1
                elif reset and resets:
                    resets -= 1
                else:
                    raise
                log.info("read %r: %s; retrying with a fresh handshake", req.request_id, e,
                         extra=_event(eng, req, "retry", str(e)))
                job.posted = False

    def _forget_peers(self, eng: EngineRank, job: ReadJob) -> bool:
        """Drop the links (and cached handshakes) this read used; True if one of
        them predates the request, so it may have been stale."""
        stale = False
        for peer in job.peers:
            stale |= peer.made_at < job.accepted_at
            eng.peers.forget(peer)
            self._handshakes.forget(peer.key[0], peer.key[1])
        job.peers = []
        return stale
