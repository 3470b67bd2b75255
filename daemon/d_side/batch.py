"""D side: the reads of one engine message that share a remote engine, carried
by one task.

One task looks the links up once, issues every read's claim (they leave as
one control batch per P rank), submits every read's plan (one planning job),
waits for all of them at once, then posts every read that may go (the worker
merges them into one READ per P rank) and completes each read from its own
transfers' callbacks: 16 reads cost one task, not 16 tasks and ~64 task
wake-ups on the event loop.

Each read keeps its own request id, book (state, abort, lease, timeout) and
completion: a refused claim, a plan error or an expired lease fails that read
alone (``settle`` gets its exception), the others go on. An abort before
posting is the read table's business (it drops the read from the batch at
once); this module only skips reads whose book has ended.

Used only where it changes nothing but the cost: links already made (the first
read to a new peer links through :func:`~kvsidecar.daemon.d_side.driver.run_read`),
no staging, no tracing, no verification, and the claim awaited before posting
(``--post-during-claim`` stays a per-read path; over a batch the claim round
trip is paid once).

With several lanes (``--post-lanes``) a read from several P ranks is spread
over them as on its own (:func:`~kvsidecar.daemon.d_side.parts.lane_of`):
posted without notifications, and notified from lane 0 once all its transfers
ended (:func:`~kvsidecar.daemon.d_side.posting.notify_ended`), so a failure is
never partial. A large read from one P rank is not cut into parts here, unlike
on its own (:func:`~kvsidecar.daemon.d_side.parts.split_post`): it is posted
whole on lane 0.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvsidecar.daemon.d_side.addresses import PostList, plan_and_address
from kvsidecar.daemon.d_side.futures import retrieve
from kvsidecar.daemon.d_side.job import (
    ReadJob,
    ReadOutcome,
    agents_of,
    check_tokens,
    claims_of,
    same_layout,
)
from kvsidecar.daemon.d_side.parts import lane_of
from kvsidecar.daemon.d_side.posting import (
    check_results,
    notify_ended,
    outcome_of,
    post_read,
    targets_of,
)
from kvsidecar.daemon.d_side.rank import ReaderRank
from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.peers.links import Peer
from kvsidecar.daemon.planner import ReadPlan
from kvsidecar.daemon.thread_groups import ThreadGroups
from kvsidecar.ipc.hold_token import TokenError
from kvsidecar.ipc.layout import Layout
from kvsidecar.metrics.registry import Metrics

#: what ``settle`` gets for a read: its outcome, or why it failed
Settle = Callable[[ReadJob, "ReadOutcome | BaseException"], None]


async def run_batch(eng: ReaderRank, jobs: Sequence[ReadJob], cands: Sequence[int],
                    peers: list[Peer], plans: ThreadGroups, timeout_s: float | None,
                    metrics: Metrics | None, handshakes: HandshakeClient,
                    settle: Settle) -> None:
    """Carry ``jobs`` (same engine rank, same remote engine, links ``peers`` to
    the candidate P ranks ``cands``, all made) to their ends; ``settle`` is
    called once per read that has not ``ended`` meanwhile, with its outcome or
    its exception. Returns once every posted transfer has ended (so whoever
    awaits this task knows nothing of the batch still writes)."""
    linked = _link_all(eng, jobs, cands, peers, settle)
    if linked is None:
        return
    ready, now = await _claim_and_plan_all(eng, *linked, cands, peers, plans, metrics,
                                           handshakes, settle)
    if not ready:
        return
    if eng.post_during_claim_s > 0:
        eng.peers.confirm(peers, now)  # P granted over these links just now
    await _post_all(eng, ready, cands, peers, timeout_s, metrics, settle)


def _link_all(eng: ReaderRank, jobs: Sequence[ReadJob], cands: Sequence[int],
              peers: list[Peer], settle: Settle) -> tuple[list[ReadJob], Layout] | None:
    """Hold the links for every read not ended yet, check the layouts agree and
    each read's tokens: the reads that go on and the remote layout (None: none)."""
    jobs = [job for job in jobs if not job.ended]  # aborted before this first step
    if not jobs:
        return None
    for job in jobs:
        job.book.link()
        eng.peers.hold(peers, job.links)
        job.peers = list(peers)
        job.book.linked()
    try:
        layout = same_layout(jobs[0].req.remote.engine_id, cands, peers)
    except RuntimeError as err:
        for job in jobs:
            settle(job, err)
        return None
    checked = []
    for job in jobs:
        try:
            check_tokens(job.req, cands, peers, time.time())  # before anything is posted
        except TokenError as e:
            settle(job, e)
        else:
            checked.append(job)
    return (checked, layout) if checked else None


async def _claim_and_plan_all(eng: ReaderRank, jobs: list[ReadJob], layout: Layout,
                              cands: Sequence[int], peers: list[Peer], plans: ThreadGroups,
                              metrics: Metrics | None, handshakes: HandshakeClient,
                              settle: Settle
                              ) -> tuple[list[tuple[ReadJob, ReadPlan, list[PostList]]], float]:
    """Issue every read's claims (one control batch per P rank), plan every
    read (one planning job), await all: the reads granted and planned, each
    with its plan and posts, and when the answers were in; a refusal or plan
    error settles its read alone."""
    remote_bases = {p: peer.bases for p, peer in zip(cands, peers)}
    claimed_at = time.monotonic()
    sent = []
    for job in jobs:
        job.leases = claims_of(handshakes, eng, job.req, agents_of(cands, peers))
        sent.append(job.leases.send_claims())  # they leave first, as one control batch
    planning = [plans.submit(plan_and_address, eng.layout, eng.tp_rank, layout, job.req,
                             eng.bases, remote_bases, {},
                             cost=sum(len(ids) for ids in job.req.local_block_ids))
                for job in jobs]
    waits: list[asyncio.Future[Any]] = [f for s in sent for _, _, f in s]
    await asyncio.wait(waits + planning)
    now = time.monotonic()
    claim_series = (metrics.series(metrics.lease_claim_seconds, eng.engine_id)
                    if metrics is not None else None)
    ready: list[tuple[ReadJob, ReadPlan, list[PostList]]] = []
    for job, claims, planned in zip(jobs, sent, planning):
        if job.ended:  # aborted while claiming and planning: already completed
            retrieve(planned)
            for _, _, answer in claims:  # a failed claim of it is news to no one
                retrieve(answer)
            continue
        assert job.leases is not None
        try:
            job.leases.settle(claims)  # a refusal fails this read with nothing posted
            if claim_series is not None:
                claim_series.observe(now - claimed_at)
            plan, posts, _ = planned.result()
            job.leases.check(now)  # never start on an expired lease
        except Exception as e:
            retrieve(planned)
            settle(job, e)
            continue
        ready.append((job, plan, posts))
    return ready, now


async def _post_all(eng: ReaderRank, ready: list[tuple[ReadJob, ReadPlan, list[PostList]]],
                    cands: Sequence[int], peers: list[Peer], timeout_s: float | None,
                    metrics: Metrics | None, settle: Settle) -> None:
    """Post every ready read (the worker merges them), each completed from its
    own transfers' callbacks; returns once every transfer ended."""
    until = math.inf if timeout_s is None else time.monotonic() + timeout_s
    targets = targets_of(cands, peers)
    renewals = _Renewals(until)
    bugs: list[BaseException] = []
    every: list[asyncio.Future[Any]] = []
    for job, plan, posts in ready:
        none = [None] * len(posts)
        lanes = lane_of(len(eng.lanes), posts)
        ops, note, agents, merge = post_read(eng, job, timeout_s, metrics, cands, peers, posts,
                                             none, none, targets=targets,
                                             notify=lanes is None, lanes=lanes)
        waiting = _Waiting(eng, job, plan, posts, ops, renewals, metrics, settle, bugs,
                           None if lanes is None else (note, agents, merge))
        renewals.add(waiting)
        for op in ops:
            op.add_done_callback(waiting.one_done)
        every.extend(ops)
    renewals.arm()
    await asyncio.wait(every)
    if bugs:  # the batch's task fails with it: its owner logs it and ends every read left
        raise bugs[0]


class _Renewals:
    """The lease renewals of a batch's posted reads: one timer for all of them
    (a read's own would be a timer per read, set and cancelled, while nearly
    every read ends long before its first renewal is due). When it fires,
    each read still running starts renewing on its own (as
    :meth:`~kvsidecar.daemon.leases.ReaderLeases.renew_later` would), until
    its read's deadline ``until``."""

    def __init__(self, until: float) -> None:
        self._until = until
        self._running: set[_Waiting] = set()
        self._every_s = math.inf
        self._timer: asyncio.TimerHandle | None = None

    def add(self, waiting: _Waiting) -> None:
        assert waiting.job.leases is not None
        self._running.add(waiting)
        self._every_s = min(self._every_s, waiting.job.leases.renew_every_s)

    def arm(self) -> None:
        if self._running:
            self._timer = asyncio.get_running_loop().call_later(self._every_s, self._due)

    def _due(self) -> None:
        self._timer = None
        for waiting in self._running:
            assert waiting.job.leases is not None
            waiting.renewing = waiting.job.leases.renew_from_now(self._until)

    def ended(self, waiting: _Waiting) -> None:
        """``waiting``'s transfers all ended: its renewals stop (the last one
        pending is abandoned); the timer goes with the batch's last read."""
        self._running.discard(waiting)
        if waiting.renewing is not None:
            waiting.renewing.cancel()
        if not self._running and self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _Waiting:
    """One posted read of a batch: completed from its own transfers' callbacks,
    as soon as the last of them ends (never later than its batch's others).

    It runs as a future's done callback, where an exception would only be
    logged by asyncio as "Exception in callback" and the read left for the
    batch's end to complete as if cancelled. So what ``settle`` raises (a bug)
    goes to ``bugs``: :func:`run_batch` raises the first once every transfer
    ended, and the batch's owner logs it and completes each read still open
    with it, under its own name."""

    def __init__(self, eng: ReaderRank, job: ReadJob, plan: ReadPlan, posts: list[PostList],
                 ops: list[asyncio.Future[Any]], renewals: _Renewals, metrics: Metrics | None,
                 settle: Settle, bugs: list[BaseException],
                 deferred: tuple[bytes, dict[int, str], dict[int, int]] | None = None) -> None:
        """``deferred``: posted over lanes without notifications; the read's
        notification, agents and merge limits, sent once every transfer ended."""
        self.job = job
        self._eng, self._plan, self._posts = eng, plan, posts
        self._ops, self._renewals, self._metrics, self._settle = ops, renewals, metrics, settle
        self._bugs = bugs
        self._deferred = deferred
        self._left = len(ops)
        #: its renewals, once the batch's timer started them
        self.renewing: asyncio.Task[None] | None = None

    def one_done(self, _: asyncio.Future[Any]) -> None:
        self._left -= 1
        if self._left:
            return
        self._renewals.ended(self)
        results = [_result(op) for op in self._ops]
        try:
            if self._deferred is None:  # its notifications rode with its transfers
                check_results(self._eng, self.job, self._metrics, self._posts, results)
            else:
                note, agents, merge = self._deferred
                if not self.job.ended:
                    notify_ended(self._eng, self.job, self._posts, agents, note, merge,
                                 results, self._metrics)
                check_results(self._eng, self.job, self._metrics, self._posts, results,
                              notified=False)
            got: ReadOutcome | BaseException = outcome_of(self._plan, self._posts, results)
        except (Exception, asyncio.CancelledError) as e:
            # A cancelled transfer future is a failed transfer of this read, not
            # a cancellation of the callback: settle it so (CancelledError is not
            # an Exception, and escaping here it would leave the read to the
            # batch's end, reported "aborted before posting").
            got = e
        if self.job.ended:
            return
        try:
            self._settle(self.job, got)
        except Exception as e:
            self._bugs.append(e)


def _result(op: asyncio.Future[Any]) -> Any:
    """An ended op's outcome as ``gather(return_exceptions=True)`` gives it."""
    if op.cancelled():
        return asyncio.CancelledError()
    return op.exception() or op.result()

