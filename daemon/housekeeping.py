"""Housekeeping: expire holds, drop early notifications, notice engines that died.

Every ``HOUSEKEEPING_BUSY_S`` while some hold or early notification may
expire, else every ``HOUSEKEEPING_IDLE_S`` (the liveness checks' own period):
ten wake-ups a second would be a third of an idle daemon's CPU. A new hold
wakes it at once (the :class:`~kvsidecar.daemon.background.Alarm`) when it
sleeps the idle period; in the busy one it does not: a pass per hold (a task,
a timer and a walk over every hold) would cost P several µs per read. Once a
second it also checks engine liveness and releases reservations whose engine
never registered within the engine lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from kvsidecar.daemon.background import Alarm, Background
from kvsidecar.daemon.engines.registry import Registry
from kvsidecar.metrics.registry import Metrics

log = logging.getLogger(__name__)

HOUSEKEEPING_BUSY_S = 0.1  # holds or early notifications to expire
HOUSEKEEPING_IDLE_S = 1.0  # nothing to expire: engine liveness and reservations only


async def housekeeping(registry: Registry, alarm: Alarm, background: Background,
                       metrics: Metrics) -> None:
    """Run until cancelled."""
    table = registry.table
    last_liveness_check = 0.0
    while True:
        expiring = any(len(e.holds) or e.holds.early for e in table.serving())
        alarm.busy = expiring
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(alarm.event.wait(),
                                   HOUSEKEEPING_BUSY_S if expiring else HOUSEKEEPING_IDLE_S)
        alarm.event.clear()
        now = time.monotonic()
        try:
            _expire(registry, metrics, now)
            if now - last_liveness_check >= 1.0:
                last_liveness_check = now
                registry.check_liveness(now)
                _release_stale_reservations(registry, background, now)
        except Exception:  # housekeeping must outlive any single bad entry
            log.exception("housekeeping pass failed; continuing")


def _expire(registry: Registry, metrics: Metrics, now: float) -> None:
    for eng in registry.table.serving():
        before = eng.holds.unclaimed
        eng.holds.expire(now)
        if eng.holds.unclaimed != before:
            metrics.notifications_received.labels(outcome="unclaimed").inc(
                eng.holds.unclaimed - before)
        metrics.hold_overrun.labels(eng.engine_id).set(eng.holds.max_overrun)


def _release_stale_reservations(registry: Registry, background: Background,
                                now: float) -> None:
    lease_s = registry.settings.engine_lease_s
    busy = set(registry.table.ranks) | set(registry.table.registering)
    for engine_id in registry.reservations.stale(now, lease_s, busy):
        log.warning("engine %r reserved memory but did not register within "
                    "--engine-lease (%g s): releasing the reservation", engine_id, lease_s)
        background.spawn(registry.departures.drop_reservation(engine_id))
