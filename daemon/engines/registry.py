"""Registering engine ranks: new registrations, retries, restarts, reservations, liveness.

``register`` answers a ``Register``: a retry of a registration in progress
joins it; the same process registering the same rank again gets the same
registration; a restarted engine takes over its kept (``keep_on_exit``)
registration once the old process is dead; anything else is a new rank whose
memory is mapped (or allocated) off the event loop, registered with a NIXL
worker per lane, and published to peers. ``reserve`` allocates memory for an
engine that registers later. ``check_liveness`` finds engines whose process
died and drops (or, if kept, orphans) them. Departures are
:class:`~kvsidecar.daemon.engines.departures.Departures`'.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from functools import partial

import msgspec
import numpy as np

from kvsidecar.daemon import memory_kinds, region_budget
from kvsidecar.daemon.background import Background
from kvsidecar.daemon.engine_access import current_peer
from kvsidecar.daemon.engines.departures import Departures
from kvsidecar.daemon.engines.lanes import Lanes, make_lanes, start_lanes
from kvsidecar.daemon.engines.liveness import (
    death,
    drains_when_gone,
    own_pid_namespace,
    pid_visible,
)
from kvsidecar.daemon.engines.memory import (
    attach_staging,
    map_regions,
    prefault_rank,
    release_late_mapping,
    release_regions,
    shm_prefix_for,
)
from kvsidecar.daemon.engines.rank import EngineRank
from kvsidecar.daemon.engines.table import EngineTable, mine
from kvsidecar.daemon.fd_server import FdServer
from kvsidecar.daemon.memory_kinds import MemoryContext
from kvsidecar.daemon.p_side.spans import HoldSpans
from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.peers.links import PeerLinks
from kvsidecar.daemon.peers.messages import make_handshake_info
from kvsidecar.daemon.reservations import Reservation, Reservations
from kvsidecar.daemon.settings import Settings
from kvsidecar.daemon.state import DaemonState
from kvsidecar.daemon.transport.worker import AgentReset
from kvsidecar.ipc import hold_token
from kvsidecar.ipc.layout import Layout, LayoutError, fingerprinted, validate
from kvsidecar.ipc.protocol import (
    BAD_REQUEST,
    DUPLICATE,
    UNAVAILABLE,
    Register,
    Registered,
    Reply,
    RequestError,
    Reserve,
    Reserved,
)
from kvsidecar.ipc.regions import FdExport, Region, uniform
from kvsidecar.metrics.registry import Metrics

log = logging.getLogger(__name__)


class Registry:
    def __init__(self, table: EngineTable, departures: Departures, state: DaemonState,
                 settings: Settings, metrics: Metrics, hs_client: HandshakeClient,
                 fds: FdServer, reservations: Reservations, spans: HoldSpans,
                 on_notif: Callable[[str, str, bytes], None],
                 invalidate: Callable[[str], None], background: Background) -> None:
        self.table = table
        self.departures = departures
        self.state = state
        self.settings = settings
        self.metrics = metrics
        self.hs_client = hs_client
        self.fds = fds
        self.reservations = reservations
        self.spans = spans
        #: ``on_notif(engine_id, agent, message)``: a NIXL notification for a rank
        self.on_notif = on_notif
        #: forget a handshake answer (the handshake server's cache) for an engine id
        self.invalidate = invalidate
        self.background = background
        self.shm_prefix = shm_prefix_for(settings.socket)
        self._pid_ns = own_pid_namespace()
        #: engine id -> (the Reserve, its uid, its outcome) while it is being allocated
        self._reserving: dict[str, tuple[Reserve, int | None, asyncio.Future[Reservation]]] = {}

    # ------------------------------------------------------------ register

    async def register(self, req: Register) -> Reply:
        """Answer a ``Register`` (see the module docstring)."""
        self.table.refuse_releasing(req.engine_id)  # its old memory may still be written
        registering = self.table.registering
        inflight = registering.get(req.engine_id)
        if inflight is not None:
            first, reply = inflight
            if _same_process(first, req) and _same_registration(first, req):
                return await asyncio.shield(reply)  # a retry joins the registration it began
            raise RequestError(DUPLICATE, f"engine {req.engine_id!r} is being registered")
        reply = asyncio.get_running_loop().create_future()
        reply.add_done_callback(_retrieve)
        registering[req.engine_id] = (req, reply)
        try:
            old = self.table.get(req.engine_id)
            result = await (self._reattach(old, req) if old is not None
                            else self._register_new(req))
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
            del registering[req.engine_id]

    async def _register_new(self, req: Register) -> Reply:
        layout = _layout_of(req)
        self._check_engine_room()
        self._check_region_room(req, layout)
        peer = current_peer.get()
        uid = peer.uid if peer is not None else None
        regions, owned = await self._map(req, layout, uid)
        agent = (f"kvs-{req.engine_id}-r{req.tp_rank}-{self.state.daemon_id[:8]}-"
                 f"{uuid.uuid4().hex[:6]}")
        e = req.engine_id
        workers = make_lanes(agent, self.settings.backends, self.settings.post_lanes,
                             self.state.gpu, partial(self.on_notif, e),
                             partial(self._on_agent_reset, e), partial(self._on_lane_reset, e),
                             progress_thread_ms=self.settings.nixl_progress_thread_ms)
        mem_type, device = uniform(regions)
        try:
            lanes = await start_lanes(workers, layout, regions, mem_type, device.index)
        except BaseException as exc:
            await self.departures.release_regions(regions, owned)
            raise RequestError(BAD_REQUEST, f"NIXL registration failed: {exc}") from None
        eng = self._new_rank(req, layout, regions, owned, lanes, uid)
        prefault_rank(eng, mem_type)
        attach_staging(eng, mem_type, self.metrics)
        eng.fd_token = self._offer_fds(eng)
        self.table.ranks[req.engine_id] = eng
        self.metrics.engine_arrived(req.engine_id)
        self.invalidate(req.engine_id)
        self.metrics.engines.set(len(self.table))
        log.info("registered engine %r rank %d/%d (%s, %d regions x %d B, %s)", req.engine_id,
                 req.tp_rank, layout.tp_size, layout.family, layout.num_regions,
                 layout.region_bytes, req.mode)
        return self.registered(eng)

    async def _map(self, req: Register, layout: Layout,
                   uid: int | None) -> tuple[list[Region], bool]:
        """Map (attach) or create (allocate) the regions, off the loop: it touches
        every page (about 1 s per GB), and other engines keep being served."""
        reserved = self.reservations.of(req.engine_id, uid)
        mapping = asyncio.get_running_loop().run_in_executor(
            None, partial(map_regions, req.engine_id, layout, req.mode, req.regions,
                          self.shm_prefix, uid, req.memory, self.state.gpu,
                          reserved.region if reserved else None,
                          allow_unsealed_shm=self.settings.allow_unsealed_shm))
        try:
            return await asyncio.shield(mapping)
        except asyncio.CancelledError:
            # The thread finishes anyway: release what it creates.
            mapping.add_done_callback(release_late_mapping)
            raise

    def _new_rank(self, req: Register, layout: Layout, regions: list[Region], owned: bool,
                  lanes: Lanes, uid: int | None) -> EngineRank:
        worker = lanes.workers[0]
        mem_type, device = uniform(regions)
        bases = [r.address for r in regions]
        key = hold_token.new_key()
        m, e = self.metrics, req.engine_id
        # The layout's fingerprint facts, once per registration: the handshake info
        # carries the fingerprint, and every link's handshake compares against them.
        facts = fingerprinted(layout)
        peers = PeerLinks(worker, facts, self.hs_client, on_link=self._count_link,
                          lanes=lanes.workers,
                          on_unload_failed=m.cleanup_failures.labels(what="remote_agent").inc,
                          reader=(e, req.tp_rank),
                          readable=("DRAM", "VRAM") if self.state.gpu is not None else ("DRAM",),
                          max_links=self.settings.max_peer_links_per_engine,
                          on_evict=m.peer_links_evicted.labels(e).inc,
                          on_refused=m.limit_refusals.labels(e, "peer_links").inc)
        info = make_handshake_info(
            engine_id=e, tp_rank=req.tp_rank, agent_name=worker.agent_name,
            agent_metadata=lanes.metadata, layout=facts, bases=bases,
            daemon_id=self.state.daemon_id, mem_type=mem_type, dev_id=device.index,
            device_uuid=device.uuid, notif_batch_reads=self.settings.notif_batch_reads,
            hold_key=hold_token.checking_key(key))
        return EngineRank(
            engine_id=e, tp_rank=req.tp_rank, layout=layout, regions=regions, owned=owned,
            keep_on_exit=req.keep_on_exit, pid=req.pid, worker=worker, lanes=lanes.workers,
            reg_id=lanes.reg_id, bases=np.array(bases, dtype=np.int64), peers=peers, info=info,
            settings=self.settings, metrics=m,
            on_complete=self.spans.completed if self.spans.tracing.enabled else None,
            instance=req.instance, pid_visible=self._pid_visible(req), uid=uid,
            memory=req.memory if req.mode == "allocate" else "", hold_key=key)

    def _check_region_room(self, req: Register, layout: Layout) -> None:
        """Refuse regions past what this sidecar's fds and memory maps allow
        (:mod:`kvsidecar.daemon.region_budget`): one engine must not take the
        fds every connection needs. The regions of the other registrations under
        way count too (their mappings may not be open yet); one series for all
        refusals, as for ``--max-engines``."""
        pending = sum(r.layout.num_regions for e, (r, _) in self.table.registering.items()
                      if e != req.engine_id and e not in self.table.ranks)
        allowed, why = region_budget.regions_allowed(region_budget.usage())
        if layout.num_regions + pending > allowed:
            self.metrics.limit_refusals.labels("", "regions").inc()
            under_way = f"; {pending} more being registered" if pending else ""
            raise RequestError(UNAVAILABLE, f"{layout.num_regions} regions do not fit: this "
                                            f"sidecar can map {max(0, allowed - pending)} more "
                                            f"now ({why}{under_way})")

    def _check_engine_room(self) -> None:
        """Refuse a new engine past ``--max-engines``: each one is a NIXL agent (its
        own thread, its fds and its memory) plus the engine's memory, and engines of an
        allowed uid could otherwise register until the daemon ran out of fds.
        Engines being registered count (this one among them); one series for all
        refusals, as a refused id is not an engine of this daemon."""
        limit = self.settings.max_engines
        ranks = self.table.ranks
        new = sum(1 for e in self.table.registering if e not in ranks)
        if len(ranks) + new > limit:
            self.metrics.limit_refusals.labels("", "engines").inc()
            raise RequestError(UNAVAILABLE, f"this sidecar serves {len(ranks)} engines "
                                            f"and registers {new - 1} more (--max-engines "
                                            f"{limit}): deregister one first")

    def registered(self, eng: EngineRank) -> Registered:
        """The reply to a registration of ``eng`` (new, retried or reattached)."""
        return Registered(engine_id=eng.engine_id,
                          handshake_address=self.state.handshake_address,
                          agent_name=eng.worker.agent_name,
                          regions=[r.ref() for r in eng.regions] if eng.owned else [],
                          fd_socket=self.fds.path if eng.fd_token else "",
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
        token = self.fds.offer([r.fd for r in exported], uid, what)
        for i, r in enumerate(exported):
            r.share(token, i)
        return token

    def _pid_visible(self, req: Register) -> bool:
        return pid_visible(req, self._pid_ns, self.settings.engine_lease_s)

    # ------------------------------------------------------------ restart

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
        if not mine(old):
            raise RequestError(DUPLICATE, f"engine id {req.engine_id[:200]!r} is taken")
        if _same_process(old, req) and _same_registration_of(old, req):
            old.last_seen = time.monotonic()
            log.info("engine %r rank %d registered again by the same process: same "
                     "registration", req.engine_id, old.tp_rank)
            return self.registered(old)
        self._check_takeover(old, req)
        await self.departures.quiesce(old, "the engine restarted")
        old.completions.clear()
        log.info("engine %r rank %d reattached (pid %d -> %d)", req.engine_id, old.tp_rank,
                 old.pid, req.pid)
        old.pid = req.pid
        old.pid_visible = self._pid_visible(req)
        old.instance = req.instance
        old.orphaned = False
        old.last_seen = time.monotonic()
        old.keep_on_exit = req.keep_on_exit
        return self.registered(old)

    def _check_takeover(self, old: EngineRank, req: Register) -> None:
        """Refuse a restarted engine's registration that may not take ``old`` over."""
        lease_s = self.settings.engine_lease_s
        if not (old.keep_on_exit and (old.orphaned or death(old, time.monotonic(), lease_s))):
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

    def _on_agent_reset(self, engine_id: str, reset: AgentReset) -> None:
        """The engine's NIXL agent was destroyed and created again (a read failed):
        publish its new name and metadata and drop every link loaded into the old one."""
        eng = next((r for r in self.table.ranks_of(engine_id)
                    if r.worker.agent_name == reset.agent_name), None)
        if eng is None:  # the agent of a rank already freed
            return
        # Only the agent changed: the memory's kind and device, the hold key and the
        # layout's fingerprint stay (rebuilt from scratch they were lost, and readers
        # refused every read from this rank until it registered again).
        eng.info = msgspec.structs.replace(eng.info, agent_name=reset.agent_name,
                                           agent_metadata=reset.metadata)
        self.invalidate(engine_id)
        self._unlink_after_reset(eng, reset)

    def _on_lane_reset(self, engine_id: str, reset: AgentReset) -> None:
        """A lane other than 0 was reset (a read it carried failed): every link of the
        engine rank is dropped, as for lane 0 (see PeerLinks.reset), so the next read
        links again and loads its peers into the new agent. Peers never knew this
        agent (the handshake declares lane 0's), so nothing is published."""
        eng = self.table.get(engine_id)
        if eng is not None:
            self._unlink_after_reset(eng, reset)

    def _unlink_after_reset(self, eng: EngineRank, reset: AgentReset) -> None:
        """Count a reset of one of ``eng``'s agents and drop every link of the rank."""
        e = eng.engine_id
        self.metrics.agent_resets.labels(e).inc()
        self.metrics.agent_reset_seconds.labels(e).observe(reset.teardown_s)
        self.metrics.late_completions.labels(e).inc(reset.reads_failed)
        for address, remote_engine, _ in eng.peers.reset():
            self.hs_client.forget(address, remote_engine)

    def _count_link(self, ok: bool) -> None:
        self.metrics.handshakes.labels(side="client", result="ok" if ok else "failed").inc()

    # ------------------------------------------------------------ reservations

    async def reserve(self, req: Reserve) -> Reply:
        """One allocation of ``nbytes`` for an engine that learns its layout from
        its own allocator (see daemon/reservations.py).

        The room is booked before the allocation is awaited and kept until the
        reservation is added (or the allocation fails): Reserves pipelined on
        one connection each wait for their allocation off the event loop, and
        otherwise all passed the limit. A retry of a Reserve being allocated
        (same uid, kind and size) waits for it and gets the same reservation."""
        peer = current_peer.get()
        uid = peer.uid if peer is not None else None
        if req.engine_id in self.table.ranks:
            raise RequestError(DUPLICATE, f"engine {req.engine_id[:200]!r} is registered "
                                          "already; reserve before registering")
        inflight = self._reserving.get(req.engine_id)
        if inflight is not None:
            first, first_uid, done = inflight
            if (first_uid, first.memory, first.nbytes) != (uid, req.memory, req.nbytes):
                raise RequestError(DUPLICATE, f"engine {req.engine_id[:200]!r} is being "
                                              "reserved (with another size, kind or user)")
            again = await asyncio.shield(done)
        else:
            held = self.reservations.check_room(req.engine_id, uid, req.nbytes, req.memory)
            again = held if held is not None else await self._reserve_new(req, uid)
        return Reserved(region=again.region.ref(),
                        fd_socket=self.fds.path if again.fd_token else "")

    async def _reserve_new(self, req: Reserve, uid: int | None) -> Reservation:
        """Allocate a reservation :meth:`Reservations.check_room` found room for."""
        e = req.engine_id
        done: asyncio.Future[Reservation] = asyncio.get_running_loop().create_future()
        done.add_done_callback(_retrieve)
        self._reserving[e] = (req, uid, done)
        self.reservations.book(e)
        try:
            ctx = MemoryContext(e, self.shm_prefix, uid, self.state.gpu,
                                allow_unsealed_shm=self.settings.allow_unsealed_shm)
            allocating = asyncio.get_running_loop().run_in_executor(
                None, memory_kinds.allocate, req.memory, 1, req.nbytes, ctx)
            try:
                (region,) = await asyncio.shield(allocating)
            except asyncio.CancelledError:
                allocating.add_done_callback(_release_late_allocation)  # the thread goes on
                raise
            r = Reservation(e, uid, req.memory, region)
            r.fd_token = self._offer([region], uid, f"reservation {e!r}")
            self.reservations.add(r)
            log.info("reserved %d B of %s for engine %r", req.nbytes, req.memory, e)
        except asyncio.CancelledError:
            done.cancel()
            raise
        except BaseException as exc:
            done.set_exception(exc)
            raise
        else:
            done.set_result(r)
            return r
        finally:
            self.reservations.unbook(e)
            del self._reserving[e]

    # ------------------------------------------------------------ liveness

    def check_liveness(self, now: float, by_lease: bool = True) -> None:
        """Drop (or, ``keep_on_exit``, orphan) every engine whose process is gone
        (``by_lease=False``: judged by pid only, see :func:`death`)."""
        for eng in list(self.table.ranks.values()):
            if eng.orphaned or eng.engine_id in self.table.registering:
                continue
            why = death(eng, now, self.settings.engine_lease_s, by_lease)
            if not why:
                continue
            by_pid = why.startswith("its process")
            self.metrics.engines_gone.labels(signal="pid" if by_pid else "lease").inc()
            if eng.keep_on_exit:
                eng.orphaned = True
                log.warning("engine %r is gone (%s); its registration is kept for a restart",
                            eng.engine_id, why)
            else:
                log.warning("engine %r is gone (%s); releasing its resources", eng.engine_id,
                            why)
                self.background.spawn(self.departures.drop_engine(
                    eng.engine_id, f"engine gone: {why}", drain=drains_when_gone(by_pid)))


def _layout_of(req: Register) -> Layout:
    """The registration's layout, validated, with its rank inside it."""
    try:
        layout = validate(req.layout)
    except LayoutError as e:
        raise RequestError(BAD_REQUEST, f"invalid layout: {e}") from None
    if req.tp_rank >= layout.tp_size:
        raise RequestError(BAD_REQUEST, f"tp_rank {req.tp_rank} outside the layout's "
                                        f"tp_size {layout.tp_size}")
    return layout


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


def _retrieve(f: asyncio.Future[Reply] | asyncio.Future[Reservation]) -> None:
    """Mark a registration's (or reservation's) outcome as seen (its first caller
    raised it already)."""
    if not f.cancelled():
        f.exception()


def _release_late_allocation(f: asyncio.Future[list[Region]]) -> None:
    """Release what a reservation's allocation whose caller gave up created anyway."""
    if not f.cancelled() and f.exception() is None:
        release_regions(f.result(), True)

