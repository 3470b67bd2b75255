"""Engine ranks leaving: drop, quiesce, drain, free.

A rank leaves when its engine deregisters, dies, or the sidecar stops. Its
own reads are aborted and waited for (nothing may still write into its
memory); then either its memory, workers and fds are freed at once, or (a
``drain`` departure with holds open, memory that stays valid without its
engine, see :mod:`~kvsidecar.daemon.drain`) the rank becomes a draining
generation that keeps serving readers until its last hold ends, and is freed
then. Freeing is blocking work (worker threads, unmapping): it runs off the
event loop, and is counted in ``cleanup_failures`` when it fails, never raised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvsidecar.daemon.background import Alarm, Background
from kvsidecar.daemon.d_side.table import ReadTable
from kvsidecar.daemon.drain import Generation, keepable
from kvsidecar.daemon.engines.memory import kind_of, release_regions
from kvsidecar.daemon.engines.rank import EngineRank
from kvsidecar.daemon.engines.table import EngineTable
from kvsidecar.daemon.fd_server import FdServer
from kvsidecar.daemon.reservations import Reservation, Reservations
from kvsidecar.daemon.settings import Settings
from kvsidecar.daemon.verify import Hashing
from kvsidecar.ipc.protocol import Completion
from kvsidecar.ipc.regions import Region
from kvsidecar.metrics.registry import Metrics

log = logging.getLogger(__name__)


class Departures:
    def __init__(self, table: EngineTable, settings: Settings, metrics: Metrics,
                 reads: ReadTable, hashing: Hashing, fds: FdServer,
                 reservations: Reservations, invalidate: Callable[[str], None],
                 background: Background, alarm: Alarm) -> None:
        self.table = table
        self.settings = settings
        self.metrics = metrics
        self.reads = reads
        self.hashing = hashing
        self.fds = fds
        self.reservations = reservations
        #: forget a handshake answer (the handshake server's cache) for an engine id
        self.invalidate = invalidate
        self.background = background
        self.alarm = alarm

    @property
    def drain_timeout(self) -> float:
        """How long to wait for posted reads: past their own deadline, so memory is
        never released while a transfer may still write into it."""
        return self.settings.read_timeout_s + 15.0

    async def quiesce(self, eng: EngineRank, why: str) -> None:
        """Abort the engine's reads and wait until none can still write into its
        memory; forget its holds (nobody will hear about them)."""
        await self.reads.abort_all(eng.engine_id, why, self.drain_timeout)
        eng.holds.drop_engine(eng.engine_id)
        eng.worker.set_hot(False)

    async def drop_engine(self, engine_id: str, why: str, drain: bool = False) -> None:
        """Forget an engine rank and free what it had. ``drain``: if it has holds
        open and its memory can be kept, its memory, agent and holds stay and keep
        serving readers until the holds end; only then is everything freed. Its
        own reads are aborted either way."""
        eng = self.table.ranks.pop(engine_id, None)
        if eng is None:
            return
        # Until its reads ended and its agent stopped (no reader copies its blocks)
        # the engine hears "releasing", not unknown_engine, which tells it that
        # nothing of this registration touches its memory any more.
        self.table.releasing[engine_id] = (eng, why)
        try:
            eng.wake_pollers()
            self.invalidate(engine_id)
            gen = self._start_drain(eng, why) if drain else None
            if gen is not None:
                await self.reads.abort_all(eng.engine_id, why, self.drain_timeout)
                gen.quiet = True  # nothing of its own reads writes into its memory any more
                self._maybe_free(gen)
                return
            # Taken with the rank, before any await: while its reads may still land,
            # nothing else (the stale-reservation sweep, a Deregister naming the id)
            # may find the reservation its regions are views of, and free it.
            reservation = self.reservations.pop(engine_id)
            await self.quiesce(eng, why)
            await self._free_rank(eng, reservation, why)
        finally:
            if self.table.releasing.get(engine_id, (None,))[0] is eng:
                del self.table.releasing[engine_id]

    async def drop_reservation(self, engine_id: str) -> None:
        """Free a reservation whose engine never registered (or is gone)."""
        r = self.reservations.pop(engine_id)
        if r is not None:
            self.fds.withdraw(r.fd_token)
            await self.release_regions([r.region], True)

    async def release_regions(self, regions: list[Region], owned: bool) -> None:
        """Give the memory back off the event loop (hundreds of ms per GB)."""
        failures = await asyncio.get_running_loop().run_in_executor(
            None, release_regions, regions, owned)
        if failures:
            log.warning("%d region(s) could not be released", failures)
            self.metrics.cleanup_failures.labels(what="memory").inc(failures)

    async def _free_rank(self, eng: EngineRank, reservation: Reservation | None,
                         why: str) -> None:
        """Stop a forgotten rank's workers, free its memory and its reservation."""
        engine_id = eng.engine_id
        await self.hashing.drain(engine_id)  # no hash reads its memory any more
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
        self.fds.withdraw(eng.fd_token)
        await self.release_regions(eng.regions, eng.owned)
        if reservation is not None:  # views into it were just released
            self.fds.withdraw(reservation.fd_token)
            await self.release_regions([reservation.region], True)
        self._forget_series(engine_id)
        log.info("engine %r released (%s)", engine_id, why)

    def _forget_series(self, engine_id: str) -> None:
        """Update the engine count; drop the id's series unless it registered again."""
        self.metrics.engines.set(len(self.table))
        if engine_id not in self.table.ranks:
            self.metrics.forget_engine(engine_id)

    # ------------------------------------------------------------ draining

    def _start_drain(self, eng: EngineRank, why: str) -> Generation[EngineRank] | None:
        """Keep ``eng`` (already forgotten as a registration) serving its open holds,
        when it has any and its memory stays valid without its engine; None otherwise."""
        if not len(eng.holds) or not self._may_drain(eng):
            return None
        drain = self.table.drain
        nbytes = len(eng.regions) * eng.layout.region_bytes
        gen = drain.start(eng.engine_id, eng, why, nbytes, time.monotonic())
        reservation = self.reservations.pop(eng.engine_id)
        if reservation is not None:  # a new registration of the id reserves anew
            self.table.drain_reserved[gen.number] = reservation
        self.fds.withdraw(eng.fd_token)  # nobody may map it again
        eng.fd_token = ""
        counted = eng.on_complete

        def ended(engine_id: str, c: Completion) -> None:
            if counted is not None:
                counted(engine_id, c)
            if c.kind in ("sent", "aborted", "expired"):
                drain.ended(gen, c.kind)
                self.metrics.drained_holds.labels(outcome=c.kind).inc()
                eng.completions.clear()  # nobody polls them
                self._maybe_free(gen)

        eng.on_complete = ended
        eng.completions.clear()
        self._forget_series(eng.engine_id)
        self.alarm.poke()  # housekeeping expires its holds
        log.warning("engine %r rank %d ended (%s) with %d hold(s) open: its memory (%d B) "
                    "stays registered and serves them until they end (generation %d)",
                    eng.engine_id, eng.tp_rank, why, len(eng.holds), nbytes, gen.number)
        return gen

    def _may_drain(self, eng: EngineRank) -> bool:
        """Whether an ended rank with holds open may drain: memory that outlives its
        engine, and room among the draining generations (logged when not)."""
        kinds = frozenset(kind_of(r) for r in eng.regions) if not eng.owned else frozenset()
        if not keepable(eng.owned, kinds):
            log.warning("engine %r ended with %d hold(s) open on memory it allocated itself "
                        "(%s): the holds end now, as the memory goes with its process",
                        eng.engine_id, len(eng.holds), ", ".join(sorted(kinds)))
            return False
        if len(self.table.drain) >= self.settings.max_engines:
            # Each generation keeps an agent (a thread) and its memory: bounded like
            # registrations (a loop of register, hold, deregister would grow it).
            self.metrics.limit_refusals.labels("", "draining").inc()
            log.warning("engine %r ended with %d hold(s) open, but %d ended engines drain "
                        "already (--max-engines): its holds end now", eng.engine_id,
                        len(eng.holds), len(self.table.drain))
            return False
        return True

    def _maybe_free(self, gen: Generation[EngineRank]) -> None:
        """Free a draining generation once its reads are over and its last hold ended."""
        if self.table.drain.may_free(gen, len(gen.rank.holds)):
            self.background.spawn(self._free_generation(gen))

    def cut_drain(self, gen: Generation[EngineRank], why: str) -> None:
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
            await self._free_rank(eng, self.table.drain_reserved.pop(gen.number, None),
                                  f"drained: {gen.why}")
        finally:
            self.table.drain.finish(gen)
            self.invalidate(gen.engine_id)
        log.info("%s", gen.summary(time.monotonic()))

    async def drain_holds(self, timeout_s: float) -> None:
        """SIGTERM: let every open hold (registered engines' and draining ones') end,
        for at most ``timeout_s``; new holds are refused meanwhile. Holds still
        open then are cut (:meth:`~kvsidecar.daemon.holds.HoldBook.cut_all`): each
        ends ``expired`` once the leases its readers hold ran out (at most
        ``--hold-lease`` later), so its engine polls one completion for it
        instead of losing it in silence when the sidecar stops."""
        left = self.table.open_holds()
        if not left:
            return
        if timeout_s > 0:
            log.info("draining %d open hold(s) for up to %g s (--drain-timeout)", left,
                     timeout_s)
            left = await self._holds_end_by(time.monotonic() + timeout_s)
            (log.warning if left else log.info)(
                "drain %s: %d hold(s) still open", "cut short" if left else "done", left)
        if not left:
            return
        now = time.monotonic()
        why = (f"the sidecar is shutting down (--drain-timeout {timeout_s:g} s passed "
               "before its readers finished)")
        cut = sum(e.holds.cut_all(why, now) for e in self.table.serving())
        self.alarm.poke()  # housekeeping ends them as their leases run out
        left = await self._holds_end_by(now + self.settings.hold_lease_s + 1.0)
        log.warning("drain timeout: %d open hold(s) ended expired once their readers' "
                    "leases ran out%s", cut - left,
                    f"; {left} still open are dropped" if left else "")

    async def _holds_end_by(self, deadline: float) -> int:
        """Wait until no hold is open or ``deadline`` passed; the holds still open."""
        left = self.table.open_holds()
        while left and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            left = self.table.open_holds()
        return left
