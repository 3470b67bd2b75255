"""When housekeeping runs (pure planning) and what wakes it early (the alarm)."""

from __future__ import annotations

import asyncio
import math

from kvsidecar.daemon.background import Alarm
from kvsidecar.daemon.housekeeping import HOUSEKEEPING_IDLE_S, HOUSEKEEPING_MIN_S, next_pass


def test_a_pass_runs_at_the_earliest_expiry_within_the_idle_period() -> None:
    assert next_pass(math.inf, now=100.0, last=99.0) == 100.0 + HOUSEKEEPING_IDLE_S
    assert next_pass(100.4, now=100.0, last=99.0) == 100.4
    assert next_pass(150.0, now=100.0, last=99.0) == 100.0 + HOUSEKEEPING_IDLE_S


def test_passes_are_never_closer_than_the_shortest_gap() -> None:
    # many holds expiring one after another: at most one pass per gap
    assert next_pass(100.001, now=100.0, last=99.99) == 99.99 + HOUSEKEEPING_MIN_S
    assert next_pass(50.0, now=100.0, last=99.95) == 99.95 + HOUSEKEEPING_MIN_S
    assert next_pass(50.0, now=100.0, last=-math.inf) == 50.0  # overdue: at once


def test_a_poke_wakes_housekeeping_only_for_what_is_due_before_its_pass() -> None:
    async def main() -> None:
        alarm = Alarm()
        alarm.poke(1e9)  # no pass planned yet: anything wakes it
        assert alarm.event.is_set()
        alarm.event.clear()
        alarm.due = 10.0
        alarm.poke(30.0)  # a hold due after the planned pass: no wake-up
        assert not alarm.event.is_set()
        alarm.poke(5.0)
        assert alarm.event.is_set()
        alarm.event.clear()
        alarm.poke()  # something due now (a rank starting to drain)
        assert alarm.event.is_set()

    asyncio.run(main())
