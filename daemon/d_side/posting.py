"""D side: handing a read's posts to the worker and what follows them.

:func:`post_read` hands every P rank's post of one read to the worker (lanes,
staged areas, notification attached or deferred); :func:`check_results`
counts the transfers and decides, through the read's book, whether it stands,
failed whole, or failed partially; :func:`notify_ended` and
:func:`notify_after_grant` send the deferred notifications (posted during the
claim, over lanes, or verified) from lane 0; :func:`outcome_of` is what a
received read reports.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsidecar.daemon import notifications
from kvsidecar.daemon.d_side.addresses import PostList
from kvsidecar.daemon.d_side.book import Transfers
from kvsidecar.daemon.d_side.job import PartialReadError, ReadJob, ReadOutcome
from kvsidecar.daemon.d_side.rank import ReaderRank
from kvsidecar.daemon.d_side.series import count_transfers
from kvsidecar.daemon.peers.links import Peer
from kvsidecar.daemon.planner import ReadPlan
from kvsidecar.daemon.staging import Area
from kvsidecar.daemon.staging_plan import StagedPlan
from kvsidecar.daemon.transport.worker import NotifyOp, ReadOp, TransferStats
from kvsidecar.ipc.protocol import TransferReport
from kvsidecar.metrics.registry import Metrics

#: the read path logs as kvsidecar.daemon.reads (what log filters name)
log = logging.getLogger("kvsidecar.daemon.reads")

_LANE = [str(k) for k in range(16)]  # label values, not formatted per post


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


def post_read(eng: ReaderRank, job: ReadJob, timeout_s: float | None,
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
    :mod:`~kvsidecar.daemon.d_side.waiting`. Staged posts (``areas[i]`` given)
    read into their area: ``posts[i]`` is replaced by the staged addresses.
    ``targets``: of ``cands`` and ``peers``, when the caller already has them (a
    batch). ``lanes``: the lane of each post
    (:func:`~kvsidecar.daemon.d_side.parts.lane_of`; None: all on lane 0); only
    with ``notify=False``, as P accepts notifications from lane 0 alone."""
    if lanes is not None and notify:
        raise ValueError("posts spread over lanes carry no notification")
    req = job.req
    remote = req.remote
    if metrics is not None:
        metrics.series(metrics.read_queue_seconds, eng.engine_id).observe(
            time.monotonic() - job.accepted_at)
    note = notifications.encode(remote.engine_id, req.remote_request_id or req.request_id,
                                eng.engine_id, eng.tp_rank, eng.layout.tp_size)
    t = targets or targets_of(cands, peers)
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
            lane = 0 if lanes is None else lanes[i]
            if lanes is not None and metrics is not None:
                metrics.series(metrics.lane_transfers, eng.engine_id, _LANE[lane]).inc()
            if lane:
                workers[i] = eng.lanes[lane]
            todo.append(_read_op(eng, t, post, lane, attached, timeout_s))
        else:
            todo.append(NotifyOp(t.agents[post.rank], note, t.merge[post.rank])
                        if notify else None)
    job.book.posted_at(time.monotonic())
    # All or nothing of this read is handed over (nothing above posts), together
    # with every other read's posts of this loop iteration as one worker job;
    # each keeps its own outcome. Posts to a peer that advertised batched
    # notifications share one transfer and notification with the other reads'
    # posts to that agent (a failed transfer fails every read in it); a read
    # refused at claim time never gets here, so it never joins one.
    ops = [w.post_soon(op) if op is not None else nothing_posted()
           for w, op in zip(workers, todo)]
    return ops, note, t.agents, t.merge


def _read_op(eng: ReaderRank, t: Targets, post: PostList, lane: int, notif: bytes | None,
             timeout_s: float | None) -> ReadOp:
    """The worker's READ of one post with bytes, on ``lane`` (its agent's
    generation there), carrying ``notif`` when the notification rides along."""
    far = t.infos[post.rank]
    gen = t.peers[post.rank].generation_of(lane) if lane else t.gens[post.rank]
    return ReadOp(t.agents[post.rank], post.local, post.remote, post.length,
                  notif=notif, timeout_s=timeout_s, generation=gen,
                  mem_type=eng.info.mem_type, dev_id=eng.info.dev_id,
                  remote_mem_type=far.mem_type, remote_dev_id=far.dev_id,
                  merge=t.merge[post.rank])


def check_results(eng: ReaderRank, job: ReadJob, metrics: Metrics | None,
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
    # Notified with DONE transfers, P has been told this read ended: a failure
    # from here on (the lease ran out) sends no abandon; beside the notification
    # it could reach P first and end a hold that was read as aborted.
    verdict = job.book.transfers_ended(len(errors), len(results), notified=notified)
    if verdict is Transfers.PARTIAL:
        # Some ranks were read and notified: their holds may be released already,
        # so this read must not be retried as a whole. (Posted during its claim,
        # nothing was notified: a failure there fails or retries it whole.)
        raise PartialReadError(
            f"{len(errors)} of {len(results)} remote ranks failed ({errors[0]}); the others "
            "were read and notified"
        ) from errors[0]
    if errors:
        raise errors[0]
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


async def notify_after_grant(eng: ReaderRank, job: ReadJob,
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
    posting (:func:`~kvsidecar.daemon.d_side.parts.lane_of`); only lane 0
    (``eng.worker``) notifies, as P accepts notifications from the agent its
    handshake declared alone."""
    if claiming is not None:
        await claiming
    notify_ended(eng, job, posts, agents, note, merge, results, metrics)
    return results


def notify_ended(eng: ReaderRank, job: ReadJob, posts: list[PostList], agents: dict[int, str],
                 note: bytes, merge: dict[int, int], results: list[Any],
                 metrics: Metrics | None) -> None:
    """Every transfer of a read posted without notifications ended (and its claim,
    if any, was granted): unless one failed, notify every P rank from lane 0
    (``eng.worker``, the agent P's handshake declared), without waiting for the
    notifications to leave. A failed transfer notifies no one: the read fails or
    is retried whole, and the abandon tells P."""
    if any(isinstance(r, BaseException) for r in results):
        return
    job.book.notify()
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


async def _notify_relinked(eng: ReaderRank, old: Peer, note: bytes, merge: int,
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


def nothing_posted() -> asyncio.Future[None]:
    """The outcome of a rank nothing was posted to yet (notified after the grant)."""
    f: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    f.set_result(None)
    return f
