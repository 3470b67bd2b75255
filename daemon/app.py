"""The sidecar: constructs its parts, starts them, and stops them (draining first).

Parts and who owns what:

- the engine socket (:class:`~kvsidecar.daemon.engine_server.EngineServer`)
  hands each request to :class:`~kvsidecar.daemon.handlers.Handlers`;
- the handshake port (:class:`~kvsidecar.daemon.peers.server.HandshakeServer`)
  answers handshakes from the engine table, and readers' control messages
  through :mod:`~kvsidecar.daemon.p_side`;
- :class:`~kvsidecar.daemon.engines.table.EngineTable` holds the engine
  ranks; :class:`~kvsidecar.daemon.engines.registry.Registry` adds them,
  :class:`~kvsidecar.daemon.engines.departures.Departures` takes them away;
  each :class:`~kvsidecar.daemon.engines.rank.EngineRank` owns its memory,
  workers, holds, peer links and completion queue;
- the :class:`~kvsidecar.daemon.reads.ReadTable` owns read jobs until their
  completion is delivered;
- :mod:`~kvsidecar.daemon.observability` samples gauges and answers the
  health probes; :mod:`~kvsidecar.daemon.housekeeping` expires holds and
  notices dead engines.

The public surface is the constructor ``Sidecar(settings, metrics=...,
tracing=...)``, :meth:`Sidecar.start`, :meth:`Sidecar.stop`,
:meth:`Sidecar.handle`, :meth:`Sidecar.liveness`, :meth:`Sidecar.readiness`,
:meth:`Sidecar.engine_ids`, and the facts ``daemon_id``,
``handshake_address``, ``peer_auth``, ``refused`` and ``refusal``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from kvsidecar.daemon import digest
from kvsidecar.daemon.background import Alarm, Background
from kvsidecar.daemon.conn_guard import fd_budget
from kvsidecar.daemon.cuda_device import CudaDevice
from kvsidecar.daemon.d_side.table import ReadTable
from kvsidecar.daemon.engine_access import AccessPolicy
from kvsidecar.daemon.engine_server import EngineServer
from kvsidecar.daemon.engines.departures import Departures
from kvsidecar.daemon.engines.memory import remove_stale_segments
from kvsidecar.daemon.engines.registry import Registry
from kvsidecar.daemon.engines.table import EngineTable
from kvsidecar.daemon.fd_server import FdServer
from kvsidecar.daemon.handlers import Context, Handlers
from kvsidecar.daemon.health import Check
from kvsidecar.daemon.housekeeping import housekeeping
from kvsidecar.daemon.observability import Health, Sampler, TransportChecks
from kvsidecar.daemon.p_side.control import ControlAnswers
from kvsidecar.daemon.p_side.digests import Digests
from kvsidecar.daemon.p_side.readers import Readers
from kvsidecar.daemon.p_side.spans import HoldSpans
from kvsidecar.daemon.peer_auth import PeerKeys, load_keys
from kvsidecar.daemon.peers.client import MAX_CONNECTIONS as HANDSHAKE_CLIENT_CONNECTIONS
from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.peers.server import HandshakeServer
from kvsidecar.daemon.reservations import Reservations
from kvsidecar.daemon.settings import Settings
from kvsidecar.daemon.state import DaemonState
from kvsidecar.daemon.thread_names import name_this_thread
from kvsidecar.daemon.tracing import Tracing
from kvsidecar.daemon.verify import Hashing, Verifier
from kvsidecar.ipc.cuda_handles import attach_policy, parse_cuda_device
from kvsidecar.ipc.fdpass import fd_socket_for
from kvsidecar.ipc.protocol import Reply, Request
from kvsidecar.metrics.registry import Metrics

log = logging.getLogger(__name__)


class Sidecar:
    def __init__(self, settings: Settings, metrics: Metrics | None = None,
                 tracing: Tracing | None = None) -> None:
        self.settings = settings
        #: This daemon's metrics; nothing is shared with another Sidecar in the process.
        self.metrics = metrics if metrics is not None else Metrics()
        #: OpenTelemetry spans when --otlp-endpoint is set (or a test passes an exporter)
        self.tracing = tracing if tracing is not None else Tracing(settings.otlp_endpoint)
        self.state = DaemonState()
        # No keys only when the operator said so (--insecure-peers); a missing
        # or unsafe key file raises ValueError here, before anything is bound.
        self._keys = None if settings.insecure_peers else load_keys(settings.peer_keys)
        self.peer_auth = "curve" if self._keys is not None else "none"
        self.background = Background()
        self.alarm = Alarm()
        self.table = EngineTable()
        self.spans = HoldSpans(self.tracing)
        self._hashing = Hashing()  # hashing threads of byte verification: D's reads, P's digests
        self._planner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvs-plan",
                                           initializer=name_this_thread, initargs=("kvs-plan",))
        self._peers(settings, self._keys)
        self._engine_server(settings)
        self._reservations = Reservations(on_limit=lambda _engine_id: self.metrics
                                          .limit_refusals.labels("", "reservations").inc())
        self.departures = Departures(
            self.table, settings, self.metrics, self._reads, self._hashing, self._fds,
            self._reservations, self._hs_server.invalidate, self.background, self.alarm)
        self.registry = Registry(
            self.table, self.departures, self.state, settings, self.metrics, self._hs_client,
            self._fds, self._reservations, self.spans, self.readers.on_notif,
            self._hs_server.invalidate, self.background)
        self.sampler = Sampler(self.table, self._reads, self.metrics)
        self.transport = TransportChecks(settings, self.metrics, self.state)
        self.health = Health(settings, self.metrics, self.state, self.table, self.sampler,
                             self.transport)
        self.handlers = Handlers(Context(
            settings, self.metrics, self.state, self.table, self.registry, self.departures,
            self._reads, self._hs_client, self.spans, self.background, self.alarm, self.health,
            self.transport))
        self._tasks: list[asyncio.Task[None]] = []
        self.metrics.engines_draining.set_function(lambda: len(self.table.drain))
        self.metrics.drain_bytes.set_function(lambda: self.table.drain.nbytes)

    def _peers(self, settings: Settings, keys: PeerKeys | None) -> None:
        """The handshake client and server, the read table, and P's answers."""
        m = self.metrics
        if keys is not None and keys.shared:
            log.warning("peer keys: %s admits no member key but its own (one shared fleet "
                        "key): members cannot be told apart, any one of them may claim, renew "
                        "or abandon another's reads. Give each sidecar its own key (README, "
                        "Security)", settings.peer_keys)
        self._hs_client = HandshakeClient(
            timeout_s=settings.handshake_timeout_s, keys=keys,
            max_connections=fd_budget(HANDSHAKE_CLIENT_CONNECTIONS, 0.25),
            on_evict=lambda what: m.peer_cache_evictions.labels(what).inc(),
            on_control_sent=m.control_items.labels(side="sent").observe)
        self._reads = ReadTable(self._planner, self._hs_client, settings.read_timeout_s,
                                self.table.deliver, m)
        self._reads.tracing = self.tracing
        self._reads.verifier = Verifier(self._hs_client, self._hashing,
                                        fake_fault=digest.fake_fault_prefix())
        if self._reads.verifier.fake_fault:
            log.warning("FAKE FAULT armed (%s): verified reads whose request id starts with %r "
                        "get one landed byte flipped before their digest (tests only)",
                        digest.FAKE_FAULT_ENV, self._reads.verifier.fake_fault)
        self.readers = Readers(self.table, m, self.spans)
        self.control = ControlAnswers(self.table, Digests(self.table, self._hashing, m), m)
        self._hs_server = HandshakeServer(
            f"tcp://{settings.bind_host}:{settings.handshake_port}", self.table.lookup,
            keys=keys, max_connections=fd_budget(settings.max_peer_connections, 0.5),
            on_refuse=lambda reason: m.refused.labels(channel="peer", reason=reason).inc(),
            on_reader=self.readers.declare, control=self.control.answer)
        m.counter_from(
            "kvsidecar_handshake_requests", "Handshake requests this sidecar's server received, "
            "good or bad", lambda: self._hs_server.requests_received)

    def _engine_server(self, settings: Settings) -> None:
        """The engine socket and, beside it, the fd socket."""
        m = self.metrics
        self._server = server = EngineServer(
            settings.socket, self,
            access=AccessPolicy.of(settings.allow_uids, settings.allow_gids),
            max_message_bytes=settings.max_message_bytes,
            max_connections=fd_budget(settings.max_engine_connections, 0.25),
            max_connections_per_uid=settings.max_engine_connections_per_uid,
            max_assembling_bytes=settings.max_assembling_bytes or None,
            long_message_timeout_s=settings.long_message_timeout_s,
            idle_timeout_s=settings.engine_idle_timeout_s,
            on_refuse=lambda reason: m.refused.labels(channel="engine", reason=reason).inc(),
            burst=self._reads.together,
            engine_live=self._engine_live,
        )
        m.engine_assembling_bytes.set_function(lambda: server.assembling_bytes)
        m.counter_from(
            "kvsidecar_engine_connections_paused", "Times the engine server stopped reading "
            "a connection whose engine left 64 replies unread (read again once it reads "
            "them; nothing is lost)", lambda: server.paused_unread)
        #: hands memfd / CUDA VMM fds to the engine that registered them (SCM_RIGHTS)
        self._fds = FdServer(
            fd_socket_for(settings.socket), server.access,
            max_connections_per_uid=settings.max_engine_connections_per_uid,
            on_refuse=lambda reason: m.refused.labels(channel="fd", reason=reason).inc())

    def _engine_live(self, engine_id: str) -> bool:
        """Whether ``engine_id`` is still registered (and not orphaned: its process
        is gone), being registered, or holds a reservation: its connections are
        then exempt from the engine socket's idle rules."""
        eng = self.table.get(engine_id)
        if eng is not None:
            return not eng.orphaned
        return (engine_id in self.table.registering
                or self._reservations.of(engine_id, None) is not None)

    # ------------------------------------------------------------ facts

    @property
    def daemon_id(self) -> str:
        return self.state.daemon_id

    @property
    def handshake_address(self) -> str:
        """The address peers dial for handshakes ('' until started)."""
        return self.state.handshake_address

    @property
    def refused(self) -> asyncio.Event:
        """Set when the start-up transport self-check failed under
        ``--transport-check require-zero-copy`` (the reason: :attr:`refusal`)."""
        return self.transport.refused

    @property
    def refusal(self) -> str:
        return self.transport.refusal

    def engine_ids(self) -> list[str]:
        return list(self.table.ranks)

    def liveness(self) -> list[Check]:
        """Event loop and NIXL worker threads responsive (any thread may call this)."""
        return self.health.liveness()

    def readiness(self) -> list[Check]:
        """Liveness plus agents up, listener bound, self-check passed, not draining."""
        return self.health.readiness()

    async def handle(self, req: Request) -> Reply:
        """Answer one engine request (the engine server calls this)."""
        return await self.handlers.handle(req)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the GPU (if any), bind the handshake port, the engine socket and the
        fd socket, remove this sidecar's leftovers, start the background loops."""
        await self._open_gpu()
        bound = await self._hs_server.start()
        self.state.handshake_bound = bound
        port = bound.rsplit(":", 1)[1]
        self.state.handshake_address = f"{self.settings.advertised}:{port}" + (
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
            None, remove_stale_segments, self.registry.shm_prefix)
        if stale:
            log.warning("removed %d shared memory segment(s) a previous run of this sidecar "
                        "left in /dev/shm: %s", len(stale), ", ".join(stale))
        self._tasks.append(asyncio.ensure_future(housekeeping(
            self.registry, self.alarm, self.background, self.metrics)))
        self._tasks.append(asyncio.ensure_future(self.sampler.run()))
        if self.settings.transport_check != "off":
            self._tasks.append(asyncio.ensure_future(self.transport.run()))
        log.info("kvsidecar %s serving engines on %s, handshakes on %s (peers dial %s)",
                 self.daemon_id, self.settings.socket, bound, self.handshake_address)

    async def _open_gpu(self) -> None:
        """Before anything listens: a GPU sidecar without its GPU must not start
        (CudaError, which the CLI prints as one line)."""
        ordinal = parse_cuda_device(self.settings.device)
        if ordinal is None:
            return
        if self.settings.verify_bytes:
            digest.digester_for("VRAM")  # DigestUnavailable: no GPU digester yet
        gpu = CudaDevice(ordinal, attach_policy(self.settings.cuda_attach))
        await asyncio.get_running_loop().run_in_executor(None, gpu.open)
        self.state.gpu = gpu

    async def stop(self, drain_s: float = 2.0) -> None:
        """Stop accepting, finish or fail in-flight reads, release everything.

        New registrations, reads and holds are refused (``unavailable``) from
        the first moment; reads not yet posted are aborted, posted ones run to
        completion (memory must not go while NIXL writes into it); open holds
        get ``--drain-timeout`` to end. Engines may keep polling for up to
        ``drain_s`` so they learn every outcome before the socket goes away.
        """
        if self.state.stopping:
            return
        self.state.stopping = True
        await self._drain(drain_s)
        await self._server.stop()
        await self._fds.stop()
        for t in self._tasks:
            t.cancel()
        await self._release_all()
        await self._hs_server.stop()
        await self._hs_client.close()
        self._planner.shutdown(wait=False, cancel_futures=True)
        self._hashing.close()
        self.tracing.shutdown()
        log.info("kvsidecar %s stopped", self.daemon_id)

    async def _drain(self, drain_s: float) -> None:
        """Abort unposted reads, let registrations and holds finish, let engines
        poll their last completions (at most ``drain_s``)."""
        ranks = self.table.ranks
        for eng in ranks.values():
            eng.wake_pollers()
        timeout = self.departures.drain_timeout
        await self._reads.abort_all(None, "the sidecar is shutting down", timeout,
                                    posted_too=False)
        deadline = time.monotonic() + timeout
        while self.table.registering and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # a registration half-way would leak its memory
        await self.departures.drain_holds(self.settings.drain_timeout_s)
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and any(e.completions for e in ranks.values()):
            await asyncio.sleep(0.01)

    async def _release_all(self) -> None:
        """Free every engine rank, draining generation and reservation."""
        await self.background.wait(60)
        for engine_id in list(self.table.ranks):
            await self.departures.drop_engine(engine_id, "daemon shutting down")
        for gen in self.table.drain:  # --drain-timeout passed with holds still open
            self.departures.cut_drain(gen, "the sidecar stopped (--drain-timeout)")
        await self.background.wait(60)
        for engine_id in self._reservations.engine_ids():
            await self.departures.drop_reservation(engine_id)
