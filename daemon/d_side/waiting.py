"""D side: a group's posts, from hand-off to the worker until every transfer ended.

:func:`post_and_wait` (a read alone, a group of one) posts every P rank's
transfer, waits for all, renews the read's leases meanwhile, scatters what
was staged, and for a verified read compares digests before it notifies.
:func:`post_all` (a group of several reads, see the end of this docstring)
posts them all and completes each from its own transfers' callbacks.

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
:func:`~kvsidecar.daemon.d_side.posting.notify_after_grant`). The recency
condition bounds how often that costs an agent reset.

Staging areas (``areas[i]`` for ``posts[i]``) are released by the caller
when :func:`post_and_wait` returns or raises with every transfer's outcome
known: DONE, or failed (the worker reports a failure only once the agent
carrying it was destroyed). If the read's task is cancelled while transfers
are in flight, their areas are quarantined until the generation of the lane
that carried each moves on instead.

Lanes (``--post-lanes``): a read with bytes from several P ranks posts them
on several lanes (:func:`~kvsidecar.daemon.d_side.parts.lane_of`), which P
does not accept notifications from (the handshake declares lane 0's agent
alone). Such a read carries no notification either, as if posted during its
claim: lane 0 notifies every P rank once all of its transfers ended DONE. So
a failure of one rank has notified none: the read fails (or is retried)
whole, never as a :class:`~kvsidecar.daemon.d_side.job.PartialReadError`;
and a failed transfer is reported only once the lane that carried it was
reset, as on one lane. A read whose bytes come from one P rank is cut into
a part per lane when large enough
(:func:`~kvsidecar.daemon.d_side.parts.split_post`, never a staged one),
posted the same way; its parts' outcomes join back into the post's.

A group of several reads (:func:`post_all`; unstaged, untraced, unverified,
each claim granted before posting) costs one task, not a task per read: each
read is completed from its own transfers' done callbacks (:class:`_Waiting`),
and one timer starts the renewals of those still running (:class:`_Renewals`).
Over several lanes a read from several P ranks is spread as on its own,
posted without notifications and notified from lane 0 once all its transfers
ended; a read large enough to be cut into parts starts alone instead
(:func:`~kvsidecar.daemon.d_side.table.goes_alone`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsidecar.daemon.d_side.addresses import I64, PostList
from kvsidecar.daemon.d_side.futures import ended, in_executor, outcomes, retrieve
from kvsidecar.daemon.d_side.job import Attempt, ReadJob, ReadOutcome, Settle
from kvsidecar.daemon.d_side.parts import joined, lane_of, pipeline, split_post
from kvsidecar.daemon.d_side.posting import (
    check_results,
    notify_after_grant,
    notify_ended,
    outcome_of,
    post_read,
    targets_of,
)
from kvsidecar.daemon.d_side.rank import ReaderRank
from kvsidecar.daemon.d_side.verifying import ask_digests, landing, verified
from kvsidecar.daemon.leases import ReaderLeases, Renewals
from kvsidecar.daemon.peers.links import Peer
from kvsidecar.daemon.planner import ReadPlan
from kvsidecar.daemon.staging import Area, scatter
from kvsidecar.daemon.staging_plan import StagedPlan
from kvsidecar.metrics.registry import Metrics


@dataclass(frozen=True)
class _Shape:
    """How one read's posts go: the lane of each post, the parts they are cut
    into (and the post each part belongs to), and whether the transfers carry
    the notification."""

    lanes: list[int] | None
    split: tuple[list[PostList], list[int]] | None
    #: a verified read cut for hashing as it lands: its parts carrying the
    #: cut post and their pieces (:func:`~kvsidecar.daemon.d_side.parts.pipeline`)
    pipe: tuple[list[int], list[tuple[I64, I64, I64]]] | None
    notify: bool


def _shape(n_lanes: int, chunk_bytes: int | None, plan: ReadPlan, posts: list[PostList],
           areas: list[Area | None], claiming: asyncio.Future[None] | None) -> _Shape:
    """``chunk_bytes``: the read's digest chunk when verified, else None."""
    staged = any(a is not None for a in areas)
    lanes = lane_of(n_lanes, posts)
    split = split_post(n_lanes, posts) if lanes is None and not staged else None
    notify = claiming is None and lanes is None and split is None and chunk_bytes is None
    pipe = (pipeline(posts, plan, chunk_bytes)
            if chunk_bytes is not None and lanes is None and split is None and not staged
            else None)
    if pipe is not None:
        return _Shape(lanes, (pipe[0], pipe[1]), (pipe[2], pipe[3]), notify)
    return _Shape(lanes, split, None, notify)


class _Renewing:
    """A read's lease renewals, until its deadline ``until`` (its transfers
    time out there: whatever happens to a transfer, P's hold ends one lease
    later at most). They start now, or once ``claiming`` was granted (a
    renewal before it would find no bound to extend)."""

    def __init__(self, leases: ReaderLeases | None, claiming: asyncio.Future[None] | None,
                 until: float) -> None:
        self._leases, self._claiming, self._until = leases, claiming, until
        self._renewals: Renewals | None = None
        if claiming is None:
            self._start()
        else:
            claiming.add_done_callback(self._granted)

    def _granted(self, claim: asyncio.Future[None]) -> None:
        if not claim.cancelled() and claim.exception() is None:
            self._start()

    def _start(self) -> None:
        if self._leases is not None:
            self._renewals = self._leases.renew_later(self._until)

    def stop(self) -> None:
        if self._claiming is not None:
            self._claiming.remove_done_callback(self._granted)
            self._claiming.add_done_callback(retrieve)
        if self._renewals is not None:
            self._renewals.cancel()


async def post_and_wait(a: Attempt, plan: ReadPlan, posts: list[PostList],
                        staged: list[StagedPlan | None], areas: list[Area | None],
                        claiming: asyncio.Future[None] | None = None) -> ReadOutcome:
    """Post every P rank's transfer, wait for all, scatter what was staged
    (see the module's docstring)."""
    eng, job = a.eng, a.job
    shape = _shape(len(eng.lanes), None if job.verify is None else job.verify.chunk_bytes,
                   plan, posts, areas, claiming)
    if shape.split is None:
        ops, note, agents, merge = post_read(eng, job, a.timeout_s, a.metrics, a.cands, a.peers,
                                             posts, staged, areas, notify=shape.notify,
                                             lanes=shape.lanes)
    else:
        parts = shape.split[0]
        none = [None] * len(parts)
        ops, note, agents, merge = post_read(eng, job, a.timeout_s, a.metrics, a.cands, a.peers,
                                             parts, none, none, notify=False,
                                             lanes=lane_of(len(eng.lanes), parts))
    # Verified: P hashes its pieces while the bytes travel (its hold pins them
    # until this read notifies, which it does only after comparing).
    asked = ask_digests(eng, job, a.cands, a.peers, plan) if job.verify is not None else None
    landed = (None if shape.pipe is None
              else landing(eng, job, [ops[i] for i in shape.pipe[0]], shape.pipe[1]))
    renewing = _Renewing(job.leases, claiming, job.book.renew_until)
    generations = [w.generation for w in eng.lanes]
    try:
        # Cancelled with transfers maybe in flight: areas quarantined, the
        # landing left alone (it waits for parts that may never end).
        results: list[Any] = await _transfers(eng, ops, areas, shape.lanes, generations)
    except BaseException:
        renewing.stop()
        raise
    # Every transfer ended (past this point the caller releases the areas:
    # nothing writes there any more, a refused claim below included).
    try:
        try:
            if shape.split is not None:
                results = joined(results, shape.split[1], len(posts))
            if asked is not None:
                if claiming is not None:
                    await claiming  # notified once verified, below
            elif not shape.notify:
                results = await notify_after_grant(eng, job, claiming, posts, agents, note,
                                                   merge, results, a.metrics)
        finally:
            renewing.stop()
        check_results(eng, job, a.metrics, posts, results, notified=shape.notify)
        if job.abort_reason is None and any(area is not None for area in areas):
            await _scatter(a, staged, areas)
        if asked is not None and job.abort_reason is None:
            await verified(eng, job, asked, a.metrics, landed)
            notify_ended(eng, job, posts, agents, note, merge, results, a.metrics)
        return outcome_of(plan, posts, results)
    finally:
        if landed is not None:
            # Not compared (aborted, a part failed): its hashes of the parts that
            # landed may still be starting. The read's task ends after them, so
            # an engine's drop (which waits for this task, then for its hashing,
            # then unmaps) never unmaps memory under a hash.
            await ended(landed)


async def _transfers(eng: ReaderRank, ops: list[asyncio.Future[Any]],
                     areas: list[Area | None], lanes: list[int] | None,
                     generations: list[int]) -> list[Any]:
    """Every transfer's outcome (:func:`outcomes`). Cancelled meanwhile, with
    transfers maybe in flight, the staged areas are quarantined."""
    try:
        return await outcomes(ops)
    except BaseException:
        _quarantine(eng, areas, lanes, generations)
        raise


def _quarantine(eng: ReaderRank, areas: list[Area | None], lanes: list[int] | None,
                generations: list[int]) -> None:
    """Cancelled with transfers maybe in flight: their areas stay out of use
    until a reset of the lane carrying each has provably killed them."""
    if eng.staging is None:
        return
    for i, area in enumerate(areas):
        if area is not None:
            lane = 0 if lanes is None else lanes[i]
            eng.staging.quarantine(area, generations[lane], lane)
            areas[i] = None


async def _scatter(a: Attempt, staged: list[StagedPlan | None],
                   areas: list[Area | None]) -> None:
    """Only now, every transfer DONE and the lease valid, do engine blocks get
    the staged bytes. Off the loop; never abandoned half way (the engine must
    not get a completion while its blocks are still being written)."""
    t_scatter = time.perf_counter()
    scattering = in_executor(a.planner, _scatter_all, a.eng, staged, areas)
    try:
        await asyncio.shield(scattering)
    except asyncio.CancelledError:
        await asyncio.wait([scattering])
        raise
    if a.metrics is not None:
        a.metrics.series(a.metrics.scatter_seconds, a.eng.engine_id).observe(
            time.perf_counter() - t_scatter)


def _scatter_all(eng: ReaderRank, staged: list[StagedPlan | None],
                 areas: list[Area | None]) -> None:
    """Copy every staged piece into the engine's blocks (planning thread)."""
    pool = eng.staging
    assert pool is not None
    views = [r.numpy() for r in eng.regions]
    for sp, area in zip(staged, areas):
        if sp is not None and area is not None:
            scatter(pool.view(area), sp.src, sp.dst, sp.size, eng.bases, views)


async def post_all(eng: ReaderRank, ready: list[tuple[ReadJob, ReadPlan, list[PostList]]],
                    cands: Sequence[int], peers: list[Peer], timeout_s: float | None,
                    metrics: Metrics | None, settle: Settle) -> None:
    """Post every ready read of a group (the worker merges them), each completed
    from its own transfers' callbacks through ``settle``; returns once every
    transfer ended (see the module's docstring)."""
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
    if bugs:  # the group's task fails with it: its owner logs it and ends every read left
        raise bugs[0]


class _Renewals:
    """The lease renewals of a group's posted reads: one timer for all of them
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
        pending is abandoned); the timer goes with the group's last read."""
        self._running.discard(waiting)
        if waiting.renewing is not None:
            waiting.renewing.cancel()
        if not self._running and self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _Waiting:
    """One posted read of a group: completed from its own transfers' callbacks,
    as soon as the last of them ends (never later than its group's others).

    It runs as a future's done callback, where an exception would only be
    logged by asyncio as "Exception in callback" and the read left for the
    group's end to complete as if cancelled. So what ``settle`` raises (a bug)
    goes to ``bugs``: :func:`post_all` raises the first once every transfer
    ended, and the group's owner logs it and completes each read still open
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
        #: its renewals, once the group's timer started them
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
            # group's end, reported "aborted before posting").
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

