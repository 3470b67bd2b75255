"""Housekeeping: expire holds, drop early notifications, notice engines that died.

Each pass runs when the earliest hold or early notification is due to expire
(:meth:`~kvsidecar.daemon.holds.HoldBook.next_due`), at least every
``HOUSEKEEPING_IDLE_S`` (the liveness checks' own period) and at most every
``HOUSEKEEPING_MIN_S``: a hold pending for its reader no longer makes it tick
ten times a second (on P, between bursts, that tick was most of the event
loop's wake-ups). Claims only push deadlines
later; a hold placed or released with an earlier one pokes the
:class:`~kvsidecar.daemon.background.Alarm`, which knows when the next pass
is planned, so a poke about something due later costs nothing. Once a second
it also checks engine liveness and releases reservations whose engine never
registered within the engine lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from kvsidecar.daemon.background import Alarm, Background
from kvsidecar.daemon.engines.registry import Registry
from kvsidecar.metrics.registry import Metrics

log = logging.getLogger(__name__)

HOUSEKEEPING_IDLE_S = 1.0  # the longest sleep: engine liveness and reservations
#: the shortest time between passes, pokes included: with many holds expiring
#: (each pass walks them all) at most ten passes a second, as before deadlines
#: were tracked; a hold ends at most this late
HOUSEKEEPING_MIN_S = 0.1


#: uvloop's timers count whole milliseconds from a cached clock and can fire up
#: to 1 ms early: a pass that early would find its hold not yet due and leave
#: it to the next one, HOUSEKEEPING_MIN_S later
_TIMER_SLACK_S = 0.002


def next_pass(due: float, now: float, last: float) -> float:
    """When housekeeping runs next (``time.monotonic``): when the earliest
    expiry is ``due`` (``math.inf``: none), but within ``HOUSEKEEPING_IDLE_S``
    of ``now`` and no sooner than ``HOUSEKEEPING_MIN_S`` after the ``last``
    pass. Pure."""
    return max(last + HOUSEKEEPING_MIN_S, min(due, now + HOUSEKEEPING_IDLE_S))


async def housekeeping(registry: Registry, alarm: Alarm, background: Background,
                       metrics: Metrics) -> None:
    """Run until cancelled."""
    table = registry.table
    last_liveness_check = 0.0
    last = -math.inf
    while True:
        now = time.monotonic()
        at = next_pass(min((e.holds.next_due() for e in table.serving()), default=math.inf),
                       now, last)
        alarm.due = at
        if at > now:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(alarm.event.wait(), at - now + _TIMER_SLACK_S)
            rest = last + HOUSEKEEPING_MIN_S - time.monotonic()
            if rest > 0:  # poked this soon after a pass: not before the shortest gap
                await asyncio.sleep(rest)
        alarm.event.clear()
        last = now = time.monotonic()
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
