"""Calls for a worker thread, gathered per event-loop iteration into one job.

A Batch of reads (or several engine messages answered in one loop iteration)
would hand the planning thread one job per read: an executor submit, a wake-up
of the thread and a ``call_soon_threadsafe`` (a write to the loop's self-pipe)
back per read, and the loop wakes once per read to resume it. Calls submitted
here in one loop iteration go to the thread as ONE job that runs them in turn
and come back in ONE callback, which resolves each caller's future with its
own result or its own exception: a call that raises fails only its caller.

A function may have a batched variant (``ThreadGroups(many={fn: fn_many})``):
the consecutive calls of ``fn`` in one job are then made as ONE call of
``fn_many`` with their argument tuples, which returns each call's outcome
(the reads of one Batch are planned in one vectorised pass). Should the
batched call itself raise, the calls are made one by one instead, so each
still gets exactly its own outcome.

A job that is cheap as a whole (each call may say its ``cost``; the job's is
their sum, at most ``inline_cost``, or ``inline_alone`` for a job of one
call) runs on the loop instead, in the same callback that would have handed
it to the thread: for one small read the thread's wake-up, its GIL hand-over
and the ``call_soon_threadsafe`` back cost more than the planning (40 us for
a 1-block read here) and, on two cores, compete with the lease claim that
just left. A job of one call may be larger: a call's fixed cost comes once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

_Call = tuple[Callable[..., Any], tuple[Any, ...]]
#: a call's outcome on the thread: (True, result) or (False, the exception it raised)
_Outcome = tuple[bool, Any]


#: ``fn_many(list of fn's argument tuples) -> list of outcomes, one per call``
Many = Callable[[list[tuple[Any, ...]]], list[_Outcome]]


def run_calls(calls: Sequence[_Call], many: dict[Callable[..., Any], Many] | None = None
              ) -> list[_Outcome]:
    """Run each call in turn (on the worker thread); one raising does not stop the
    rest. Runs of consecutive calls of a function ``many`` names go through its
    batched variant (one by one if that raises)."""
    out: list[_Outcome] = []
    i, n = 0, len(calls)
    while i < n:
        fn, args = calls[i]
        batched = many.get(fn) if many else None
        j = i + 1
        if batched is not None:
            while j < n and calls[j][0] is fn:
                j += 1
        if j - i > 1 and batched is not None:
            try:
                got = batched([a for _, a in calls[i:j]])
                if len(got) == j - i:
                    out.extend(got)
                    i = j
                    continue
            except Exception:  # a bug: the calls one by one still answer each
                log.exception("batched %s failed; making its %d calls one by one",
                              getattr(fn, "__name__", fn), j - i)
        for fn, args in calls[i:j]:
            try:
                out.append((True, fn(*args)))
            except Exception as e:
                out.append((False, e))
        i = j
    return out


class ThreadGroups:
    """``submit`` is ``loop.run_in_executor`` with the calls of one loop
    iteration grouped (see the module docstring). Event loop thread only."""

    def __init__(self, executor: Executor,
                 many: dict[Callable[..., Any], Many] | None = None,
                 inline_cost: int = 0, inline_alone: int | None = None) -> None:
        self._executor = executor
        self._many = many
        self._inline_cost = inline_cost
        self._inline_alone = inline_cost if inline_alone is None else max(inline_alone,
                                                                          inline_cost)
        self._pending: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]] = []
        self._cost = 0

    def submit(self, fn: Callable[..., T], *args: Any, cost: int | None = None
               ) -> asyncio.Future[T]:
        """``fn(*args)`` on the executor's thread, with the other calls submitted in
        this loop iteration; cancelling the future before its group leaves skips it.
        A call without a ``cost`` is never run on the loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush, loop)
        self._pending.append((fn, args, fut))
        self._cost += self._inline_alone + 1 if cost is None else cost
        return fut

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        calls = [c for c in self._pending if not c[2].done()]
        cost, self._cost = self._cost, 0
        self._pending = []
        if not calls:
            return
        futs = [fut for _, _, fut in calls]
        limit = self._inline_alone if len(calls) == 1 else self._inline_cost
        if cost <= limit:  # cheaper here than a trip to the thread
            _settle(futs, run_calls([(fn, args) for fn, args, _ in calls], self._many))
            return
        try:
            done = loop.run_in_executor(self._executor, run_calls,
                                        [(fn, args) for fn, args, _ in calls], self._many)
        except RuntimeError as e:  # the executor was shut down
            _resolve_all(futs, e)
            return
        done.add_done_callback(functools.partial(_resolve, futs))


def _resolve(futs: list[asyncio.Future[Any]], done: asyncio.Future[list[_Outcome]]) -> None:
    if done.cancelled():  # nobody cancels it; should it happen, its callers end the same way
        for fut in futs:
            fut.cancel()
        return
    exc = done.exception()
    if exc is not None:  # only a BaseException escapes run_calls
        _resolve_all(futs, exc)
        return
    _settle(futs, done.result())


def _settle(futs: list[asyncio.Future[Any]], outcomes: list[_Outcome]) -> None:
    for fut, (ok, value) in zip(futs, outcomes):
        if fut.done():  # its caller was cancelled meanwhile
            continue
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)


def _resolve_all(futs: list[asyncio.Future[Any]], exc: BaseException) -> None:
    for fut in futs:
        if not fut.done():
            fut.set_exception(exc)
