"""start_now runs a coroutine's first step in the caller's callback and hands
the rest to a task that behaves as asyncio's own would."""

from __future__ import annotations

import asyncio

import pytest

from kvsidecar.daemon.eager import start_now


async def test_the_first_step_runs_before_start_now_returns() -> None:
    steps: list[str] = []
    gate = asyncio.get_running_loop().create_future()

    async def coro() -> int:
        steps.append("first")
        await gate
        steps.append("rest")
        return 7

    fut = start_now(coro())
    assert steps == ["first"]  # a task would not have run it yet
    gate.set_result(None)
    assert await fut == 7
    assert steps == ["first", "rest"]


async def test_a_coroutine_that_never_waits_is_done_at_once() -> None:
    async def value() -> str:
        return "done"

    async def failing() -> None:
        raise ValueError("bad plan")

    fut = start_now(value())
    assert fut.done() and fut.result() == "done"
    bad = start_now(failing())
    assert bad.done()
    with pytest.raises(ValueError, match="bad plan"):
        bad.result()


async def test_an_error_after_the_first_step_is_the_futures() -> None:
    gate = asyncio.get_running_loop().create_future()

    async def coro() -> None:
        await gate
        raise KeyError("late")

    fut = start_now(coro())
    gate.set_exception(RuntimeError("the awaited future failed"))
    with pytest.raises(RuntimeError, match="awaited future failed"):
        await fut  # coro reads its future's outcome, which it let escape

    gate2 = asyncio.get_running_loop().create_future()

    async def coro2() -> None:
        await gate2
        raise KeyError("late")

    fut2 = start_now(coro2())
    gate2.set_result(None)
    with pytest.raises(KeyError):
        await fut2


async def test_cancelling_the_rest_cancels_the_coroutine_where_it_waits() -> None:
    gate = asyncio.get_running_loop().create_future()
    seen: list[str] = []

    async def coro() -> None:
        try:
            await gate
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    fut = start_now(coro())
    await asyncio.sleep(0)
    fut.cancel()
    with pytest.raises(asyncio.CancelledError):
        await fut
    assert seen == ["cancelled"]
    assert gate.cancelled()  # the future it awaited was cancelled, as a Task does


async def test_a_bare_yield_is_one_turn_of_the_loop() -> None:
    order: list[str] = []

    async def coro() -> None:
        order.append("first")
        await asyncio.sleep(0)
        order.append("second")

    asyncio.get_running_loop().call_soon(order.append, "queued before")
    await start_now(coro())
    assert order == ["first", "queued before", "second"]


async def test_a_task_cancelled_before_its_first_step_closes_the_coroutine() -> None:
    """The first step ran in the caller; the rest's task is cancelled before
    it ever runs: the coroutine is closed at once (its ``finally`` runs, so
    e.g. a pending request's bookkeeping and timer go), not left suspended
    until the garbage collector finds it."""
    gate = asyncio.get_running_loop().create_future()
    cleaned: list[str] = []

    async def coro() -> None:
        try:
            await gate
        except asyncio.CancelledError:
            cleaned.append("cancelled")  # as a Task's cancel says it, not GeneratorExit
            raise
        except BaseException as e:
            cleaned.append(type(e).__name__)
            raise
        finally:
            cleaned.append("finally")

    fut = start_now(coro())
    fut.cancel()  # before the loop ever ran the task
    with pytest.raises(asyncio.CancelledError):
        await fut
    await asyncio.sleep(0)  # the task's done callbacks
    assert cleaned == ["cancelled", "finally"]
