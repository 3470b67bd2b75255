"""The sidecar: wires the engine server, the handshake server and one NIXL worker
per engine rank, and answers engine requests.

Every handler returns within microseconds: it validates, records and hands
work to a task (reads), the hold book (holds) or a worker thread (NIXL).
Registration and deregistration are the exceptions: they await memory
mapping, NIXL registration or draining reads; the engine server runs each
request in its own task, so only their caller waits.

Ownership: this class owns the table of engine ranks; each
:class:`~kvsidecar.daemon.engines.EngineRank` owns its memory, worker, holds,
peer links and completion queue; the
:class:`~kvsidecar.daemon.reads.ReadTable` owns read jobs until their
completion is delivered.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import msgspec
import numpy as np

from kvsidecar import __version__
from kvsidecar.daemon import digest, keeps, memory_kinds, notifications
from kvsidecar.daemon.conn_guard import fd_budget
from kvsidecar.daemon.cuda_device import CudaDevice
from kvsidecar.daemon.d_side.table import ReadTable
from kvsidecar.daemon.drain import DrainBook, Generation, keepable
from kvsidecar.daemon.engine_access import AccessPolicy, current_peer
from kvsidecar.daemon.engine_server import EngineServer
from kvsidecar.daemon.engines import (
    EngineRank,
    map_regions,
    release_regions,
    remove_stale_segments,
    shm_prefix_for,
)
from kvsidecar.daemon.fd_server import FdServer
from kvsidecar.daemon.health import Check, heartbeat
from kvsidecar.daemon.holds import Report
from kvsidecar.daemon.memory_kinds import MemoryContext
from kvsidecar.daemon.peer_auth import load_keys
from kvsidecar.daemon.peers import control as peer_control
from kvsidecar.daemon.peers.addresses import check_address
from kvsidecar.daemon.peers.client import MAX_CONNECTIONS as HANDSHAKE_CLIENT_CONNECTIONS
from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.peers.control import (
    Abandon,
    Claim,
    ControlBatch,
    ControlBatchReply,
    ControlReply,
    ControlRequest,
    Digest,
)
from kvsidecar.daemon.peers.links import PeerLinks
from kvsidecar.daemon.peers.messages import (
    HandshakeInfo,
    Reader,
    make_handshake_info,
    new_daemon_id,
)
from kvsidecar.daemon.peers.server import HandshakeServer
from kvsidecar.daemon.planner import PlanError, check_block_ids
from kvsidecar.daemon.prefault import prefault
from kvsidecar.daemon.reservations import Reservation, Reservations
from kvsidecar.daemon.settings import Settings
from kvsidecar.daemon.staging import StagingPool
from kvsidecar.daemon.status import checks_of, engine_status, sees, transport_of
from kvsidecar.daemon.thread_names import name_this_thread
from kvsidecar.daemon.tracing import Tracing
from kvsidecar.daemon.transport.check import CheckResult, run_check
from kvsidecar.daemon.transport.worker import AgentReset, NixlError, NixlWorker
from kvsidecar.daemon.verify import (
    MAX_DIGEST_BYTES_IN_FLIGHT,
    MAX_DIGESTS_IN_FLIGHT,
    Hashing,
    Verifier,
)
from kvsidecar.ipc import hold_token
from kvsidecar.ipc.cuda_handles import attach_policy, parse_cuda_device
from kvsidecar.ipc.fdpass import fd_socket_for
from kvsidecar.ipc.layout import LayoutError, validate
from kvsidecar.ipc.protocol import (
    BAD_REQUEST,
    DUPLICATE,
    INTERNAL,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    UNAVAILABLE,
    UNKNOWN_ENGINE,
    Batch,
    Completion,
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
    Registered,
    Release,
    RemoteEngine,
    Replies,
    Reply,
    Request,
    RequestError,
    Reserve,
    Reserved,
    Status,
    StatusReport,
)
from kvsidecar.ipc.regions import FdExport, Region, uniform
from kvsidecar.metrics.registry import Metrics

T = TypeVar("T")
log = logging.getLogger(__name__)

#: Reader agents remembered from handshakes (one per reading engine rank and target
#: engine); beyond it the oldest is forgotten and counted.
MAX_DECLARED_READERS = 65536

#: How often the event loop samples its own lag and the state gauges.
SAMPLE_PERIOD_S = 0.5
HOUSEKEEPING_BUSY_S = 0.1  # holds or early notifications to expire
HOUSEKEEPING_IDLE_S = 1.0  # nothing to expire: engine liveness and reservations only

MAX_WAITING_POLLS = 4
#: Peer addresses remembered as checked (a set lookup per read instead of a check);
#: past it the set starts over.
MAX_DIALABLE = 4096
"""Polls that may wait at once per engine rank (``Poll.wait_s``); more are
answered at once and counted (``kvsidecar_limit_refusals_total{limit="waiting_polls"}``)."""

#: The metric label of each control item kind.
_CONTROL_OPS: dict[type[ControlRequest], str] = {Claim: "claim", Abandon: "abandon"}
#: a granted claim puts the NIXL worker on its soon poll only with this many holds or
#: fewer (one read at a time is latency-bound; many keep the worker going round anyway)
_SOON_MAX_HOLDS = 2

_REFUSED_WHILE_STOPPING: frozenset[type[Request]] = frozenset({Register, Read, Hold, Reserve})
"""Requests that would start new work; a stopping sidecar answers ``unavailable``."""


class Sidecar:
    def __init__(self, settings: Settings, metrics: Metrics | None = None,
                 tracing: Tracing | None = None) -> None:
        self.settings = settings
        #: This daemon's metrics; nothing is shared with another Sidecar in the process.
        self.metrics = metrics if metrics is not None else Metrics()
        #: OpenTelemetry spans when --otlp-endpoint is set (or a test passes an exporter)
        self.tracing = tracing if tracing is not None else Tracing(settings.otlp_endpoint)
        self._hold_spans: dict[tuple[str, str], Any] = {}
        self.daemon_id = new_daemon_id()
        self._created = time.monotonic()
        self._engines: dict[str, EngineRank] = {}
        #: (target engine, reader engine, reader rank, fleet member) -> the agent that
        #: member declared for that reader in its handshake; a notification is accepted
        #: only from the agent declared by the member the reader claimed from (one
        #: member cannot re-declare another's). Bounded, oldest out.
        self._readers: collections.OrderedDict[tuple[str, str, int, bytes], str] = (
            collections.OrderedDict())
        self._planner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvs-plan",
                                           initializer=name_this_thread, initargs=("kvs-plan",))
        # No keys only when the operator said so (--insecure-peers); a missing
        # or unsafe key file raises ValueError here, before anything is bound.
        keys = None if settings.insecure_peers else load_keys(settings.peer_keys)
        self._keys = keys
        self.peer_auth = "curve" if keys is not None else "none"
        if keys is not None and keys.shared:
            log.warning("peer keys: %s admits no member key but its own (one shared fleet "
                        "key): members cannot be told apart, any one of them may claim, renew "
                        "or abandon another's reads. Give each sidecar its own key (README, "
                        "Security)", settings.peer_keys)
        self._hs_client = HandshakeClient(
            timeout_s=settings.handshake_timeout_s, keys=keys,
            max_connections=fd_budget(HANDSHAKE_CLIENT_CONNECTIONS, 0.25),
            on_evict=lambda what: self.metrics.peer_cache_evictions.labels(what).inc(),
            on_control_sent=self.metrics.control_items.labels(side="sent").observe)
        self._reads = ReadTable(self._planner, self._hs_client, settings.read_timeout_s,
                                self._deliver, self.metrics)
        self._reads.tracing = self.tracing
        #: hashing threads of byte verification (made on first use): D's reads, P's digests
        self._hashing = Hashing()
        #: digest requests being hashed (or queued to be), and their bytes
        self._digests_open = 0
        self._digest_bytes = 0
        self._reads.verifier = Verifier(self._hs_client, self._hashing,
                                        fake_fault=digest.fake_fault_prefix())
        if self._reads.verifier.fake_fault:
            log.warning("FAKE FAULT armed (%s): verified reads whose request id starts with %r "
                        "get one landed byte flipped before their digest (tests only)",
                        digest.FAKE_FAULT_ENV, self._reads.verifier.fake_fault)
        self._hs_server = HandshakeServer(
            f"tcp://{settings.bind_host}:{settings.handshake_port}", self._lookup,
            keys=keys, max_connections=fd_budget(settings.max_peer_connections, 0.5),
            on_refuse=lambda reason: self.metrics.refused.labels(channel="peer",
                                                                 reason=reason).inc(),
            on_reader=self._declare_reader, control=self._on_control,
        )
        self.metrics.counter_from(
            "kvsidecar_handshake_requests", "Handshake requests this sidecar's server received, "
            "good or bad", lambda: self._hs_server.requests_received)
        self._server = EngineServer(
            settings.socket, self,
            access=AccessPolicy.of(settings.allow_uids, settings.allow_gids),
            max_message_bytes=settings.max_message_bytes,
            max_connections=fd_budget(settings.max_engine_connections, 0.25),
            max_assembling_bytes=settings.max_assembling_bytes or None,
            long_message_timeout_s=settings.long_message_timeout_s,
            idle_timeout_s=settings.engine_idle_timeout_s,
            on_refuse=lambda reason: self.metrics.refused.labels(channel="engine",
                                                                 reason=reason).inc(),
        )
        server = self._server
        self.metrics.engine_assembling_bytes.set_function(lambda: server.assembling_bytes)
        self.metrics.counter_from(
            "kvsidecar_engine_connections_paused", "Times the engine server stopped reading "
            "a connection whose engine left 64 replies unread (read again once it reads "
            "them; nothing is lost)", lambda: server.paused_unread)
        #: hands memfd / CUDA VMM fds to the engine that registered them (SCM_RIGHTS)
        self._fds = FdServer(
            fd_socket_for(settings.socket), self._server.access,
            on_refuse=lambda reason: self.metrics.refused.labels(channel="fd",
                                                                 reason=reason).inc())
        #: the GPU of --device cuda:N (None: a host-memory sidecar)
        self._gpu: CudaDevice | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        # engine id -> (the registration in progress, its reply), so that a
        # client retrying after a timeout joins the registration it started.
        self._registering: dict[str, tuple[Register, asyncio.Future[Reply]]] = {}
        self._shm_prefix = shm_prefix_for(settings.socket)
        self._pid_ns = _own_pid_namespace()
        self.handshake_address = ""
        self._stopping = False
        #: monotonic time the event loop last ran the sampling timer (see _sample)
        self.loop_beat = time.monotonic()
        #: set when a hold is placed: housekeeping leaves its idle sleep to watch it
        self._tidy_wake = asyncio.Event()
        #: housekeeping already ticks every HOUSEKEEPING_BUSY_S (holds to expire)
        self._tidy_busy = False
        self._hs_bound = ""
        #: start-up transport self-check: None while it runs (or when off)
        self.transport_check: CheckResult | None = None
        #: set when the start-up transport self-check failed under
        #: ``--transport-check require-zero-copy``: ``kvsidecar serve`` then stops
        #: and exits 2 with :attr:`refusal` (a misconfigured host is a crash loop
        #: with its reason, not a sidecar that never becomes ready)
        self.refused = asyncio.Event()
        self.refusal = ""
        #: the same on the GPU's memory (GPU sidecars only): None while it runs
        self.vram_check: CheckResult | None = None
        # One handler per request type (each takes exactly that type).
        self._handlers: dict[type[Request], Callable[[Any], Awaitable[Reply]]] = {
            Register: self._register, Deregister: self._deregister, Read: self._read,
            Hold: self._hold, Release: self._release, Poll: self._poll, Ping: self._ping,
            Reserve: self._reserve, Batch: self._batch, Status: self._status,
            Keep: self._keep,
        }
        #: the requests counter's series per (request type, error code): both closed
        #: sets, looked up once instead of labels() for every item of every batch
        self._request_series: dict[tuple[type, str], Any] = {}
        #: peer addresses reads named that passed check_address (at most MAX_DIALABLE)
        self._dialable: set[str] = set()
        #: allocations engines reserved before registering (vLLM's KV pool)
        #: refusals in one series: a refused id is no engine of this daemon, and a
        #: series per refused id would grow the registry with every new id sent
        self._reservations = Reservations(on_limit=lambda _engine_id: self.metrics
                                          .limit_refusals.labels("", "reservations").inc())
        #: registrations whose engine ended with holds open, served until they end
        self._drain: DrainBook[EngineRank] = DrainBook()
        #: the reservation each draining generation's regions are views of (if any)
        self._drain_reserved: dict[int, Reservation] = {}
        self.metrics.engines_draining.set_function(lambda: len(self._drain))
        self.metrics.drain_bytes.set_function(lambda: self._drain.nbytes)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        ordinal = parse_cuda_device(self.settings.device)
        if ordinal is not None and self.settings.verify_bytes:
            digest.digester_for("VRAM")  # DigestUnavailable: no GPU digester yet
        if ordinal is not None:
            # Before anything listens: a GPU sidecar without its GPU must not start
            # (CudaError, which the CLI prints as one line).
            gpu = CudaDevice(ordinal, attach_policy(self.settings.cuda_attach))
            await asyncio.get_running_loop().run_in_executor(None, gpu.open)
            self._gpu = gpu
        bound = await self._hs_server.start()
        self._hs_bound = bound
        port = bound.rsplit(":", 1)[1]
        self.handshake_address = f"{self.settings.advertised}:{port}" + (
            self._keys.address_tag if self._keys is not None else "")
        try:
            await self._server.start()
        except BaseException:
            await self._hs_server.stop()  # e.g. SocketInUse: leave as if never started
            raise
        try:
            await self._fds.start()  # beside the engine socket, whose lock we now hold
        except BaseException:
            await self._server.stop()
            await self._hs_server.stop()
            raise
        # Only now: the engine server refuses to start while another live
        # sidecar serves this socket, so the prefix (a hash of the socket
        # path) can only name this sidecar's own leftovers.
        stale = await asyncio.get_running_loop().run_in_executor(
            None, remove_stale_segments, self._shm_prefix)
        if stale:
            log.warning("removed %d shared memory segment(s) a previous run of this sidecar "
                        "left in /dev/shm: %s", len(stale), ", ".join(stale))
        self._tasks.append(asyncio.ensure_future(self._housekeeping()))
        self._tasks.append(asyncio.ensure_future(self._sample()))
        if self.settings.transport_check != "off":
            self._tasks.append(asyncio.ensure_future(self._check_transport()))
        log.info("kvsidecar %s serving engines on %s, handshakes on %s (peers dial %s)",
                 self.daemon_id, self.settings.socket, bound, self.handshake_address)

    async def stop(self, drain_s: float = 2.0) -> None:
        """Stop accepting, finish or fail in-flight reads, release everything.

        New registrations, reads and holds are refused (``unavailable``) from
        the first moment; reads not yet posted are aborted, posted ones run to
        completion (memory must not go while NIXL writes into it). Engines may
        keep polling for up to ``drain_s`` so they learn every outcome before
        the socket goes away.
        """
        if self._stopping:
            return
        self._stopping = True
        for eng in self._engines.values():
            eng.wake_pollers()
        await self._reads.abort_all(None, "the sidecar is shutting down", self._drain_timeout,
                                    posted_too=False)
        deadline = time.monotonic() + self._drain_timeout
        while self._registering and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # a registration half-way would leak its memory
        await self._drain_holds(self.settings.drain_timeout_s)
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and any(e.completions for e in self._engines.values()):
            await asyncio.sleep(0.01)
        await self._server.stop()
        await self._fds.stop()
        for t in self._tasks:
            t.cancel()
        if self._background:
            await asyncio.wait(list(self._background), timeout=60)
        for engine_id in list(self._engines):
            await self._drop_engine(engine_id, "daemon shutting down")
        for gen in self._drain:  # --drain-timeout passed with holds still open
            self._cut_drain(gen, "the sidecar stopped (--drain-timeout)")
        if self._background:
            await asyncio.wait(list(self._background), timeout=60)
        for engine_id in self._reservations.engine_ids():
            await self._drop_reservation(engine_id)
        await self._hs_server.stop()
        await self._hs_client.close()
        self._planner.shutdown(wait=False, cancel_futures=True)
        self._hashing.close()
        self.tracing.shutdown()
        log.info("kvsidecar %s stopped", self.daemon_id)

    # ------------------------------------------------------------ requests

    async def handle(self, req: Request) -> Reply:
        """Answer one engine request through the handler its type names."""
        kind = type(req)
        error = ""
        try:
            if self._stopping and kind in _REFUSED_WHILE_STOPPING:
                raise RequestError(UNAVAILABLE, "the sidecar is shutting down")
            handler = self._handlers.get(kind)
            if handler is None:
                raise RequestError(BAD_REQUEST, f"unsupported request {kind.__name__}")
            return await handler(req)
        except RequestError as e:
            error = e.code
            raise
        except BaseException:
            error = "internal"
            raise
        finally:
            # op comes from the closed set of request types, error from ERROR_CODES.
            series = self._request_series.get((kind, error))
            if series is None:
                series = self._request_series[(kind, error)] = self.metrics.requests.labels(
                    op=kind.__name__.lower(), error=error)
            series.inc()

    async def _batch(self, req: Batch) -> Reply:
        """Answer each item as if it came alone, in order; a refusal (or a bug)
        answers that item only, so what was accepted before it stays accepted
        and the engine learns which."""
        out: list[Ok | Held | Error] = []
        with self._reads.together():  # its reads of one remote engine share a task
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

    async def _read(self, req: Read) -> Reply:
        eng = self._engine(req.engine_id)
        if req.remote.engine_id == req.engine_id:
            # Its own agent would be loaded into itself as a peer (+128 MB of UCX
            # state measured) only to fail later with an error about something else.
            raise RequestError(BAD_REQUEST, f"engine {req.engine_id[:200]!r} asked to read "
                                            "from itself (the remote engine is the reading "
                                            "engine): its KV cache is already here")
        self._check_addresses(req.remote)
        self._admit(eng, "reads", self._reads.count(eng.engine_id),
                    self.settings.max_reads_per_engine, "reads in flight")
        self._reads.accept(eng, req)
        return Ok()

    async def _keep(self, req: Keep) -> Reply:
        """Keep the holds of requests the engine admitted (see daemon/keeps.py):
        the claims go out in the background; answered at once."""
        eng = self._engine(req.engine_id)
        for item in req.items:
            self._check_addresses(item.remote)
        if req.items:
            self._spawn(self._keep_claims(eng, req))
        return Ok()

    async def _keep_claims(self, eng: EngineRank, req: Keep) -> None:
        granted = await keeps.keep(self._hs_client, req.items, eng.engine_id, eng.tp_rank,
                                   eng.layout.tp_size)
        log.debug("engine %r kept %d request(s): %d claim(s) granted", eng.engine_id,
                  len(req.items), granted)

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
        queued = len(eng.completions) + self._reads.count(eng.engine_id) + len(eng.holds)
        cap = self.settings.max_completions_per_engine
        if queued >= cap:
            limit, used, bound = "completions", queued, cap
            what = "reads, holds and unpolled completions"
        elif used < bound:
            return
        self.metrics.limit_refusals.labels(eng.engine_id, limit).inc()
        raise RequestError(UNAVAILABLE, f"engine {eng.engine_id!r} has {used} {what}, the "
                                        f"limit is {bound} (--max-{limit}-per-engine); poll "
                                        "completions or retry later")

    async def _poll(self, req: Poll) -> Reply:
        eng = self._engine(req.engine_id)
        if (req.ack is not None and eng.completions and req.epoch == eng.epoch
                and req.ack > eng.completions[-1][0]):
            # Acknowledging past the newest completion can only be a bug: it would
            # drop, unseen, every completion numbered up to it (now and later).
            raise RequestError(BAD_REQUEST, f"ack {req.ack} is past the newest completion "
                                            f"({eng.completions[-1][0]}); ack the 'last' of "
                                            "a previous reply (nothing was dropped)")
        reply = eng.poll(req.ack, req.epoch)
        if reply.items or req.wait_s <= 0 or self._stopping:
            return reply
        if eng.waiting_polls >= MAX_WAITING_POLLS:
            # Answered at once rather than refused: a poll may always return early.
            self.metrics.limit_refusals.labels(eng.engine_id, "waiting_polls").inc()
            return reply
        await eng.wait_for_completion(req.wait_s)
        return eng.poll(req.ack, req.epoch)

    async def _deregister(self, req: Deregister) -> Reply:
        peer = current_peer.get()
        if (req.engine_id not in self._engines
                and self._reservations.of(req.engine_id, peer.uid if peer else None)):
            await self._drop_reservation(req.engine_id)  # reserved, never registered
            return Ok()
        self._engine(req.engine_id)
        # Shielded: a caller that gives up (or a shutdown) must not cut the
        # release short between forgetting the engine and freeing its memory.
        await asyncio.shield(self._spawn(self._drop_engine(
            req.engine_id, f"deregistered by the engine ({req.mode})",
            drain=req.mode == "drain")))
        return Ok()

    async def _ping(self, req: Ping) -> Reply:
        """Version, this uid's engines, and the keepalive of ``req.engines``: each
        of them registered here by this uid has its liveness lease renewed (an
        engine idle between requests stays alive for as long as its process
        pings; one that is gone is simply not listed back)."""
        if req.engines:
            now = time.monotonic()
            for engine_id in req.engines:
                eng = self._engines.get(engine_id)
                if eng is not None and _mine(eng):
                    eng.last_seen = now
        return Pong(version=PROTOCOL_VERSION, minor=PROTOCOL_MINOR,
                    engines=sorted(e for e, eng in self._engines.items() if _mine(eng)),
                    engine_lease_s=self.settings.engine_lease_s)

    async def _status(self, req: Status) -> Reply:
        """``kvsidecar status``: one snapshot, built on the loop (daemon/status.py)."""
        now = time.monotonic()
        asker = current_peer.get()
        checks = self.readiness()
        path, detail = transport_of(self.settings.transport_check, self.transport_check,
                                    self.vram_check, self._gpu is not None)
        engines = [engine_status(eng, self._reads.count(e), self._reads.oldest_age(e, now), now)
                   for e, eng in sorted(self._engines.items()) if sees(asker, eng)]
        return StatusReport(
            version=__version__, daemon_id=self.daemon_id,
            uptime_s=round(now - self._created, 3), socket=self.settings.socket,
            handshake_address=self.handshake_address, ready=all(c.ok for c in checks),
            draining=self._stopping, transport=path, transport_detail=detail,
            checks=checks_of(checks), engines=engines, engines_draining=len(self._drain),
            drain_bytes=self._drain.nbytes)

    def _engine(self, engine_id: str) -> EngineRank:
        """The engine a request names; any request renews its liveness lease."""
        eng = self._engines.get(engine_id)
        if eng is None or not _mine(eng):
            # Neither the other engines' names nor whether another user's engine
            # of that name exists: both are other tenants' business.
            raise RequestError(UNKNOWN_ENGINE,
                               f"engine {engine_id[:200]!r} is not registered here")
        eng.last_seen = time.monotonic()
        return eng

    async def _register(self, req: Register) -> Reply:
        inflight = self._registering.get(req.engine_id)
        if inflight is not None:
            first, reply = inflight
            if _same_process(first, req) and _same_registration(first, req):
                return await asyncio.shield(reply)  # a retry joins the registration it began
            raise RequestError(DUPLICATE, f"engine {req.engine_id!r} is being registered")
        reply = asyncio.get_running_loop().create_future()
        reply.add_done_callback(_retrieve)
        self._registering[req.engine_id] = (req, reply)
        try:
            old = self._engines.get(req.engine_id)
            if old is not None:
                result = await self._reattach(old, req)
            else:
                result = await self._register_new(req)
        except asyncio.CancelledError:
            reply.cancel()
            raise
        except BaseException as e:
            reply.set_exception(e)
            raise
        else:
            reply.set_result(result)
            return result
        finally:
            del self._registering[req.engine_id]

    async def _register_new(self, req: Register) -> Reply:
        try:
            layout = validate(req.layout)
        except LayoutError as e:
            raise RequestError(BAD_REQUEST, f"invalid layout: {e}") from None
        if req.tp_rank >= layout.tp_size:
            raise RequestError(BAD_REQUEST, f"tp_rank {req.tp_rank} outside the layout's "
                                            f"tp_size {layout.tp_size}")
        self._check_engine_room()
        # Creating or mapping shared memory touches every page (about 1 s per GB):
        # off the loop, so other engines keep being served meanwhile.
        peer = current_peer.get()
        uid = peer.uid if peer is not None else None
        reserved = self._reservations.of(req.engine_id, uid)
        mapping = asyncio.get_running_loop().run_in_executor(
            None, partial(map_regions, req.engine_id, layout, req.mode, req.regions,
                          self._shm_prefix, uid, req.memory, self._gpu,
                          reserved.region if reserved else None,
                          allow_unsealed_shm=self.settings.allow_unsealed_shm))
        try:
            regions, owned = await asyncio.shield(mapping)
        except asyncio.CancelledError:
            # The thread finishes anyway: release what it creates.
            mapping.add_done_callback(_release_late_mapping)
            raise
        agent = f"kvs-{req.engine_id}-r{req.tp_rank}-{self.daemon_id[:8]}-{uuid.uuid4().hex[:6]}"
        worker = NixlWorker(agent, backends=self.settings.backends,
                            on_notif=partial(self._on_notif, req.engine_id),
                            on_reset=partial(self._on_agent_reset, req.engine_id),
                            thread_init=partial(_worker_thread_init, self._gpu),
                            join_notifs=notifications.join,
                            max_notif_bytes=notifications.MAX_NOTIF_BYTES)
        # Lanes past 0 only post reads (no notifications in or out: peers know lane
        # 0's agent alone); see engines.py and reads.lane_of.
        lanes = [worker] + [
            NixlWorker(f"{agent}-l{k}", backends=self.settings.backends,
                       on_reset=partial(self._on_lane_reset, req.engine_id),
                       thread_init=partial(_worker_thread_init, self._gpu))
            for k in range(1, self.settings.post_lanes)]
        mem_type, device = uniform(regions)
        try:
            # Each lane on its own thread: started and registered side by side.
            await _every(lane.start() for lane in lanes)
            reg_id, *_ = await _every(
                lane.register([(r.address, layout.region_bytes) for r in regions], mem_type,
                              device.index) for lane in lanes)
            meta = await worker.metadata()
        except BaseException as e:
            for lane in lanes:
                with contextlib.suppress(Exception):
                    await lane.stop()
            await self._release_regions(regions, owned)
            raise RequestError(BAD_REQUEST, f"NIXL registration failed: {e}") from None
        bases = [r.address for r in regions]
        key = hold_token.new_key()
        eng = EngineRank(
            engine_id=req.engine_id, tp_rank=req.tp_rank, layout=layout, regions=regions,
            owned=owned, keep_on_exit=req.keep_on_exit, pid=req.pid, worker=worker,
            lanes=lanes, reg_id=reg_id, bases=np.array(bases, dtype=np.int64),
            peers=PeerLinks(worker, layout, self._hs_client, on_link=self._count_link,
                            lanes=lanes,
                            on_unload_failed=self.metrics.cleanup_failures.labels(
                                what="remote_agent").inc,
                            reader=(req.engine_id, req.tp_rank),
                            readable=("DRAM", "VRAM") if self._gpu is not None else ("DRAM",),
                            max_links=self.settings.max_peer_links_per_engine,
                            on_evict=self.metrics.peer_links_evicted.labels(req.engine_id).inc,
                            on_refused=self.metrics.limit_refusals.labels(
                                req.engine_id, "peer_links").inc),
            info=make_handshake_info(
                engine_id=req.engine_id, tp_rank=req.tp_rank, agent_name=worker.agent_name,
                agent_metadata=meta, layout=layout, bases=bases, daemon_id=self.daemon_id,
                mem_type=mem_type, dev_id=device.index, device_uuid=device.uuid,
                notif_batch_reads=self.settings.notif_batch_reads,
                hold_key=hold_token.checking_key(key),
            ),
            hold_timeout_s=self.settings.hold_timeout_s, notif_grace_s=self.settings.notif_grace_s,
            hold_lease_s=self.settings.hold_lease_s, hold_max_life_s=self.settings.hold_max_life_s,
            max_early_notifications=self.settings.max_early_notifications,
            metrics=self.metrics,
            on_complete=self._traced_completion if self.tracing.enabled else None,
            instance=req.instance, pid_visible=self._pid_visible(req),
            uid=uid, memory=req.memory if req.mode == "allocate" else "",
            post_during_claim_s=self.settings.post_during_claim_s,
            verify_bytes=self.settings.verify_bytes,
            hold_key=key,
        )
        self._prefault(eng, mem_type)
        self._attach_staging(eng, mem_type)
        eng.fd_token = self._offer_fds(eng)
        self._engines[req.engine_id] = eng
        self.metrics.engine_arrived(req.engine_id)
        self._hs_server.invalidate(req.engine_id)
        self.metrics.engines.set(len(self._engines))
        log.info("registered engine %r rank %d/%d (%s, %d regions x %d B, %s)", req.engine_id,
                 req.tp_rank, layout.tp_size, layout.family, layout.num_regions,
                 layout.region_bytes, req.mode)
        return self._registered(eng)

    def _check_engine_room(self) -> None:
        """Refuse a new engine past ``--max-engines``: each one is a NIXL agent (its
        own thread, ~16 fds and ~5 MB measured) plus its memory, and engines of an
        allowed uid could otherwise register until the daemon ran out of fds.
        Engines being registered count (this one among them); one series for all
        refusals, as a refused id is not an engine of this daemon."""
        limit = self.settings.max_engines
        new = sum(1 for e in self._registering if e not in self._engines)
        if len(self._engines) + new > limit:
            self.metrics.limit_refusals.labels("", "engines").inc()
            raise RequestError(UNAVAILABLE, f"this sidecar serves {len(self._engines)} engines "
                                            f"and registers {new - 1} more (--max-engines "
                                            f"{limit}): deregister one first")

    def _registered(self, eng: EngineRank) -> Registered:
        return Registered(engine_id=eng.engine_id, handshake_address=self.handshake_address,
                          agent_name=eng.worker.agent_name,
                          regions=[r.ref() for r in eng.regions] if eng.owned else [],
                          fd_socket=self._fds.path if eng.fd_token else "",
                          hold_key=eng.hold_key)

    def _offer_fds(self, eng: EngineRank) -> str:
        return self._offer(eng.regions, eng.uid, f"engine {eng.engine_id!r} rank "
                                                 f"{eng.tp_rank}") if eng.owned else ""

    def _offer(self, regions: list[Region], uid: int | None, what: str) -> str:
        """Offer the fds of an allocation whose kind travels by fd (memfd, CUDA
        VMM) on the fd socket, to the uid that made it; '' when none do."""
        exported = [r for r in regions if isinstance(r, FdExport)]
        if not exported:
            return ""
        token = self._fds.offer([r.fd for r in exported], uid, what)
        for i, r in enumerate(exported):
            r.share(token, i)
        return token

    async def _reserve(self, req: Reserve) -> Reply:
        """One allocation of ``nbytes`` for an engine that learns its layout from
        its own allocator (see daemon/reservations.py)."""
        peer = current_peer.get()
        uid = peer.uid if peer is not None else None
        if req.engine_id in self._engines:
            raise RequestError(DUPLICATE, f"engine {req.engine_id[:200]!r} is registered "
                                          "already; reserve before registering")
        again = self._reservations.check_room(req.engine_id, uid, req.nbytes, req.memory)
        if again is None:
            ctx = MemoryContext(req.engine_id, self._shm_prefix, uid, self._gpu,
                                allow_unsealed_shm=self.settings.allow_unsealed_shm)
            (region,) = await asyncio.get_running_loop().run_in_executor(
                None, memory_kinds.allocate, req.memory, 1, req.nbytes, ctx)
            if self._reservations.of(req.engine_id, uid) is not None:  # raced by a retry
                await self._release_regions([region], True)
                again = self._reservations.of(req.engine_id, uid)
            else:
                again = Reservation(req.engine_id, uid, req.memory, region)
                again.fd_token = self._offer([region], uid, f"reservation {req.engine_id!r}")
                self._reservations.add(again)
                log.info("reserved %d B of %s for engine %r", req.nbytes, req.memory,
                         req.engine_id)
        assert again is not None
        return Reserved(region=again.region.ref(),
                        fd_socket=self._fds.path if again.fd_token else "")

    async def _drop_reservation(self, engine_id: str) -> None:
        r = self._reservations.pop(engine_id)
        if r is not None:
            self._fds.withdraw(r.fd_token)
            await self._release_regions([r.region], True)

    def _pid_visible(self, req: Register) -> bool:
        """Whether ``req.pid`` can serve as a liveness signal: a pid of this
        sidecar's own PID namespace.

        A stated pid that does not exist is not trusted (liveness by requests
        only), except when it is the kernel's own word: the pid ``SO_PEERCRED``
        recorded for the connection that sent the registration. Then the engine
        died before its registration was done (a crash or OOM kill during a
        large allocation), and the next liveness check (within 1 s) releases it.
        Taking that pid for unknown held the memory for the whole
        --engine-lease and refused the restarted engine's registration of the
        same id as 'already registered (by a live process)' meanwhile."""
        if not req.pid:
            return False
        if not self._pid_ns or req.pid_ns != self._pid_ns:
            log.info("engine %r: pid %d is in another PID namespace (%r, ours %r); liveness by "
                     "its requests only (--engine-lease %g s)", req.engine_id, req.pid,
                     req.pid_ns or "unknown", self._pid_ns, self.settings.engine_lease_s)
            return False
        if not _alive(req.pid):
            peer = current_peer.get()
            if peer is not None and peer.pid == req.pid:
                log.warning("engine %r: its process (pid %d) exited before its registration "
                            "was done; released at the next liveness check", req.engine_id,
                            req.pid)
                return True
            log.warning("engine %r: pid %d does not exist here; liveness by its requests only",
                        req.engine_id, req.pid)
            return False
        return True

    def _death(self, eng: EngineRank, now: float) -> str:
        """Why ``eng`` is taken for dead ('' while alive)."""
        if eng.pid_visible and not _alive(eng.pid):
            return f"its process (pid {eng.pid}) exited"
        idle = now - eng.last_seen
        if idle > self.settings.engine_lease_s:
            return (f"it sent no request for {idle:.1f} s (--engine-lease "
                    f"{self.settings.engine_lease_s:g} s)")
        return ""

    async def _reattach(self, old: EngineRank, req: Register) -> Reply:
        """The same registration again, or a restarted engine taking over its kept one.

        The same process (``instance``) asking for the same rank, layout and
        memory again is a retry (its first reply was lost to a timeout): it
        gets the same registration, and nothing else changes.

        Otherwise only for ``keep_on_exit`` registrations whose process is
        dead (pid gone, where the pid is checkable, or no request within the
        engine lease), with the same rank, layout and mode: the memory (and
        the KV in it) is handed back as it is. The old process's reads are
        aborted and waited for (nothing may still write into blocks the new
        process will reuse), its holds and undelivered completions are
        dropped: the new process knows nothing of them.
        """
        if not _mine(old):
            raise RequestError(DUPLICATE, f"engine id {req.engine_id[:200]!r} is taken")
        if _same_process(old, req) and _same_registration_of(old, req):
            old.last_seen = time.monotonic()
            log.info("engine %r rank %d registered again by the same process: same "
                     "registration", req.engine_id, old.tp_rank)
            return self._registered(old)
        if not (old.keep_on_exit and (old.orphaned or self._death(old, time.monotonic()))):
            raise RequestError(DUPLICATE, f"engine {req.engine_id!r} is already registered "
                                          "(by a live process; the same process registering "
                                          "the same rank and layout again gets it back)")
        mode = "allocate" if old.owned else "attach"
        if req.tp_rank != old.tp_rank or req.layout != old.layout or req.mode != mode:
            raise RequestError(DUPLICATE, f"engine {req.engine_id!r} is kept for a restart with "
                                          f"rank {old.tp_rank}, mode {mode} and its old layout; "
                                          "this registration differs")
        if not old.owned:
            raise RequestError(DUPLICATE, f"engine {req.engine_id!r} attached its own memory; "
                                          "deregister it before attaching again")
        await self._quiesce(old, "the engine restarted")
        old.completions.clear()
        log.info("engine %r rank %d reattached (pid %d -> %d)", req.engine_id, old.tp_rank,
                 old.pid, req.pid)
        old.pid = req.pid
        old.pid_visible = self._pid_visible(req)
        old.instance = req.instance
        old.orphaned = False
        old.last_seen = time.monotonic()
        old.keep_on_exit = req.keep_on_exit
        return self._registered(old)

    def _on_agent_reset(self, engine_id: str, reset: AgentReset) -> None:
        """The engine's NIXL agent was destroyed and created again (a read failed):
        publish its new name and metadata and drop every link loaded into the old one."""
        eng = next((r for r in self._ranks_of(engine_id)
                    if r.worker.agent_name == reset.agent_name), None)
        if eng is None:  # the agent of a rank already freed
            return
        eng.info = make_handshake_info(
            engine_id=engine_id, tp_rank=eng.tp_rank, agent_name=reset.agent_name,
            agent_metadata=reset.metadata, layout=eng.layout, bases=[int(b) for b in eng.bases],
            daemon_id=self.daemon_id, notif_batch_reads=self.settings.notif_batch_reads,
        )
        self._hs_server.invalidate(engine_id)
        self._unlink_after_reset(eng, reset)

    def _on_lane_reset(self, engine_id: str, reset: AgentReset) -> None:
        """A lane other than 0 was reset (a read it carried failed): every link of the
        engine rank is dropped, as for lane 0 (see PeerLinks.reset), so the next read
        links again and loads its peers into the new agent. Peers never knew this
        agent (the handshake declares lane 0's), so nothing is published."""
        eng = self._engines.get(engine_id)
        if eng is not None:
            self._unlink_after_reset(eng, reset)

    def _unlink_after_reset(self, eng: EngineRank, reset: AgentReset) -> None:
        """Count a reset of one of ``eng``'s agents and drop every link of the rank."""
        e = eng.engine_id
        self.metrics.agent_resets.labels(e).inc()
        self.metrics.agent_reset_seconds.labels(e).observe(reset.teardown_s)
        self.metrics.late_completions.labels(e).inc(reset.reads_failed)
        for address, remote_engine, _ in eng.peers.reset():
            self._hs_client.forget(address, remote_engine)

    def _count_link(self, ok: bool) -> None:
        self.metrics.handshakes.labels(side="client", result="ok" if ok else "failed").inc()

    def _lookup(self, engine_id: str, rank: int) -> HandshakeInfo | None:
        """The registered rank's handshake; while none is registered, the newest
        draining generation's (its holds are still read)."""
        for eng in self._ranks_of(engine_id):
            if eng.tp_rank == rank:
                return eng.info
        return None

    def _deliver(self, eng: EngineRank, c: Completion) -> None:
        current = self._engines.get(eng.engine_id)
        if current is not None and current is eng:
            current.complete(c)

    async def _hold(self, req: Hold) -> Reply:
        eng = self._engine(req.engine_id)
        self._admit(eng, "holds", len(eng.holds), self.settings.max_holds_per_engine,
                    "holds open")
        try:
            check_block_ids(eng.layout, req.block_ids, "held")
        except PlanError as e:
            raise RequestError(BAD_REQUEST, str(e)) from None
        held = hold_token.blocks_digest(req.block_ids)
        try:
            eng.holds.add(req.engine_id, req.request_id, eng.layout.tp_size, req.readers,
                          req.timeout_s, time.monotonic(), digest=held, block_ids=req.block_ids)
        except KeyError as e:
            raise RequestError(DUPLICATE, str(e.args[0])) from None
        eng.worker.set_hot(len(eng.holds) > 0)
        if not self._tidy_busy:  # housekeeping now watches this hold's deadline
            self._tidy_wake.set()
        if self.tracing.enabled:
            self._hold_spans[(req.engine_id, req.request_id)] = self.tracing.start(
                "kvsidecar.hold", req.request_id, engine=req.engine_id, rank=eng.tp_rank,
                readers=req.readers)
        timeout = req.timeout_s or eng.holds.default_timeout_s
        # Valid as long as a lease on the hold can run (see HoldBook.claim).
        life = max(timeout, eng.holds.max_life_s) + eng.holds.lease_s
        return Held(lease_s=eng.holds.lease_s, timeout_s=timeout,
                    token=hold_token.issue_digested([eng.hold_key], req.engine_id,
                                                    req.request_id, held,
                                                    math.ceil(time.time() + life))[0])

    def _traced_completion(self, engine_id: str, c: Completion) -> None:
        span = self._hold_spans.pop((engine_id, c.request_id), None)
        self.tracing.end(span, outcome=c.kind)

    async def _release(self, req: Release) -> Reply:
        eng = self._engine(req.engine_id)
        if self._reads.abort(req.engine_id, req.request_id, "released by the engine"):
            return Ok()
        if eng.holds.release(req.engine_id, req.request_id, time.monotonic()):
            self.tracing.end(self._hold_spans.pop((req.engine_id, req.request_id), None),
                             outcome="released")
            return Ok()
        if eng.has_completion(req.request_id):
            return Ok()  # it ended just before the release; its completion says how
        raise RequestError(BAD_REQUEST, f"no read or hold {req.request_id!r} in progress for "
                                        f"engine {req.engine_id!r}")

    # ------------------------------------------------------------ notifications

    def _declare_reader(self, target_engine: str, reader: Reader, member: bytes) -> None:
        """A handshake request from ``member`` declared which agent a reading
        engine rank uses."""
        key = (target_engine, reader.engine_id, reader.tp_rank, member)
        self._readers[key] = reader.agent
        self._readers.move_to_end(key)
        while len(self._readers) > MAX_DECLARED_READERS:
            self._readers.popitem(last=False)
            self.metrics.declared_readers_evicted.inc()

    def _on_notif(self, engine_id: str, agent: str, msg: bytes) -> None:
        """One NIXL notification: a single read's, or a batch naming several
        reads of one transfer. A malformed batch counts once as ``bad`` and
        ends nothing; in a well-formed one each read is checked on its own
        (sender, engine, then the hold's own lease checks), so a forged or
        unknown id is refused alone and the others still end their holds."""
        try:
            if notifications.is_batch(msg):
                items = notifications.decode_batch(msg)
            else:
                items = [notifications.decode(msg)]
        except notifications.BadNotification as e:
            self.metrics.notifications_received.labels(outcome="bad").inc()
            log.warning("ignoring a notification from %s: %s", agent, e)
            return
        self.metrics.notification_reads.observe(len(items))
        for item in items:
            if isinstance(item, notifications.BadNotification):
                self.metrics.notifications_received.labels(outcome="bad").inc()
                log.warning("ignoring one read of a batched notification from %s: %s",
                            agent, item)
            else:
                self._on_read_done(agent, item)

    def _on_read_done(self, agent: str, note: notifications.ReadDone) -> None:
        eng = self._holder(note.target_engine, note.request_id)
        if eng is None:
            self.metrics.notifications_received.labels(outcome="unknown_engine").inc()
            log.warning("notification for unknown engine %r (request %r) from %s",
                        note.target_engine, note.request_id, agent)
            return
        member = eng.holds.member_of(note.target_engine, note.request_id,
                                     (note.reader_engine, note.reader_rank))
        declared = None if member is None else self._readers.get(
            (note.target_engine, note.reader_engine, note.reader_rank, member))
        if declared != agent:
            # Anyone who can reach our NIXL agent can send a notification and name any
            # request: only the agent that the member the reader claimed from declared
            # (in its handshake) may end a hold; a reader that never claimed, none.
            self.metrics.notifications_received.labels(outcome="wrong_sender").inc()
            log.warning("rejecting a notification for engine %r request %r claiming reader "
                        "%r rank %d: sent by agent %r, the reader declared %r",
                        note.target_engine, note.request_id, note.reader_engine,
                        note.reader_rank, agent, declared)
            return
        self.metrics.series(self.metrics.notifications_received, "ok").inc()
        if self.tracing.enabled:
            self.tracing.end(self.tracing.start(
                "kvsidecar.notification", note.request_id,
                self._hold_spans.get((note.target_engine, note.request_id)),
                engine=note.target_engine, peer=note.reader_engine, rank=note.reader_rank))
        dropped = eng.holds.early_dropped
        eng.holds.notify(note, time.monotonic(), member or b"")
        if eng.holds.early_dropped != dropped:
            self.metrics.limit_refusals.labels(eng.engine_id, "early_notifications").inc()

    def _on_control(self, frame: bytes, member: bytes = b"") -> bytes | Awaitable[bytes]:
        """Answer a reader's claim, abandon, or batch of them (see peers/control.py
        and holds). A batch is answered item by item: one refused (or failing)
        item never refuses the others; only an undecodable message is refused
        whole, with one plain reply."""
        try:
            msg = peer_control.decode_request(frame)
        except peer_control.BadControl as e:
            op = "batch" if peer_control.op_of(frame) == "batch" else "unknown"
            self.metrics.lease_requests.labels(op=op, result="bad").inc()
            return peer_control.encode(ControlReply(
                granted=False, reason=str(e), req_id=peer_control.request_id_of(frame)))
        if isinstance(msg, Digest):
            return self._answer_digest(msg)
        if isinstance(msg, ControlBatch):
            self.metrics.series(self.metrics.control_items, "answered").observe(len(msg.items))
            return peer_control.encode(ControlBatchReply(
                replies=[self._answer_item(item, member) for item in msg.items],
                req_id=msg.req_id))
        self.metrics.series(self.metrics.control_items, "answered").observe(1)
        return peer_control.encode(self._answer_item(msg, member))

    def _answer_item(self, msg: ControlRequest, member: bytes) -> ControlReply:
        """The reply to one claim or abandon, counted; never raises."""
        op = _CONTROL_OPS[type(msg)]
        if msg.v != peer_control.CONTROL_VERSION:
            reply = ControlReply(granted=False, reason=(
                f"control item v{msg.v}, this side speaks v{peer_control.CONTROL_VERSION}"))
        else:
            try:
                reply = self._control_reply(msg, member)
            except Exception as e:  # one bad item must not cost the others their answers
                log.exception("answering a %s for %r failed", op, msg.request_id[:200])
                reply = ControlReply(granted=False, reason=f"internal error: {type(e).__name__}")
        self.metrics.series(self.metrics.lease_requests, op,
                            "granted" if reply.granted else "refused").inc()
        return msgspec.structs.replace(reply, req_id=msg.req_id)

    def _linked_engine(self, msg: ControlRequest | Digest) -> EngineRank | ControlReply:
        """The engine rank a control item names, or the refusal when it is not the
        one the reader linked to: the registered rank or a draining generation, by
        the agent the reader linked to (see daemon/drain.py)."""
        current = self._engines.get(msg.engine_id)
        holder = self._holder(msg.engine_id, msg.request_id)
        # The agent the reader linked to names the memory it reads: the registered
        # rank's or a draining generation's (see daemon/drain.py).
        eng = next((r for r in self._ranks_of(msg.engine_id)
                    if r.worker.agent_name == msg.agent_name), None) if msg.agent_name else None
        eng = eng or holder
        # An abandon of a draining generation's hold ends it whatever the reader
        # linked to: the reader has nothing in flight on it (its claim was refused).
        drained_abandon = isinstance(msg, Abandon) and holder is not current
        if drained_abandon:
            eng = holder
        if eng is not None and eng is not holder and holder is not current:
            return ControlReply(granted=False, reason=(
                f"request {msg.request_id[:200]!r} is held by an earlier registration of "
                f"engine {msg.engine_id[:200]!r} (draining), not the one the reader linked to"))
        if eng is not None and eng is not current and (msg.engine_id,
                                                         msg.request_id) not in eng.holds:
            # Linked to what an ended engine left: a new registration of the id (if
            # any) may hold it, so the reader re-links (stale) when there is one.
            return ControlReply(granted=False, stale_link=current is not None, reason=(
                f"engine {msg.engine_id[:200]!r} ended; request {msg.request_id[:200]!r} is "
                "not held by what it left" + ("; it registered again since" if current
                                              else "")))
        if eng is None or eng.tp_rank != msg.tp_rank:
            return ControlReply(granted=False, stale_link=True,
                                reason=f"engine {msg.engine_id[:200]!r} rank {msg.tp_rank} is "
                                       "not registered here")
        unlinked_abandon = isinstance(msg, Abandon) and (not msg.agent_name or drained_abandon)
        if msg.agent_name != eng.worker.agent_name and not unlinked_abandon:
            return ControlReply(granted=False, stale_link=True, reason=(
                f"engine {msg.engine_id[:200]!r} registered again since the reader linked to "
                "it (its memory is not the memory the reader would read)"))
        return eng

    async def _answer_digest(self, msg: Digest) -> bytes:
        """The reply to one digest request, counted; never raises."""
        try:
            reply = await self._digest_reply(msg)
        except Exception as e:
            log.exception("answering a digest for %r failed", msg.request_id[:200])
            reply = ControlReply(granted=False, reason=f"internal error: {type(e).__name__}")
        self.metrics.series(self.metrics.lease_requests, "digest",
                            "granted" if reply.granted else "refused").inc()
        return peer_control.encode(msgspec.structs.replace(reply, req_id=msg.req_id))

    async def _digest_reply(self, msg: Digest) -> ControlReply:
        """Hash the pieces a reader names (``--verify-bytes``, see daemon/verify.py)
        when a live hold of that request pins every page they touch; for a hold
        not placed yet (its claim came early) the refusal says ``retry`` and the
        reader asks again (P never waits: a peer's request costs no task here)."""
        eng = self._linked_engine(msg)
        if isinstance(eng, ControlReply):
            return eng
        # As a claim: only the reader the hold issued its token to may ask.
        checked = self._token_digest(eng, msg, "digest")
        if isinstance(checked, ControlReply):
            return checked
        try:
            digester = digest.digester_for(eng.info.mem_type)
        except digest.DigestUnavailable as e:
            return ControlReply(granted=False, reason=str(e))
        blocks = eng.holds.blocks(msg.engine_id, msg.request_id)
        if blocks is None and eng.holds.waiting(msg.engine_id, msg.request_id):
            return ControlReply(granted=False, retry=True, reason=(
                f"the hold of request {msg.request_id[:200]!r} is not placed yet"))
        if blocks is None:
            return ControlReply(granted=False, reason=(
                f"no live hold of request {msg.request_id[:200]!r} pins blocks of engine "
                f"{msg.engine_id[:200]!r} here"))
        layout = eng.layout
        try:
            region, offset, length = digest.unpack_ranges(msg.ranges)
            digest.check_ranges(region, offset, length, num_regions=layout.num_regions,
                                region_bytes=layout.region_bytes, page_bytes=layout.page_bytes,
                                held_pages=digest.held_pages(blocks))
            if digest.chunk_count(length, msg.chunk_bytes) > digest.MAX_CHUNKS:
                raise digest.BadRanges(f"more than {digest.MAX_CHUNKS} chunks of "
                                       f"{msg.chunk_bytes} B")
        except digest.BadRanges as e:
            return ControlReply(granted=False, reason=f"digest refused: {e}")
        # At most MAX_DIGESTS_IN_FLIGHT requests and MAX_DIGEST_BYTES_IN_FLIGHT bytes
        # (one request whatever its size) hashed or queued at once: past either, a
        # refusal for now (``retry``), counted (a peer's input: under no engine's label).
        nbytes = int(length.sum())
        if self._digests_open >= MAX_DIGESTS_IN_FLIGHT or (
                self._digests_open and self._digest_bytes + nbytes > MAX_DIGEST_BYTES_IN_FLIGHT):
            self.metrics.limit_refusals.labels("", "digests").inc()
            return ControlReply(granted=False, retry=True, reason=(
                f"{self._digests_open} digests of {self._digest_bytes} B are being hashed here "
                f"(at most {MAX_DIGESTS_IN_FLIGHT}, {MAX_DIGEST_BYTES_IN_FLIGHT} B); retry later"))
        self._digests_open += 1
        self._digest_bytes += nbytes
        try:
            out = await self._hashing.run(eng.engine_id, digester,
                                          [r.numpy() for r in eng.regions], region, offset,
                                          length, msg.chunk_bytes, threads=1)
        finally:
            self._digests_open -= 1
            self._digest_bytes -= nbytes
        if eng.holds.blocks(msg.engine_id, msg.request_id) is None:
            return ControlReply(granted=False, reason=(
                f"the hold of {msg.request_id[:200]!r} ended while its bytes were hashed"))
        return ControlReply(granted=True, digest=out)

    @staticmethod
    def _token_digest(eng: EngineRank, msg: ControlRequest | Digest,
                      op: str) -> bytes | ControlReply:
        """The blocks digest of the hold token a control item carries, checked
        under ``eng``'s hold key (issued for this engine and request, not
        expired), or the refusal naming what is wrong."""
        if not msg.token:
            return ControlReply(granted=False, reason=(
                f"{op} of request {msg.request_id[:200]!r} carries no hold token: reads need "
                "the token the hold issued (Read.remote_tokens; vLLM: kv_transfer_params)"))
        try:
            return hold_token.check_issued(eng.hold_key, msg.engine_id, msg.request_id,
                                           msg.token, time.time())
        except hold_token.TokenError as e:
            return ControlReply(granted=False, reason=f"{op} refused: {e}")

    def _control_reply(self, msg: ControlRequest, member: bytes) -> ControlReply:
        eng = self._linked_engine(msg)
        if isinstance(eng, ControlReply):
            return eng
        digest = self._token_digest(eng, msg, _CONTROL_OPS[type(msg)])
        if isinstance(digest, ControlReply):
            return digest
        now = time.monotonic()
        reader = (msg.reader_engine, msg.reader_rank)
        if isinstance(msg, Claim):
            lease = eng.holds.claim(msg.engine_id, msg.request_id, now, digest=digest,
                                    member=member, reader=reader)
            if lease.granted and not msg.keep:
                # The reader posts its READ when this reply arrives: progress tightly
                # while its lease runs (wire-up, its READ's closing flush, and over
                # TCP the bytes, need us). Told once this reply has left: waking the
                # worker thread now would contend for the GIL with the reply.
                # Few holds: this read is worth the worker's 50 us poll; many: the
                # worker is busy anyway (see NixlWorker._completion_imminent).
                asyncio.get_running_loop().call_soon(
                    functools.partial(eng.worker.expect_reads, lease.lease_s,
                                      soon=len(eng.holds) <= _SOON_MAX_HOLDS))
            return ControlReply(granted=lease.granted, lease_s=lease.lease_s,
                                reason=lease.reason)
        refused = eng.holds.may_report(msg.engine_id, msg.request_id, reader, member)
        if refused:
            return ControlReply(granted=False, reason=f"abandon refused: {refused}")
        report = Report(msg.reader_engine, msg.reader_rank, msg.reader_tp,
                        msg.reason or "abandoned by the reader")

        def apply(done: asyncio.Future[Any] | None = None) -> None:
            if done is not None and not done.cancelled():
                done.exception()  # a worker that stopped meanwhile changes nothing here
            eng.holds.report(msg.engine_id, msg.request_id, report, time.monotonic(), member)
            eng.worker.set_hot(len(eng.holds) > 0)

        # The reader may have sent its read's completion notification (over NIXL)
        # before this abandon (over ZMQ): apply the abandon only after the worker
        # took what NIXL has for us, so a read that finished counts as finished
        # however deeply the worker slept.
        try:
            eng.worker.progressed().add_done_callback(apply)
        except NixlError:  # the worker is stopping: nothing more will arrive
            apply()
        return ControlReply(granted=True)

    # ------------------------------------------------------------ housekeeping

    async def _sample(self, period_s: float = SAMPLE_PERIOD_S) -> None:
        """Every ``period_s``: measure event-loop lag (how late this timer fires)
        and copy the state gauges from the loop's own data (no locks, no
        scrape-time iteration from another thread). ``loop_beat`` is what
        /healthz and the systemd watchdog look at."""
        m = self.metrics
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(period_s)
            now = time.monotonic()
            self.loop_beat = now
            m.loop_lag.set(max(0.0, now - t0 - period_s))
            try:
                reads = self._reads.by_engine()
                for eng in list(self._engines.values()):
                    e = eng.engine_id
                    m.reads_in_flight.labels(e).set(reads.get(e, 0))
                    m.holds_in_flight.labels(e).set(len(eng.holds))
                    m.registered_regions.labels(e).set(len(eng.regions))
                    m.registered_bytes.labels(e).set(len(eng.regions) * eng.layout.region_bytes)
                    m.peers.labels(e).set(len(eng.peers))
                    m.worker_lag.labels(e).set(max(0.0, now - min(w.heartbeat
                                                                  for w in eng.lanes)))
                m.engines.set(len(self._engines))
            except Exception:  # sampling must outlive any single bad entry
                log.exception("metrics sampling failed; continuing")

    # ------------------------------------------------------------ health

    async def _check_transport(self) -> None:
        """Run the loopback self-check once, off the loop, and publish its result."""
        try:
            r = await run_check(self.settings.transport_check)
        except Exception as e:  # a check that cannot run is a failed check, not a crash
            r = CheckResult("error", (), 0.0, 0, False, f"{type(e).__name__}: {e}")
        self.transport_check = r
        self.metrics.transport_info.labels(path=r.path, passed=str(r.passed).lower()).set(1)
        self.metrics.transport_bandwidth.set(r.bandwidth_bytes_s)
        (log.info if r.passed else log.error)(
            "transport self-check %s: path %s (%s), loopback READ %.2f GB/s; %s",
            "passed" if r.passed else "FAILED", r.path, ",".join(r.transports) or "-",
            r.bandwidth_bytes_s / 1e9, r.detail)
        if not r.passed and self.settings.transport_check == "require-zero-copy":
            self.refusal = (f"--transport-check require-zero-copy: the start-up loopback READ "
                            f"took the {r.path} path: {r.detail}")
            self.refused.set()
            return
        gpu = self._gpu
        if gpu is None:
            return
        try:  # the same READ between two buffers on the GPU, judged by its facts
            v = await run_check(self.settings.transport_check, 256 << 20, device=gpu.ordinal)
        except Exception as e:
            v = CheckResult("error", (), 0.0, 0, False, f"{type(e).__name__}: {e}")
        self.vram_check = v
        gpu.vram_check_passed = v.passed  # engine-allocated CUDA attach follows it (warn)
        self.metrics.transport_info.labels(path=f"vram:{v.path}",
                                           passed=str(v.passed).lower()).set(1)
        (log.info if v.passed else log.error)(
            "VRAM transport self-check %s: path %s (%s), loopback READ %.2f GB/s; %s",
            "passed" if v.passed else "FAILED", v.path, ",".join(v.transports) or "-",
            v.bandwidth_bytes_s / 1e9, v.detail)

    def engine_ids(self) -> list[str]:
        return list(self._engines)

    def liveness(self) -> list[Check]:
        """Event loop and NIXL worker threads responsive (any thread may call this)."""
        now = time.monotonic()
        bound = self.settings.health_timeout_s
        checks = [heartbeat("event_loop", now - self.loop_beat, bound)]
        for engine_id, eng in list(self._engines.items()):
            for k, w in enumerate(eng.lanes):
                checks.append(heartbeat(f"worker:{engine_id}" + (f":lane{k}" if k else ""),
                                        now - w.heartbeat, bound))
        return checks

    def readiness(self) -> list[Check]:
        """Liveness plus agents up, listener bound, self-check passed, not draining."""
        checks = self.liveness()
        down = [e for e, eng in list(self._engines.items())
                if any(not w.running or w.down_reason for w in eng.lanes)]
        checks.append(Check("nixl_agents", not down, f"agents down: {', '.join(down)}" if down
                            else f"{len(self._engines)} engine agents running"))
        checks.append(self._listener_check())
        mode = self.settings.transport_check
        r = self.transport_check
        if mode == "off":
            checks.append(Check("transport_selfcheck", True, "disabled (--transport-check off)"))
        elif r is None:
            checks.append(Check("transport_selfcheck", False, "still running"))
        else:
            checks.append(Check("transport_selfcheck", r.passed,
                                f"path {r.path}, {r.bandwidth_bytes_s / 1e9:.2f} GB/s: {r.detail}"))
        if mode != "off" and self._gpu is not None:
            v = self.vram_check
            checks.append(Check("transport_selfcheck_vram", v is not None and v.passed,
                                "still running" if v is None else
                                f"path {v.path}, {v.bandwidth_bytes_s / 1e9:.2f} GB/s: "
                                f"{v.detail}"))
        draining = (f"; {len(self._drain)} ended engine(s) draining "
                    f"{sum(len(g.rank.holds) for g in self._drain)} hold(s)"
                    if len(self._drain) else "")
        checks.append(Check("not_draining", not self._stopping,
                            ("draining: shutting down" if self._stopping else "serving")
                            + draining))
        self.metrics.ready.set(all(c.ok for c in checks))
        return checks

    def _listener_check(self) -> Check:
        """Connect to the handshake port: proves it is bound and accepting."""
        if not self._hs_bound:
            return Check("handshake_listener", False, "not started")
        host, port = self._hs_bound.rsplit(":", 1)
        host = host.strip("[]")
        if host in ("0.0.0.0", "*", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                pass
        except OSError as e:
            return Check("handshake_listener", False, f"{self._hs_bound}: {e}")
        return Check("handshake_listener", True, f"accepting on {self._hs_bound}")

    async def _housekeeping(self) -> None:
        """Expire holds, drop early notifications, notice engines that died.

        Every ``HOUSEKEEPING_BUSY_S`` while some hold or early notification may
        expire, else every ``HOUSEKEEPING_IDLE_S`` (the liveness checks' own
        period): ten wake-ups a second were a third of an idle daemon's CPU. A
        new hold wakes it at once (``_tidy_wake``) when it sleeps the idle
        period; in the busy one it does not: a pass per hold (a task, a timer
        and a walk over every hold) cost P several µs per read."""
        last_liveness_check = 0.0
        while True:
            expiring = any(len(e.holds) or e.holds.early for e in self._ranks())
            self._tidy_busy = expiring
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._tidy_wake.wait(),
                                       HOUSEKEEPING_BUSY_S if expiring else HOUSEKEEPING_IDLE_S)
            self._tidy_wake.clear()
            now = time.monotonic()
            try:
                for eng in self._ranks():
                    before = eng.holds.unclaimed
                    eng.holds.expire(now)
                    if eng.holds.unclaimed != before:
                        self.metrics.notifications_received.labels(outcome="unclaimed").inc(
                            eng.holds.unclaimed - before)
                    self.metrics.hold_overrun.labels(eng.engine_id).set(eng.holds.max_overrun)
                if now - last_liveness_check >= 1.0:
                    last_liveness_check = now
                    self._check_liveness(now)
                    busy = set(self._engines) | set(self._registering)
                    for engine_id in self._reservations.stale(
                            now, self.settings.engine_lease_s, busy):
                        log.warning("engine %r reserved memory but did not register within "
                                    "--engine-lease (%g s): releasing the reservation",
                                    engine_id, self.settings.engine_lease_s)
                        self._spawn(self._drop_reservation(engine_id))
            except Exception:  # housekeeping must outlive any single bad entry
                log.exception("housekeeping pass failed; continuing")

    def _ranks(self) -> list[EngineRank]:
        """Every rank with holds to serve: registered ones, then draining ones."""
        return list(self._engines.values()) + [g.rank for g in self._drain]

    def _check_liveness(self, now: float) -> None:
        for eng in list(self._engines.values()):
            if eng.orphaned or eng.engine_id in self._registering:
                continue
            why = self._death(eng, now)
            if not why:
                continue
            self.metrics.engines_gone.labels(
                signal="pid" if why.startswith("its process") else "lease").inc()
            if eng.keep_on_exit:
                eng.orphaned = True
                log.warning("engine %r is gone (%s); its registration is kept for a restart",
                            eng.engine_id, why)
            else:
                log.warning("engine %r is gone (%s); releasing its resources", eng.engine_id,
                            why)
                self._spawn(self._drop_engine(eng.engine_id, f"engine gone: {why}",
                                              drain=True))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    @property
    def _drain_timeout(self) -> float:
        """How long to wait for posted reads: past their own deadline, so memory is
        never released while a transfer may still write into it."""
        return self.settings.read_timeout_s + 15.0

    async def _quiesce(self, eng: EngineRank, why: str) -> None:
        """Abort the engine's reads and wait until none can still write into its
        memory; forget its holds (nobody will hear about them)."""
        await self._reads.abort_all(eng.engine_id, why, self._drain_timeout)
        eng.holds.drop_engine(eng.engine_id)
        eng.worker.set_hot(False)

    def _prefault(self, eng: EngineRank, mem_type: str) -> None:
        """Map the pages of a host engine's regions now, in the background (see
        :mod:`~kvsidecar.daemon.prefault`): otherwise the first read into each
        block pays a page fault per 4 KiB. Registration does not wait for it.
        Memory the engine attached: only its pages that exist (no hole gets
        allocated on its behalf)."""
        if mem_type != "DRAM":
            return
        size = eng.layout.region_bytes
        done = asyncio.get_running_loop().run_in_executor(
            None, partial(prefault, [(r.address, size) for r in eng.regions],
                          existing_only=not eng.owned))
        done.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _attach_staging(self, eng: EngineRank, mem_type: str) -> None:
        """Staged reads (settings.staging) for host memory only: GPU engines always
        post scattered descriptors (no host bounce, no GPU scatter kernel here)."""
        if self.settings.staging == "off" or mem_type != "DRAM" or not self.settings.staging_bytes:
            return
        m, e = self.metrics, eng.engine_id

        def gauges(in_use: int, quarantined: int) -> None:
            m.staging_bytes_in_use.labels(e).set(in_use)
            m.staging_bytes_quarantined.labels(e).set(quarantined)

        eng.staging_mode = self.settings.staging
        eng.staging = StagingPool(self.settings.staging_bytes, eng.worker, gauges,
                                  m.staging_bytes_mapped.labels(e).set, lanes=eng.lanes)
        eng.staging.prepare()  # now, in the background: reads then find it ready

    async def _drop_engine(self, engine_id: str, why: str, drain: bool = False) -> None:
        """Forget an engine rank and free what it had. ``drain``: if it has holds
        open and its memory can be kept (see :mod:`~kvsidecar.daemon.drain`), its
        memory, agent and holds stay and keep serving readers until the holds
        end; only then is everything freed. Its own reads are aborted either way."""
        eng = self._engines.pop(engine_id, None)
        if eng is None:
            return
        eng.wake_pollers()
        self._hs_server.invalidate(engine_id)
        gen = self._start_drain(eng, why) if drain else None
        if gen is not None:
            await self._reads.abort_all(eng.engine_id, why, self._drain_timeout)
            gen.quiet = True  # nothing of its own reads writes into its memory any more
            self._maybe_free(gen)
            return
        await self._quiesce(eng, why)
        await self._free_rank(eng, self._reservations.pop(engine_id), why)

    async def _free_rank(self, eng: EngineRank, reservation: Reservation | None,
                         why: str) -> None:
        """Stop a forgotten rank's workers, free its memory and its reservation."""
        engine_id = eng.engine_id
        await self._hashing.drain(engine_id)  # no hash reads its memory any more
        for lane in eng.lanes:  # every lane: its thread, agent and registrations
            try:
                await lane.stop()
            except Exception as e:
                log.warning("stopping a NIXL worker of engine %r failed: %s", engine_id, e)
                self.metrics.cleanup_failures.labels(what="worker").inc()
            if lane.cleanup_failures:  # NIXL deregistrations that failed (logged there)
                self.metrics.cleanup_failures.labels(what="nixl_deregister").inc(
                    lane.cleanup_failures)
        if eng.staging is not None:
            eng.staging.close()  # its workers (and every transfer into it) are gone
        self._fds.withdraw(eng.fd_token)
        await self._release_regions(eng.regions, eng.owned)
        if reservation is not None:  # views into it were just released
            self._fds.withdraw(reservation.fd_token)
            await self._release_regions([reservation.region], True)
        self.metrics.engines.set(len(self._engines))
        if engine_id not in self._engines:
            self.metrics.forget_engine(engine_id)
        log.info("engine %r released (%s)", engine_id, why)

    # ------------------------------------------------------------ draining

    def _start_drain(self, eng: EngineRank, why: str) -> Generation[EngineRank] | None:
        """Keep ``eng`` (already forgotten as a registration) serving its open holds,
        when it has any and its memory stays valid without its engine; None otherwise."""
        if not len(eng.holds):
            return None
        kinds = frozenset(_kind(r) for r in eng.regions) if not eng.owned else frozenset()
        if not keepable(eng.owned, kinds):
            log.warning("engine %r ended with %d hold(s) open on memory it allocated itself "
                        "(%s): the holds end now, as the memory goes with its process",
                        eng.engine_id, len(eng.holds), ", ".join(sorted(kinds)))
            return None
        if len(self._drain) >= self.settings.max_engines:
            # Each generation keeps an agent (a thread) and its memory: bounded like
            # registrations (a loop of register, hold, deregister would grow it).
            self.metrics.limit_refusals.labels("", "draining").inc()
            log.warning("engine %r ended with %d hold(s) open, but %d ended engines drain "
                        "already (--max-engines): its holds end now", eng.engine_id,
                        len(eng.holds), len(self._drain))
            return None
        nbytes = len(eng.regions) * eng.layout.region_bytes
        gen = self._drain.start(eng.engine_id, eng, why, nbytes, time.monotonic())
        reservation = self._reservations.pop(eng.engine_id)
        if reservation is not None:  # a new registration of the id reserves anew
            self._drain_reserved[gen.number] = reservation
        self._fds.withdraw(eng.fd_token)  # nobody may map it again
        eng.fd_token = ""
        counted = eng.on_complete

        def ended(engine_id: str, c: Completion) -> None:
            if counted is not None:
                counted(engine_id, c)
            if c.kind in ("sent", "aborted", "expired"):
                self._drain.ended(gen, c.kind)
                self.metrics.drained_holds.labels(outcome=c.kind).inc()
                eng.completions.clear()  # nobody polls them
                self._maybe_free(gen)

        eng.on_complete = ended
        eng.completions.clear()
        self.metrics.engines.set(len(self._engines))
        if eng.engine_id not in self._engines:
            self.metrics.forget_engine(eng.engine_id)
        if not self._tidy_busy:  # housekeeping expires its holds
            self._tidy_wake.set()
        log.warning("engine %r rank %d ended (%s) with %d hold(s) open: its memory (%d B) "
                    "stays registered and serves them until they end (generation %d)",
                    eng.engine_id, eng.tp_rank, why, len(eng.holds), nbytes, gen.number)
        return gen

    def _maybe_free(self, gen: Generation[EngineRank]) -> None:
        """Free a draining generation once its reads are over and its last hold ended."""
        if self._drain.may_free(gen, len(gen.rank.holds)):
            self._spawn(self._free_generation(gen))

    def _cut_drain(self, gen: Generation[EngineRank], why: str) -> None:
        """End a generation's drain now: its open holds are dropped (counted)."""
        eng = gen.rank
        dropped = eng.holds.drop_engine(eng.engine_id)
        if dropped:
            gen.outcomes["dropped"] += dropped
            self.metrics.drained_holds.labels(outcome="dropped").inc(dropped)
            log.warning("engine %r generation %d: %d hold(s) still open dropped: %s",
                        gen.engine_id, gen.number, dropped, why)
        gen.quiet = True
        self._maybe_free(gen)

    async def _free_generation(self, gen: Generation[EngineRank]) -> None:
        eng = gen.rank
        eng.worker.set_hot(False)
        try:
            await self._free_rank(eng, self._drain_reserved.pop(gen.number, None),
                                  f"drained: {gen.why}")
        finally:
            self._drain.finish(gen)
            self._hs_server.invalidate(gen.engine_id)
        log.info("%s", gen.summary(time.monotonic()))

    async def _drain_holds(self, timeout_s: float) -> None:
        """SIGTERM: let every open hold (registered engines' and draining ones') end,
        for at most ``timeout_s``; new holds are refused meanwhile."""
        def open_holds() -> int:
            return (sum(len(e.holds) for e in self._engines.values())
                    + sum(len(g.rank.holds) for g in self._drain))
        left = open_holds()
        if not left or timeout_s <= 0:
            return
        log.info("draining %d open hold(s) for up to %g s (--drain-timeout)", left, timeout_s)
        deadline = time.monotonic() + timeout_s
        while left and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            left = open_holds()
        (log.warning if left else log.info)(
            "drain %s: %d hold(s) still open", "cut short" if left else "done", left)

    def _ranks_of(self, engine_id: str) -> list[EngineRank]:
        """Every rank object serving ``engine_id``: the registered one first, then
        its draining generations, newest first."""
        current = self._engines.get(engine_id)
        ranks = [current] if current is not None else []
        return ranks + [g.rank for g in self._drain.of_engine(engine_id)] if len(
            self._drain) else ranks

    def _holder(self, engine_id: str, request_id: str) -> EngineRank | None:
        """The rank (registered or draining) whose holds include this request, else
        the registered rank (early notifications and claims wait there)."""
        if not len(self._drain):  # the common case: one lookup per claim or notification
            return self._engines.get(engine_id)
        for eng in self._ranks_of(engine_id):
            if (engine_id, request_id) in eng.holds:
                return eng
        return self._engines.get(engine_id)

    async def _release_regions(self, regions: list[Region], owned: bool) -> None:
        """Give the memory back off the event loop (hundreds of ms per GB)."""
        failures = await asyncio.get_running_loop().run_in_executor(
            None, release_regions, regions, owned)
        if failures:
            log.warning("%d region(s) could not be released", failures)
            self.metrics.cleanup_failures.labels(what="memory").inc(failures)


async def _every(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Await all side by side; raise the first failure once every one ended.
    (``gather`` raises at the first and leaves the others' failures unread:
    asyncio then logs "Task exception was never retrieved" for each lane that
    failed too, and a lane may still be starting while the caller stops it.)"""
    got = await asyncio.gather(*aws, return_exceptions=True)
    for g in got:
        if isinstance(g, BaseException):
            raise g
    return got  # type: ignore[return-value]


def _worker_thread_init(gpu: CudaDevice | None) -> None:
    """First thing on a NIXL worker thread: its OS name, then (GPU) its CUDA context."""
    name_this_thread("kvs-nixl")
    if gpu is not None:
        gpu.make_current()


def _same_process(a: Register | EngineRank, b: Register) -> bool:
    return bool(b.instance) and a.instance == b.instance


def _same_registration(a: Register, b: Register) -> bool:
    return ((a.tp_rank, a.layout, a.mode, a.regions, a.memory)
            == (b.tp_rank, b.layout, b.mode, b.regions, b.memory))


def _same_registration_of(eng: EngineRank, req: Register) -> bool:
    mode = "allocate" if eng.owned else "attach"
    refs = [] if eng.owned else [r.ref() for r in eng.regions]
    memory = req.memory if req.mode == "allocate" else ""
    return (eng.tp_rank, eng.layout, mode, refs, eng.memory) == (req.tp_rank, req.layout,
                                                                 req.mode, req.regions, memory)


def _retrieve(f: asyncio.Future[Reply]) -> None:
    """Mark a registration's outcome as seen (its first caller raised it already)."""
    if not f.cancelled():
        f.exception()


def _kind(r: Region) -> str:
    """A region's kind, as its reference is tagged (shm, reserved, cuda_ipc, ...)."""
    return str(type(r.ref()).__struct_config__.tag)


def _own_pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _release_late_mapping(f: asyncio.Future[tuple[list[Region], bool]]) -> None:
    if not f.cancelled() and f.exception() is None:
        release_regions(*f.result())


def _mine(eng: EngineRank) -> bool:
    """Whether the engine whose request is being answered may see ``eng``: the
    uid that registered it (anything goes where either side is unknown)."""
    peer = current_peer.get()
    return peer is None or eng.uid is None or peer.uid == eng.uid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
    return True
