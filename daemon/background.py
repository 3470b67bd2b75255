"""The daemon's background tasks and the housekeeping alarm.

:class:`Background` keeps a reference to every task it spawns (asyncio holds
only weak ones) until the task ends; ``stop`` waits for them.
:class:`Alarm` wakes the housekeeping loop from its sleep when new work
is due before the pass it planned (a hold placed with an earlier deadline, a
hold released under a lease, a rank starting to drain); a poke about work
due no earlier costs nothing.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Coroutine
from typing import Any


class Background:
    """Tasks spawned by handlers, callbacks and housekeeping, kept until they end."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for every task spawned so far."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)


class Alarm:
    """Wakes housekeeping before its planned pass. ``due`` is when housekeeping
    plans to run next (its clock, ``time.monotonic``); it sets it before each
    sleep, so a poke about something due no earlier costs nothing."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.due = math.inf

    def poke(self, at: float = -math.inf) -> None:
        """Something is due at ``at`` (default: now): wake housekeeping unless
        it runs by then anyway."""
        if at < self.due:
            self.event.set()
