"""ThreadGroups: the calls of one loop iteration run as one job on a real thread."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from kvsidecar.daemon.thread_groups import ThreadGroups


class CountingExecutor(ThreadPoolExecutor):
    """A real one-thread executor that counts its jobs."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.jobs = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


def plan(i: int) -> tuple[int, str]:
    if i == 5:
        raise ValueError("bad read 5")
    return i * i, threading.current_thread().name


async def test_one_iteration_is_one_job_and_a_failure_is_its_callers_alone() -> None:
    ex = CountingExecutor()
    try:
        groups = ThreadGroups(ex)
        futs = [groups.submit(plan, i) for i in range(16)]
        futs[7].cancel()  # its caller went away before the group left: skipped
        out = await asyncio.gather(*futs, return_exceptions=True)
        assert ex.jobs == 1
        for i, r in enumerate(out):
            if i == 5:
                assert isinstance(r, ValueError) and "bad read 5" in str(r)
            elif i == 7:
                assert isinstance(r, asyncio.CancelledError)
            else:
                assert isinstance(r, tuple) and r[0] == i * i
                assert r[1] != threading.current_thread().name  # ran on the thread
        # A later iteration is a new job.
        assert await groups.submit(plan, 3) == (9, out[0][1])  # type: ignore[index]
        assert ex.jobs == 2
    finally:
        ex.shutdown()


async def test_a_shut_down_executor_fails_every_call_of_the_group() -> None:
    ex = ThreadPoolExecutor(max_workers=1)
    ex.shutdown()
    groups = ThreadGroups(ex)
    futs = [groups.submit(plan, i) for i in range(3)]
    for f in futs:
        with pytest.raises(RuntimeError, match="shutdown"):
            await f
