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


def other(i: int) -> int:
    return -i


async def test_runs_of_one_function_go_through_its_batched_variant() -> None:
    batches: list[list[int]] = []

    def plan_many(calls: list[tuple[Any, ...]]) -> list[tuple[bool, Any]]:
        batches.append([i for (i,) in calls])
        if 13 in batches[-1]:
            raise RuntimeError("a bug in the batched variant")
        out: list[tuple[bool, Any]] = []
        for (i,) in calls:
            try:
                out.append((True, plan(i)))
            except ValueError as e:
                out.append((False, e))
        return out

    ex = CountingExecutor()
    try:
        groups = ThreadGroups(ex, many={plan: plan_many})
        futs = [groups.submit(plan, 4), groups.submit(plan, 5), groups.submit(other, 1),
                groups.submit(plan, 6)]
        out = await asyncio.gather(*futs, return_exceptions=True)
        assert ex.jobs == 1
        assert batches == [[4, 5]]  # the run of two; a lone call goes as itself
        assert out[0][0] == 16 and isinstance(out[1], ValueError)  # type: ignore[index]
        assert out[2] == -1 and out[3][0] == 36  # type: ignore[index]
        # The batched variant raising: each call is made alone and gets its own outcome.
        futs = [groups.submit(plan, 12), groups.submit(plan, 13)]
        assert [r[0] for r in await asyncio.gather(*futs)] == [144, 169]
    finally:
        ex.shutdown()


async def test_a_cheap_job_runs_on_the_loop_and_a_costly_or_unpriced_one_on_the_thread() -> None:
    ex = CountingExecutor()
    here = threading.current_thread().name
    try:
        groups = ThreadGroups(ex, inline_cost=4)
        # One iteration's calls costing 4 in all: run here, no job for the thread;
        # a failing call still fails its caller alone.
        futs = [groups.submit(plan, i, cost=2) for i in (3, 5)]
        out = await asyncio.gather(*futs, return_exceptions=True)
        assert out[0] == (9, here) and isinstance(out[1], ValueError)
        assert ex.jobs == 0
        # Past the bound, or without a cost: the thread, as one job each time.
        futs = [groups.submit(plan, i, cost=2) for i in (1, 2, 3)]
        assert [r[0] for r in await asyncio.gather(*futs)] == [1, 4, 9]
        assert ex.jobs == 1
        assert (await groups.submit(plan, 2))[1] != here
        assert ex.jobs == 2
    finally:
        ex.shutdown()


async def test_a_job_of_one_call_may_cost_more_on_the_loop_than_a_job_of_several() -> None:
    ex = CountingExecutor()
    here = threading.current_thread().name
    try:
        groups = ThreadGroups(ex, inline_cost=4, inline_alone=10)
        # One call costing 10: here (its fixed cost comes once).
        assert await groups.submit(plan, 3, cost=10) == (9, here)
        assert ex.jobs == 0
        # Two calls costing 6 in all: over the several-call bound, the thread.
        futs = [groups.submit(plan, i, cost=3) for i in (2, 3)]
        assert [r[1] != here for r in await asyncio.gather(*futs)] == [True, True]
        assert ex.jobs == 1
        # One call past its own bound, or without a cost: the thread.
        assert (await groups.submit(plan, 2, cost=11))[1] != here
        assert (await groups.submit(plan, 2))[1] != here
        assert ex.jobs == 3
    finally:
        ex.shutdown()
