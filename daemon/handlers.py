"""Answers to engine requests: one handler per request type, chosen by a table.

Every handler returns within microseconds: it validates, records and hands
work to a task (reads), the hold book (holds) or a worker thread (NIXL).
Registration and deregistration are the exceptions: they await memory
mapping, NIXL registration or draining reads; the engine server runs each
request in its own task, so only their caller waits. What a handler may
touch is in its :class:`Context`, nothing else.

:meth:`Handlers.handle` counts every request by type and error code, and a
stopping sidecar answers requests that would start new work ``unavailable``
(a copy of a hold or read it already took still meets ``duplicate``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvsidecar import __version__
from kvsidecar.daemon import keeps
from kvsidecar.daemon.background import Alarm, Background
from kvsidecar.daemon.d_side.table import ReadTable, duplicate_read
from kvsidecar.daemon.engine_access import current_peer
from kvsidecar.daemon.engines.departures import Departures
from kvsidecar.daemon.engines.rank import EngineRank
from kvsidecar.daemon.engines.registry import Registry
from kvsidecar.daemon.engines.table import EngineTable, mine
from kvsidecar.daemon.observability import Health, TransportChecks
from kvsidecar.daemon.p_side.spans import HoldSpans
from kvsidecar.daemon.peers.addresses import check_address
from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.planner import PlanError, check_block_ids
from kvsidecar.daemon.settings import Settings
from kvsidecar.daemon.state import DaemonState
from kvsidecar.daemon.status import checks_of, engine_status, sees, transport_of
from kvsidecar.ipc import hold_token
from kvsidecar.ipc.protocol import (
    BAD_REQUEST,
    DUPLICATE,
    INTERNAL,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    UNAVAILABLE,
    Batch,
    Deregister,
    Error,
    Held,
    Hold,
    Keep,
    Ok,
    Ping,
    Poll,
    Pong,
    Read,
    Register,
    Release,
    RemoteEngine,
    Replies,
    Reply,
    Request,
    RequestError,
    Reserve,
    Status,
    StatusReport,
)
from kvsidecar.metrics.registry import Metrics

log = logging.getLogger(__name__)

MAX_WAITING_POLLS = 4
"""Polls that may wait at once per engine rank (``Poll.wait_s``); more are
answered at once and counted (``kvsidecar_limit_refusals_total{limit="waiting_polls"}``)."""
#: Peer addresses remembered as checked (a set lookup per read instead of a check);
#: past it the set starts over.
MAX_DIALABLE = 4096


def _hold_taken(eng: EngineRank, req: Hold) -> str | None:
    """Why ``req`` is a copy of a hold this rank took (its first answer lost),
    or None: the hold is open, or it was placed and has ended while that end's
    completion awaits the engine's poll. The engine learns the end from that
    completion and then frees the blocks, so a second hold would pin them for
    nobody while they are reused, and grant a late reader another request's
    bytes."""
    key = (req.engine_id, req.request_id)
    if key in eng.holds:
        return f"request {req.request_id!r} is already held for engine {req.engine_id!r}"
    if eng.holds.ended_held(*key) and eng.has_completion(req.request_id):
        return (f"request {req.request_id!r} was held for engine {req.engine_id!r} and that "
                "hold has ended; its completion awaits a poll")
    return None


_REFUSED_WHILE_STOPPING: frozenset[type[Request]] = frozenset({Register, Read, Hold, Reserve})
"""Requests that would start new work; a stopping sidecar answers ``unavailable``
(but a copy of a hold or read it took: see :meth:`Handlers._sent_again`)."""


@dataclass
class Context:
    """What the handlers act on: the engine table and its registry and
    departures, the read table, hold tracing, the background tasks, the
    housekeeping alarm, and the facts a status report shows."""

    settings: Settings
    metrics: Metrics
    state: DaemonState
    table: EngineTable
    registry: Registry
    departures: Departures
    reads: ReadTable
    hs_client: HandshakeClient
    spans: HoldSpans
    background: Background
    alarm: Alarm
    health: Health
    transport: TransportChecks


class Handlers:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        #: One handler per request type (each takes exactly that type).
        self.table: dict[type[Request], Callable[[Any], Awaitable[Reply]]] = {
            Register: ctx.registry.register, Deregister: self.deregister, Read: self.read,
            Hold: self.hold, Release: self.release, Poll: self.poll, Ping: self.ping,
            Reserve: ctx.registry.reserve, Batch: self.batch, Status: self.status,
            Keep: self.keep,
        }
        #: the requests counter's series per (request type, error code): both closed
        #: sets, looked up once instead of labels() for every item of every batch
        self._request_series: dict[tuple[type, str], Any] = {}
        #: peer addresses reads named that passed check_address (at most MAX_DIALABLE)
        self._dialable: set[str] = set()
        #: the Keep claims in flight (bounded per engine and in all)
        self._keeping = keeps.KeepBook(on_refused=lambda engine_id: ctx.metrics.limit_refusals
                                       .labels(engine_id, "keep_claims").inc())

    async def handle(self, req: Request) -> Reply:
        """Answer one engine request through the handler its type names."""
        kind = type(req)
        error: str | None = ""
        try:
            if (self.ctx.state.stopping and kind in _REFUSED_WHILE_STOPPING
                    and not self._sent_again(req)):
                raise RequestError(UNAVAILABLE, "the sidecar is shutting down")
            handler = self.table.get(kind)
            if handler is None:
                raise RequestError(BAD_REQUEST, f"unsupported request {kind.__name__}")
            return await handler(req)
        except RequestError as e:
            error = e.code
            if kind is Hold:
                self._hold_refused(req, e.code, str(e))
            raise
        except asyncio.CancelledError:
            error = None  # not answered (a waiting poll whose connection closed): no count
            raise
        except BaseException as e:
            error = "internal"
            if kind is Hold and isinstance(e, Exception):
                self._hold_refused(req, INTERNAL, f"{type(e).__name__}: {e}")
            raise
        finally:
            # op comes from the closed set of request types, error from ERROR_CODES.
            if error is not None:
                self._count(kind, error)

    def _sent_again(self, req: Request) -> bool:
        """Whether ``req`` is a copy of a hold or read this sidecar took (its first
        answer lost): a hold of this engine's that is open, or ended with its
        completion unpolled, or a read in progress. A stopping sidecar lets it
        reach its handler, which answers ``duplicate``, as before every other
        refusal: ``unavailable`` would tell the engine that nothing is held or
        read, and it would free (and reuse) blocks the draining sidecar still
        serves to a reader, or still writes into."""
        if type(req) is not Hold and type(req) is not Read:
            return False
        eng = self.ctx.table.ranks.get(req.engine_id)
        if eng is None or not mine(eng):
            return False
        if type(req) is Hold:
            return _hold_taken(eng, req) is not None
        return self.ctx.reads.reading(req.engine_id, req.request_id)

    def _count(self, kind: type, error: str) -> None:
        series = self._request_series.get((kind, error))
        if series is None:
            series = self._request_series[(kind, error)] = self.ctx.metrics.requests.labels(
                op=kind.__name__.lower(), error=error)
        series.inc()

    async def batch(self, req: Batch) -> Reply:
        """Answer each item as if it came alone, in order; a refusal (or a bug)
        answers that item only, so what was accepted before it stays accepted
        and the engine learns which."""
        out: list[Ok | Held | Error] = []
        with self.ctx.reads.together():  # its reads of one remote engine share a task
            for item in req.requests:
                try:
                    reply = await self.handle(item)
                except RequestError as e:
                    reply = Error(e.code, e.message)
                except Exception as e:
                    log.exception("handler failed on %s in a batch (item id %d)",
                                  type(item).__name__, item.id)
                    reply = Error(INTERNAL, f"{type(e).__name__}: {e}")
                if not isinstance(reply, (Ok, Held, Error)):
                    reply = Error(INTERNAL, f"handler returned {type(reply).__name__}")
                reply.id = item.id
                out.append(reply)
        return Replies(items=out)

    # ------------------------------------------------------------ D side

    async def read(self, req: Read) -> Reply:
        eng = self.ctx.table.engine(req.engine_id)
        if req.remote.engine_id == req.engine_id:
            # Its own agent would be loaded into itself as a peer (a whole UCX
            # state) only to fail later with an error about something else.
            raise RequestError(BAD_REQUEST, f"engine {req.engine_id[:200]!r} asked to read "
                                            "from itself (the remote engine is the reading "
                                            "engine): its KV cache is already here")
        self._check_addresses(req.remote)
        reads = self.ctx.reads
        if reads.reading(req.engine_id, req.request_id):
            # Before the limits: a read sent again (a client's after a lost
            # connection) learns it is already reading, not that it is refused.
            raise duplicate_read(req.request_id)
        self._admit(eng, "reads", reads.count(eng.engine_id),
                    self.ctx.settings.max_reads_per_engine, "reads in flight")
        reads.accept(eng, req)
        return Ok()

    async def keep(self, req: Keep) -> Reply:
        """Keep the holds of requests the engine admitted (see daemon/keeps.py):
        the claims go out in the background; answered at once.
        Checked as a read's remote is, and bounded (see daemon/keeps.py): the
        claims one Keep asks for, and those in flight per engine and in all."""
        eng = self.ctx.table.engine(req.engine_id)
        claims = keeps.check_items(req.items, eng.tp_rank, eng.layout.tp_size)
        for item in req.items:
            self._check_addresses(item.remote)
        if claims:
            self._keeping.admit(eng.engine_id, claims)
            self.ctx.background.spawn(self._keep_claims(eng, req, claims))
        return Ok()

    async def _keep_claims(self, eng: EngineRank, req: Keep, claims: int) -> None:
        try:
            granted = await keeps.keep(self.ctx.hs_client, req.items, eng.engine_id,
                                       eng.tp_rank, eng.layout.tp_size)
        finally:
            self._keeping.done(eng.engine_id, claims)
        log.debug("engine %r kept %d request(s): %d of %d claim(s) granted", eng.engine_id,
                  len(req.items), granted, claims)

    def _check_addresses(self, remote: RemoteEngine) -> None:
        """Refuse a read (or keep) naming a peer address that is not ``host:port``
        in printable ASCII (see check_address); remember good ones (bounded), so
        the check costs a set lookup per address."""
        for address in remote.handshake:
            if address in self._dialable:
                continue
            try:
                check_address(address)
            except ValueError as e:
                raise RequestError(BAD_REQUEST, str(e)) from None
            if len(self._dialable) >= MAX_DIALABLE:
                self._dialable.clear()
            self._dialable.add(address)

    def _admit(self, eng: EngineRank, limit: str, used: int, bound: int, what: str) -> None:
        """Refuse new work that would pass a per-engine bound, and work whose
        completion could not be queued (every accepted read or hold ends in
        exactly one completion, so bounding reads + holds + unpolled
        completions bounds the queue without ever dropping a completion)."""
        queued = len(eng.completions) + self.ctx.reads.count(eng.engine_id) + len(eng.holds)
        cap = self.ctx.settings.max_completions_per_engine
        if queued >= cap:
            limit, used, bound = "completions", queued, cap
            what = "reads, holds and unpolled completions"
        elif used < bound:
            return
        self.ctx.metrics.limit_refusals.labels(eng.engine_id, limit).inc()
        raise RequestError(UNAVAILABLE, f"engine {eng.engine_id!r} has {used} {what}, the "
                                        f"limit is {bound} (--max-{limit}-per-engine); poll "
                                        "completions or retry later")

    # ------------------------------------------------------------ P side

    def _hold_refused(self, req: Request, code: str, why: str) -> None:
        """A hold was refused (at any point, shutdown included): the engine may
        have issued its token itself and frees the blocks on hearing of it, so
        its sidecar refuses the claims of that request from now on (see
        :meth:`HoldBook.refused`). Nothing for a ``duplicate`` (the hold is
        placed) or for an engine the sender may not see."""
        if code == DUPLICATE or not isinstance(req, Hold):
            return
        eng = self.ctx.table.ranks.get(req.engine_id)
        if eng is not None and mine(eng):
            eng.holds.refused(req.engine_id, req.request_id, why, time.monotonic())

    async def hold(self, req: Hold) -> Reply:
        """Place a hold and answer its lease and token. A request id this engine
        holds, or held until an end whose completion it has not yet acknowledged,
        meets ``duplicate``: that is the same hold sent again (its first answer
        lost), so it never pins the blocks a second time; its one completion
        says how it ends (or ended)."""
        ctx = self.ctx
        eng = ctx.table.engine(req.engine_id)
        now = time.monotonic()
        taken = _hold_taken(eng, req)
        if taken is not None:  # before the limits: `duplicate`, not `unavailable`
            raise RequestError(DUPLICATE, taken)
        open_holds = len(eng.holds)
        if eng.holds.claimed_early(req.engine_id, req.request_id, now):
            # A hold a reader already claimed (its token came first) is placed past
            # the holds limit: the reader may be copying its blocks now. The bound
            # on reads + holds + unpolled completions still applies.
            open_holds = 0
        self._admit(eng, "holds", open_holds, ctx.settings.max_holds_per_engine,
                    "holds open")
        try:
            check_block_ids(eng.layout, req.block_ids, "held")
        except PlanError as e:
            raise RequestError(BAD_REQUEST, str(e)) from None
        held = hold_token.blocks_digest(req.block_ids)
        timeout = req.timeout_s or eng.holds.default_timeout_s
        # Valid as long as a lease on the hold can run (see HoldBook.claim).
        life = max(timeout, eng.holds.max_life_s) + eng.holds.lease_s
        token = hold_token.issue_digested([eng.hold_key], req.engine_id, req.request_id,
                                          held, math.ceil(time.time() + life), sidecar=True)[0]
        eng.holds.add(req.engine_id, req.request_id, eng.layout.tp_size, req.readers,
                      req.timeout_s, now, digest=held, block_ids=req.block_ids)
        try:
            eng.worker.set_hot(True)
            # housekeeping now watches this hold's deadline (no wake-up when it
            # is due after the pass planned: holds share a timeout as a rule)
            ctx.alarm.poke(eng.holds.due(req.engine_id, req.request_id) or now)
            ctx.spans.start(req.engine_id, req.request_id, eng.tp_rank, req.readers)
        except Exception:
            # The engine is told this hold failed: it must not stand (a bug here).
            eng.holds.withdraw(req.engine_id, req.request_id)
            raise
        return Held(lease_s=eng.holds.lease_s, timeout_s=timeout, token=token)

    async def release(self, req: Release) -> Reply:
        eng = self.ctx.table.engine(req.engine_id)
        if self.ctx.reads.abort(req.engine_id, req.request_id, "released by the engine"):
            return Ok()
        if eng.holds.release(req.engine_id, req.request_id, time.monotonic()):
            self.ctx.spans.end(req.engine_id, req.request_id, "released")
            due = eng.holds.due(req.engine_id, req.request_id)
            if due is not None:  # released under a lease: it ends when that does
                self.ctx.alarm.poke(due)
            return Ok()
        if eng.has_completion(req.request_id):
            return Ok()  # it ended just before the release; its completion says how
        raise RequestError(BAD_REQUEST, f"no read or hold {req.request_id!r} in progress for "
                                        f"engine {req.engine_id!r}")

    # ------------------------------------------------------------ either side

    async def poll(self, req: Poll) -> Reply:
        eng = self.ctx.table.engine(req.engine_id)
        if (req.ack is not None and eng.completions and req.epoch == eng.epoch
                and req.ack > eng.completions[-1][0]):
            # Acknowledging past the newest completion can only be a bug: it would
            # drop, unseen, every completion numbered up to it (now and later).
            raise RequestError(BAD_REQUEST, f"ack {req.ack} is past the newest completion "
                                            f"({eng.completions[-1][0]}); ack the 'last' of "
                                            "a previous reply (nothing was dropped)")
        reply = eng.poll(req.ack, req.epoch)
        if reply.items or req.wait_s <= 0 or self.ctx.state.stopping:
            return reply
        if eng.waiting_polls >= MAX_WAITING_POLLS:
            # Answered at once rather than refused: a poll may always return early.
            self.ctx.metrics.limit_refusals.labels(eng.engine_id, "waiting_polls").inc()
            return reply
        await eng.wait_for_completion(req.wait_s)
        return eng.poll(req.ack, req.epoch)

    async def deregister(self, req: Deregister) -> Reply:
        ctx = self.ctx
        peer = current_peer.get()
        ctx.table.refuse_releasing(req.engine_id)  # its reads may still land in it
        if (req.engine_id not in ctx.table.ranks
                and ctx.registry.reservations.of(req.engine_id, peer.uid if peer else None)):
            await ctx.departures.drop_reservation(req.engine_id)  # reserved, never registered
            return Ok()
        ctx.table.engine(req.engine_id)
        # Shielded: a caller that gives up (or a shutdown) must not cut the
        # release short between forgetting the engine and freeing its memory.
        await asyncio.shield(ctx.background.spawn(ctx.departures.drop_engine(
            req.engine_id, f"deregistered by the engine ({req.mode})",
            drain=req.mode == "drain")))
        return Ok()

    async def ping(self, req: Ping) -> Reply:
        """Version, this uid's engines, and the keepalive of ``req.engines``: each
        of them registered here by this uid has its liveness lease renewed (an
        engine idle between requests stays alive for as long as its process
        pings; one that is gone is simply not listed back, once nothing of its
        registration can still write into its memory)."""
        ranks = self.ctx.table.ranks
        if req.engines:
            now = time.monotonic()
            for engine_id in req.engines:
                eng = ranks.get(engine_id)
                if eng is not None and mine(eng):
                    eng.last_seen = now
        return Pong(version=PROTOCOL_VERSION, minor=PROTOCOL_MINOR,
                    engines=self.ctx.table.listed(),
                    engine_lease_s=self.ctx.settings.engine_lease_s)

    async def status(self, req: Status) -> Reply:
        """``kvsidecar status``: one snapshot, built on the loop (daemon/status.py)."""
        ctx = self.ctx
        now = time.monotonic()
        asker = current_peer.get()
        checks = ctx.health.readiness()
        path, detail = transport_of(ctx.settings.transport_check, ctx.transport.host,
                                    ctx.transport.vram, ctx.state.gpu is not None)
        engines = [engine_status(eng, ctx.reads.count(e), ctx.reads.oldest_age(e, now), now)
                   for e, eng in sorted(ctx.table.ranks.items()) if sees(asker, eng)]
        drain = ctx.table.drain
        return StatusReport(
            version=__version__, daemon_id=ctx.state.daemon_id,
            uptime_s=round(now - ctx.state.created, 3), socket=ctx.settings.socket,
            handshake_address=ctx.state.handshake_address, ready=all(c.ok for c in checks),
            draining=ctx.state.stopping, transport=path, transport_detail=detail,
            checks=checks_of(checks), engines=engines, engines_draining=len(drain),
            drain_bytes=drain.nbytes)
