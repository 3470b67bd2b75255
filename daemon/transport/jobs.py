"""What crosses between the event loop and the NIXL worker thread.

In: a :data:`Entry` on the worker's :class:`queue.Queue`: the :class:`Job`\\ s
of one submission (one put, one wake-up of the thread), or None, which only
wakes it. Out: an :class:`Outbox` the thread fills during a round and hands
the loop in one ``call_soon_threadsafe`` (results, then notifications).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFERRED", "Entry", "Fut", "Job", "JobFn", "Outbox"]

Fut = asyncio.Future[Any]
#: runs on the worker thread; returns the job's result, or DEFERRED
JobFn = Callable[[Fut], object]

#: a job's result when its future is resolved later (a read in flight)
DEFERRED = object()


@dataclass
class Job:
    fn: JobFn
    fut: Fut
    what: str
    remote: str | None
    #: runs while the agent is down (after a reset that could not create it
    #: again): jobs that only forget things
    agentless: bool = False


#: what the job queue carries: the jobs of one submission, or None (a wake-up)
Entry = tuple[Job, ...] | None


class Outbox:
    """Outcomes and notifications of one round, for the event loop."""

    def __init__(self) -> None:
        self.futs: list[tuple[Fut, object, BaseException | None]] = []
        self.notifs: list[tuple[str, bytes]] = []

    def done(self, fut: Fut, result: object) -> None:
        self.futs.append((fut, result, None))

    def fail(self, fut: Fut, exc: BaseException) -> None:
        self.futs.append((fut, None, exc))

    def notif(self, agent: str, message: bytes) -> None:
        self.notifs.append((agent, message))

    def take(self) -> tuple[list[tuple[Fut, object, BaseException | None]],
                            list[tuple[str, bytes]]] | None:
        """Everything so far (emptied), or None when there is nothing."""
        if not self.futs and not self.notifs:
            return None
        futs, self.futs = self.futs, []
        notifs, self.notifs = self.notifs, []
        return futs, notifs
