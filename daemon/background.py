"""The daemon's background tasks and the housekeeping alarm.

:class:`Background` keeps a reference to every task it spawns (asyncio holds
only weak ones) until the task ends; ``stop`` waits for them.
:class:`Alarm` wakes the housekeeping loop from its idle sleep when new work
with a deadline appears (a hold placed, a rank starting to drain); while the
loop runs its busy period already, a poke costs nothing.
"""

from __future__ import annotations

import asyncio
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
    """Wakes housekeeping early; ``busy`` is set by housekeeping while it
    already ticks at its short period (then a poke is not needed)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.busy = False

    def poke(self) -> None:
        if not self.busy:
            self.event.set()
