"""D side: small asyncio helpers for futures a read awaits or abandons."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any, TypeVar

T = TypeVar("T")


async def all_or_cancel(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Every result, in order; on the first failure (or this task's cancel) the
    others are cancelled before it is raised: a read that cannot link one P rank
    gives up the rest of its links at once, and with them the handshakes they
    wait for (other engines may need those peer connections)."""
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # a failure, or this task cancelled: the rest are not needed
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    for t in tasks:
        err = None if t.cancelled() else t.exception()
        if err is not None:
            raise err
    return [t.result() for t in tasks]


async def outcomes(ops: list[asyncio.Future[Any]]) -> list[Any]:
    """``gather(*ops, return_exceptions=True)``; one op (the usual case, P and
    D of the same tp) is awaited directly, without a gathering future."""
    if len(ops) != 1:
        return list(await asyncio.gather(*ops, return_exceptions=True))
    try:
        return [await ops[0]]
    except asyncio.CancelledError as e:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # this read was cancelled, not its op
        return [e]  # as gather reports an op cancelled by someone else
    except Exception as e:
        return [e]


def in_executor(executor: Executor, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    return asyncio.get_running_loop().run_in_executor(executor, fn, *args)


def retrieve(f: asyncio.Future[Any]) -> None:
    """Mark an abandoned future's outcome as seen (no 'never retrieved' noise)."""
    if not f.cancelled():
        f.exception()


async def ended(fut: asyncio.Future[Any]) -> None:
    """Return once ``fut`` ended, its outcome left to whoever wants it (marked
    seen). Cancelled meanwhile, this still waits for it, then raises: what
    ``fut`` does (hashing a read's memory) must not outlive the wait on it."""
    if not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise
    retrieve(fut)
