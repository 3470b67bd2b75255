"""Coroutines whose first step runs now, in the caller's callback.

``asyncio.ensure_future(coro)`` runs nothing of ``coro`` until the loop's
next iteration: behind every callback already queued, and (on two cores)
behind the wake-ups of threads the current callback just caused. Where the
first step is the point (a request answered without a turn of the loop, a
lease claim that must leave before the post it races), :func:`start_now`
runs it at once and hands only the rest to a task (:func:`carry_on`), as
Python 3.12's eager tasks do.

What the first step sees differs from a task's in one way: it runs in the
caller's task (``asyncio.current_task()`` is the caller's), so a coroutine
that looks up its own task must not be started so.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

__all__ = ["carried_on", "carry_on", "start_now"]


def start_now(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """Run ``coro`` up to its first suspension now; the future of its outcome
    (already done when it finished or raised in that step; otherwise a task
    that carries it on, and cancelling that task cancels ``coro``)."""
    try:
        waiting = coro.send(None)
    except StopIteration as e:
        return _done(e.value, None)
    except asyncio.CancelledError:
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        fut.cancel()
        return fut
    except Exception as e:
        return _done(None, e)
    return carried_on(coro, waiting)


def carried_on(coro: Coroutine[Any, Any, T], waiting: object) -> asyncio.Task[T]:
    """The task of :func:`carry_on`. Should it be cancelled before its first
    step (which then never runs), ``coro`` learns it as from a Task: a
    CancelledError where it waits, and it is closed, so its ``finally``
    blocks run now rather than whenever the garbage collector finds it."""
    task = asyncio.ensure_future(carry_on(coro, waiting))
    task.add_done_callback(functools.partial(_end, coro))
    return task


def _end(coro: Coroutine[Any, Any, Any], task: asyncio.Future[Any]) -> None:
    if task.cancelled() and getattr(coro, "cr_frame", None) is not None:  # not resumed by it
        try:
            coro.throw(asyncio.CancelledError())
        except (asyncio.CancelledError, StopIteration):
            pass
        except Exception:  # nobody awaits it any more: say so, do not raise here
            log.exception("a coroutine cancelled before its task ran failed")
    coro.close()


def _done(value: Any, exc: BaseException | None) -> asyncio.Future[Any]:
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    if exc is None:
        fut.set_result(value)
    else:
        fut.set_exception(exc)
    return fut


async def carry_on(coro: Coroutine[Any, Any, T], waiting: object) -> T:
    """Run ``coro`` on from the point where its first step, run outside any
    task, stopped: what an asyncio Task that had started it would do, with no
    more turns of the loop; returns what ``coro`` returns. It stopped on a
    future (await it here; ``coro`` reads its outcome itself when resumed, as
    ``Future.__await__`` does) or on a bare ``yield`` (one turn of the loop).
    Cancelling this task cancels that future and so raises CancelledError in
    ``coro``, as for a Task."""
    while True:
        if waiting is not None and not asyncio.isfuture(waiting):
            error = RuntimeError(f"a coroutine yielded {waiting!r}, not a future")
            try:
                waiting = coro.throw(error)
            except StopIteration as e:
                return e.value  # type: ignore[no-any-return]
            continue
        fut = waiting  # a future or None here (the check above)
        try:
            if fut is None:
                await asyncio.sleep(0)
            else:
                # coro's own await marked it as waited for (a Task resets that mark
                # when it takes the future over); awaiting it again needs it clear.
                fut._asyncio_future_blocking = False
                await fut
        except asyncio.CancelledError as e:
            if fut is None or not fut.cancelled():
                # This task was cancelled (its future had finished meanwhile, or it
                # was between two steps): the coroutine must learn of it.
                try:
                    waiting = coro.throw(e)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                continue
        except BaseException:
            pass  # the future's own outcome: coro reads it when resumed
        try:
            waiting = coro.send(None)
        except StopIteration as e:
            return e.value  # type: ignore[no-any-return]
