"""D side: every accepted read of this sidecar (:class:`ReadTable`, what the
service uses), from acceptance to its completion: validation, gathering the
reads of one message or of messages queued together (:meth:`ReadTable.together`),
starting them in groups, each carried by one task through
:func:`~kvsidecar.daemon.d_side.driver.run_group` (a read alone is a group of
one), retries, aborts and completions.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass

from kvsidecar.daemon import digest, verify
from kvsidecar.daemon.d_side.addresses import (
    INLINE_PLAN_PIECES,
    INLINE_PLAN_PIECES_ALONE,
    plan_and_address,
    plan_and_address_many,
)
from kvsidecar.daemon.d_side.book import (
    Completed,
    Outcome,
    ReadBook,
    drops_links,
    goes_on_alone,
)
from kvsidecar.daemon.d_side.driver import POST_FIRST_BLOCKS, run_group
from kvsidecar.daemon.d_side.job import (
    ReadJob,
    ReadOutcome,
    claims_of,
    completion,
    failure_of,
    log_fields,
)
from kvsidecar.daemon.d_side.parts import SPLIT_MIN_BYTES
from kvsidecar.daemon.engines import EngineRank
from kvsidecar.daemon.leases import LeaseLost, ReaderLeases
from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.planner import PlanError, candidate_ranks, check_block_ids
from kvsidecar.daemon.spent_tokens import SpentTokens
from kvsidecar.daemon.thread_groups import ThreadGroups
from kvsidecar.daemon.tracing import Tracing
from kvsidecar.ipc.protocol import (
    BAD_REQUEST,
    DUPLICATE,
    UNAVAILABLE,
    Completion,
    Read,
    RequestError,
)
from kvsidecar.metrics.registry import Metrics

#: the read path logs as kvsidecar.daemon.reads (what log filters name)
log = logging.getLogger("kvsidecar.daemon.reads")


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


def goes_alone(eng: EngineRank, job: ReadJob) -> bool:
    """A read that starts alone even among others of its message or burst: a
    verified one (pipelined per digest chunk), or, over several lanes
    (``--post-lanes``), one whose local blocks come to :data:`SPLIT_MIN_BYTES`
    or more (alone it may be cut into a part per lane; in a group it would be
    posted whole on lane 0)."""
    if job.verify is not None:
        return True
    if len(eng.lanes) < 2:
        return False
    layout = eng.layout
    blocks = sum(map(len, job.req.local_block_ids))
    return blocks * layout.page_bytes * layout.num_regions >= SPLIT_MIN_BYTES


def by_size(jobs: list[ReadJob]) -> list[list[ReadJob]]:
    """``jobs`` split into the small reads (at most ``POST_FIRST_BLOCKS``
    local blocks) and the others, each in order, empty ones left out. A small
    read gathered with large ones waited for all of their claims and plans
    and then rode in their merged READ, so it never joins them: with 64
    16-block reads in flight, 1-block p50 / p99 8.6-10.5 / 23-28 ms gathered
    against 6.3-8.1 / 13-19 ms apart (benchmarks/tail_under_load.py,
    docs/performance.md "A 1-block read under load")."""
    small: list[ReadJob] = []
    large: list[ReadJob] = []
    for j in jobs:
        (small if sum(map(len, j.req.local_block_ids)) <= POST_FIRST_BLOCKS else large).append(j)
    return [kind for kind in (small, large) if kind]


#: no upper bound on acceptance (remote ids are ranged when planned)
_ANY_INT64_ID = 1 << 63
#: What a read without any hold token says besides the count: the usual cause is
#: a version skew (an engine client, or a P engine, from before hold tokens).
NO_TOKENS_SKEW = ("; none at all is what an engine client or a P engine from before "
                  "protocol minor 11 (kvsidecar before hold tokens) sends: that version "
                  "skew is refused, upgrade it (docs/operations.md, Rolling upgrades)")


def _hold_read(req: Read) -> tuple[str, str, str]:
    """Which hold ``req`` reads, for whom: (engine, remote engine, remote request)."""
    return req.engine_id, req.remote.engine_id, req.remote_request_id or req.request_id


def duplicate_read(request_id: str) -> RequestError:
    """The refusal of a read whose request id is already reading."""
    return RequestError(DUPLICATE, f"read {request_id!r} is already in progress")


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
        self._plans = ThreadGroups(planner, many={plan_and_address: plan_and_address_many},
                                   inline_cost=INLINE_PLAN_PIECES,
                                   inline_alone=INLINE_PLAN_PIECES_ALONE)
        self._metrics = metrics
        #: set by the Sidecar when tracing is configured
        self.tracing: Tracing | None = None
        self._handshakes = handshakes
        self._timeout_s = read_timeout_s
        self._deliver = deliver
        self._jobs: dict[tuple[str, str], ReadJob] = {}
        #: (engine, remote engine, remote request) -> the read of it in progress: P
        #: counts one reading rank's notification once, so a second read of the
        #: same hold by the same rank could still be copying when the first one's
        #: notification ends the hold
        self._reading: dict[tuple[str, str, str], str] = {}
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

    def reading(self, engine_id: str, request_id: str) -> bool:
        """A read of ``request_id`` by ``engine_id`` is in progress."""
        return (engine_id, request_id) in self._jobs

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
            raise duplicate_read(req.request_id)
        r = req.remote
        if len(r.handshake) != r.tp_size:
            raise RequestError(BAD_REQUEST, f"remote engine {r.engine_id!r} has tp_size "
                                            f"{r.tp_size} but {len(r.handshake)} handshake "
                                            "addresses")
        try:
            candidate_ranks(eng.layout.tp_size, eng.tp_rank, r.tp_size)
            check_block_ids(eng.layout, req.local_block_ids, "local")
            # Each page once (what P held); the range is the planner's, against P's
            # layout, so a read fails the same way whether a link is cached or not.
            check_block_ids(eng.layout, req.remote_block_ids, "remote", unique=True,
                            num_blocks=_ANY_INT64_ID)
        except PlanError as e:
            raise RequestError(BAD_REQUEST, str(e)) from None
        if len(req.remote_tokens) != r.tp_size:
            raise RequestError(BAD_REQUEST, (
                f"read {req.request_id[:200]!r} carries {len(req.remote_tokens)} hold tokens "
                f"for {r.tp_size} remote ranks: pass the token each P rank's hold issued "
                "(remote_tokens; vLLM: kv_transfer_params['remote_tokens'])"
                + (NO_TOKENS_SKEW if not req.remote_tokens else "")))
        of = _hold_read(req)
        reading = self._reading.get(of)
        if reading is not None:
            # Not DUPLICATE: a client resending a read takes that for "the first
            # copy was taken", and this one was not.
            raise RequestError(BAD_REQUEST, (
                f"engine {req.engine_id[:200]!r} is already reading request {of[2][:200]!r} "
                f"of engine {r.engine_id[:200]!r} (read {reading[:200]!r}): one read of a "
                "hold at a time per engine rank"))
        job = ReadJob(req, ReadBook(time.monotonic(), self._timeout_s))
        if req.verify or eng.verify_bytes:
            job.verify = self._verifier_for(eng)
        job.replayed = not self._spent.first_use(req.remote_tokens, time.time())
        self._jobs[key] = job
        self._reading[of] = req.request_id
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
        e.g. a Batch, or those of the messages one wake-up reads from a connection:
        the engine server enters this around each burst): those of one engine
        rank that read the same remote engine over links already made share one
        task (a group, see :mod:`~kvsidecar.daemon.d_side.driver`), the others
        start one task each (a group of one) as :meth:`accept` alone would.

        What is gathered lives in a context variable, i.e. per asyncio task (or
        reader callback): should a handler inside ever suspend, the reads other
        connections' tasks accept meanwhile start at once as usual, instead of
        joining this message's group and waiting for its end."""
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
            alone = [goes_alone(eng, job) for job in jobs]
            for job, by_itself in zip(jobs, alone):
                if by_itself:
                    self._start_one(eng, job)
            jobs = [job for job, by_itself in zip(jobs, alone) if not by_itself]
            for kind in by_size(jobs):
                if len(kind) > 1 and self._links_made(eng, kind):
                    self._start_group(eng, kind)
                else:
                    for job in kind:
                        self._start_one(eng, job)

    def _aborted_unstarted(self, eng: EngineRank, job: ReadJob) -> bool:
        """A read released in the message that asked for it ends before it starts."""
        if job.abort_reason is None:
            return False
        self._end_unposted(eng, job)
        return True

    def _links_made(self, eng: EngineRank, jobs: list[ReadJob]) -> bool:
        """``jobs`` may go as one group of several: their links all made,
        nothing staged, nothing traced (what only a read alone does)."""
        if eng.staging is not None or (self.tracing is not None and self.tracing.enabled):
            return False
        r = jobs[0].req.remote
        return all(eng.peers.cached(r.handshake[p], r.engine_id, r.tp_size, p) is not None
                   for p in candidate_ranks(eng.layout.tp_size, eng.tp_rank, r.tp_size))

    def _start_one(self, eng: EngineRank, job: ReadJob,
                   failed: BaseException | None = None) -> None:
        """Start a read alone: a group of one (``failed``: its first attempt,
        made in a group, failed so)."""
        self._start_group(eng, [job], failed)

    def _start_group(self, eng: EngineRank, jobs: list[ReadJob],
                     failed: BaseException | None = None) -> None:
        task = asyncio.ensure_future(self._run(eng, jobs, failed))
        if len(jobs) > 1:
            self._metrics.series(self._metrics.batched_reads, eng.engine_id).inc(len(jobs))
        for job in jobs:
            job.task = task
            # a read of several aborted before posting ends alone and at once
            # (cancelling the task would end them all); a read alone is cancelled
            job.on_abort = functools.partial(self._end_unposted, eng) if len(jobs) > 1 else None
        # A task cancelled before its first step never runs its body; the
        # callback still reports it and frees the request id.
        task.add_done_callback(functools.partial(self._group_done, eng, jobs))

    def _settle(self, eng: EngineRank, t0: float, job: ReadJob,
                got: ReadOutcome | BaseException) -> None:
        """A read of a group of several ended: complete it, or, when the failure
        is one a fresh handshake may cure, carry it on alone (:meth:`_attempts`
        decides)."""
        if job.ended:
            return
        if isinstance(got, Exception) and goes_on_alone(failure_of(got)):
            self._start_one(eng, job, got)
            return
        self._complete(eng, job, got, t0)

    def _group_done(self, eng: EngineRank, jobs: list[ReadJob], task: asyncio.Task[None]
                    ) -> None:
        """Nothing of the group runs any more: a read it still owns (cancelled,
        or a bug) gets its completion here, so none is lost (a read cancelled
        with nothing posted ends ``aborted``, P told)."""
        err = None if task.cancelled() else task.exception()
        if err is not None:
            log.error("a group of %d reads of engine %r failed", len(jobs), eng.engine_id,
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

    def _end_unposted(self, eng: EngineRank, job: ReadJob) -> None:
        """A read that posted nothing ends ``aborted`` (P told) at once."""
        done = job.book.end(Outcome.CANCELLED)
        self._close(eng, job, done, completion(job.req, done))

    def _close(self, eng: EngineRank, job: ReadJob, done: Completed, c: Completion) -> None:
        """Its completion out: P told when it did not receive, then delivered."""
        self._tell_p(eng, job, done)  # nothing of this read is in flight any more
        self._finish(eng, job, c)

    def _tell_p(self, eng: EngineRank, job: ReadJob, done: Completed) -> None:
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
        if not done.abandon:
            return
        leases = job.leases or self._unclaimed(eng, job)
        if leases is None:
            return
        for t in leases.abandon(f"{done.kind}: {done.reason}"):
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
        eng.peers.release(job.links)
        if job.tracing is not None:
            job.tracing.end(job.span, outcome=c.kind, bytes=c.nbytes)
        key = (eng.engine_id, job.req.request_id)
        of = _hold_read(job.req)
        if self._reading.get(of) == job.req.request_id:
            del self._reading[of]
        if self._jobs.get(key) is job:
            del self._jobs[key]
            left = self._per_engine[key[0]] - 1
            if left:
                self._per_engine[key[0]] = left
            else:
                del self._per_engine[key[0]]
        self._deliver(eng, c)

    async def _run(self, eng: EngineRank, jobs: list[ReadJob],
                   failed: BaseException | None = None) -> None:
        """A group's task: several reads are settled one by one as each ends
        (:meth:`_settle`); a read alone runs its attempts here, in its task."""
        t0 = time.perf_counter()
        if len(jobs) > 1:
            await run_group(eng, jobs, self._planner, self._plans, self._timeout_s,
                            self._metrics, self._handshakes,
                            functools.partial(self._settle, eng, t0))
            return
        job = jobs[0]
        req = job.req
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
        out = None
        if isinstance(got, asyncio.CancelledError):
            done = job.book.end(Outcome.CANCELLED)
        elif isinstance(got, BaseException):
            reason = f"{type(got).__name__}: {got}"
            log.warning("read %r of engine %r failed: %s", req.request_id, eng.engine_id, reason,
                        extra=log_fields(eng, req, "failed", reason))
            done = job.book.end(Outcome.ERROR, reason)
            if isinstance(got, LeaseLost):
                self._metrics.leases_lost.labels(eng.engine_id).inc()
        else:
            out = got
            done = job.book.end(Outcome.DONE)
            if done.kind == "received":
                if log.isEnabledFor(logging.DEBUG):  # not even its fields otherwise
                    log.debug("read %r of engine %r received %d bytes", req.request_id,
                              eng.engine_id, out.nbytes,
                              extra=log_fields(eng, req, "received", ""))
                self._metrics.series(self._metrics.read_seconds, eng.engine_id).observe(
                    time.perf_counter() - t0, {"request_id": req.request_id[:64]})
        self._close(eng, job, done, completion(req, done, out))

    async def _attempts(self, eng: EngineRank, job: ReadJob,
                        failed: BaseException | None = None) -> ReadOutcome:
        """Run the read, again after a failure a stale link explains (``failed``:
        its first attempt, made in a group of several, failed so). What is retried and how
        often is the book's policy (:meth:`~kvsidecar.daemon.d_side.book.ReadBook.retry`);
        here the links a failure discredits are dropped (:func:`drops_links`),
        and whether one of them predates the request is the policy's input.
        A P engine that registered again refuses leases taken over an old link;
        other refusals (the hold ended) leave the shared links alone."""
        req = job.req
        while True:
            try:
                if failed is not None:
                    first, failed = failed, None
                    raise first
                got = await run_group(eng, [job], self._planner, self._plans, self._timeout_s,
                                      self._metrics, self._handshakes)
                assert got is not None  # a read alone returns its outcome
                return got
            except Exception as e:
                failure = failure_of(e)
                predate = self._forget_peers(eng, job) if drops_links(failure) else False
                if not job.book.retry(failure, predate):
                    raise
                log.info("read %r: %s; retrying with a fresh handshake", req.request_id, e,
                         extra=log_fields(eng, req, "retry", str(e)))

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
