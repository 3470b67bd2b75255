"""engines.lanes.every: lanes are started and registered side by side; when several
fail, the first failure is raised once all ended and none is left unread
(asyncio's "Task exception was never retrieved" for the others, with gather)."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from kvsidecar.daemon.engines.lanes import every


async def _fail(msg: str, delay: float) -> int:
    await asyncio.sleep(delay)
    raise RuntimeError(msg)


async def _ok(value: int, delay: float) -> int:
    await asyncio.sleep(delay)
    return value


async def test_results_in_order() -> None:
    assert await every([_ok(1, 0.01), _ok(2, 0.0)]) == [1, 2]


async def test_the_first_failure_is_raised_after_all_ended_and_none_is_unread() -> None:
    loop = asyncio.get_running_loop()
    unread: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: unread.append(ctx))
    ended: list[int] = []

    async def slow_ok() -> int:
        await asyncio.sleep(0.05)
        ended.append(1)
        return 1

    with pytest.raises(RuntimeError, match="lane 1"):
        await every([_fail("lane 1", 0.0), _fail("lane 2", 0.01), slow_ok()])
    assert ended == [1]  # the caller stops lanes only once none is still starting
    gc.collect()
    await asyncio.sleep(0)
    assert unread == []
