"""Which turn of the event loop a callback ran in: for tests that a server
accepting a flood of connections lets the rest of the loop run between them."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from types import TracebackType


class LoopTurns:
    """Counts the event loop's turns while entered (a task that yields once per
    turn); a callback that records :attr:`n` says which turn it ran in."""

    def __init__(self) -> None:
        self.n = 0
        self._task: asyncio.Future[None] | None = None

    async def _count(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.n += 1

    async def __aenter__(self) -> LoopTurns:
        self._task = asyncio.ensure_future(self._count())
        return self

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None
                        ) -> None:
        if self._task is not None:
            self._task.cancel()


def connect_all(path: str, n: int) -> list[socket.socket]:
    """``n`` SEQPACKET connections to ``path``, all queued before the loop turns."""
    out = []
    for _ in range(n):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        c.setblocking(False)
        c.connect(path)
        out.append(c)
    return out


async def until(done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``done`` every 10 ms until it holds, at most ``timeout_s``."""
    for _ in range(int(timeout_s / 0.01)):
        if done():
            return
        await asyncio.sleep(0.01)
