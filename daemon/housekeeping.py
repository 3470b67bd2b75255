"""Housekeeping: expire holds, drop early notifications, notice engines that died.

Each pass runs when the earliest hold or early notification is due to expire
(:meth:`~kvsidecar.daemon.holds.HoldBook.next_due`) or the once-a-second
liveness check is, and at most every ``HOUSEKEEPING_MIN_S``: a hold pending
for its reader no longer makes it tick ten times a second (on P, between
bursts, that tick was most of the event loop's wake-ups). Claims only push
deadlines later, and an early notification made after a plan is due a grace
after it arrived (the plan never sleeps longer than that grace). A hold
placed or released with an earlier due time pokes the
:class:`~kvsidecar.daemon.background.Alarm`, which knows when the next pass
is planned: the loop plans again, and a poke about something due later costs
nothing. The liveness check also releases reservations whose engine never
registered within the engine lease.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from kvsidecar.daemon.background import Alarm, Background
from kvsidecar.daemon.engines.registry import Registry
from kvsidecar.metrics.registry import Metrics

log = logging.getLogger(__name__)

HOUSEKEEPING_IDLE_S = 1.0  # the longest sleep
#: a pass this late (the event loop was held up) judges no engine by its silence
STALLED_S = 0.5
#: engine liveness and stale reservations are checked this often
LIVENESS_EVERY_S = 1.0
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
    work is ``due`` (an expiry or a liveness check; ``math.inf``: none), but
    within ``HOUSEKEEPING_IDLE_S`` of ``now`` and no sooner than
    ``HOUSEKEEPING_MIN_S`` after the ``last`` pass. Pure."""
    return max(last + HOUSEKEEPING_MIN_S, min(due, now + HOUSEKEEPING_IDLE_S))


async def housekeeping(registry: Registry, alarm: Alarm, background: Background,
                       metrics: Metrics) -> None:
    """Run until cancelled."""
    last_liveness_check = -math.inf
    last = -math.inf
    while True:
        now = time.monotonic()
        try:
            at = next_pass(_due(registry, last_liveness_check, now), now, last)
        except Exception:  # housekeeping must outlive any single bad entry
            log.exception("housekeeping could not plan its next pass; passing in %g s",
                          HOUSEKEEPING_MIN_S)
            at = now + HOUSEKEEPING_MIN_S
        # At the shortest gap already, a poke could not bring the pass forward.
        alarm.due = at if at > last + HOUSEKEEPING_MIN_S else -math.inf
        if at > now and await _poked(alarm, at - now + _TIMER_SLACK_S):
            continue  # something is due before the planned pass: plan again
        alarm.event.clear()
        last = now = time.monotonic()
        stalled = math.isfinite(at) and now - at > STALLED_S
        try:
            _expire(registry, metrics, now)
        except Exception:
            log.exception("housekeeping pass failed; continuing")
        # due within the shortest gap: now, or the gap would push it late
        if now - last_liveness_check >= LIVENESS_EVERY_S - HOUSEKEEPING_MIN_S:
            last_liveness_check = now
            try:
                # After a stall, engines' requests may wait unread in their sockets:
                # none is taken for dead by silence until the next check.
                registry.check_liveness(now, by_lease=not stalled)
                _release_stale_reservations(registry, background, now)
            except Exception:
                log.exception("housekeeping's liveness check failed; continuing")


def _due(registry: Registry, last_liveness_check: float, now: float) -> float:
    """The earliest work ahead: an expiry, the next liveness check, or a grace
    from now (an early notification made after this plan is due a grace after
    it arrives; no poke announces it)."""
    due = min((e.holds.next_due() for e in registry.table.serving()), default=math.inf)
    return min(due, last_liveness_check + LIVENESS_EVERY_S,
               now + registry.settings.notif_grace_s)


async def _poked(alarm: Alarm, delay: float) -> bool:
    """Sleep ``delay`` seconds unless poked first (True). A plain event wait,
    not ``asyncio.wait_for``: on Python 3.10-3.11 that drops a cancellation
    that meets a poke in the same step, and housekeeping would outlive stop()."""
    timed_out = False

    def ring() -> None:
        nonlocal timed_out
        timed_out = True
        alarm.event.set()

    timer = asyncio.get_running_loop().call_later(delay, ring)
    try:
        await alarm.event.wait()
    finally:
        timer.cancel()
    alarm.event.clear()
    return not timed_out


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
    table = registry.table
    busy = set(table.ranks) | set(table.registering) | set(table.releasing)
    for engine_id in registry.reservations.stale(now, lease_s, busy):
        log.warning("engine %r reserved memory but did not register within "
                    "--engine-lease (%g s): releasing the reservation", engine_id, lease_s)
        background.spawn(registry.departures.drop_reservation(engine_id))
