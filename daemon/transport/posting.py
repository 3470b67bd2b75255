"""Posts of one event-loop iteration, handed to the NIXL worker as one entry.

:meth:`PostQueue.post` (behind ``NixlWorker.post_soon``, ``read`` and
``notify``) returns a future at once and collects the op; right after the
current loop iteration :meth:`PostQueue.flush` checks them, groups them
(:mod:`~kvsidecar.daemon.transport.merging`) and hands every job to the
worker in ONE queue entry: one put and one wake-up of the thread instead of
one per read. The thread still posts each job on its own, so each keeps its
own transfer, notification, future and failure; except that ops with
``merge`` of 2 or more to the same agent travel as one transfer carrying one
joined notification, and if that transfer fails, every read in it fails with
the same error. Event loop thread only.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence

from kvsidecar.daemon.transport.errors import NixlError
from kvsidecar.daemon.transport.jobs import Fut, Job, JobFn
from kvsidecar.daemon.transport.merging import (
    MERGE_MAX_READ_BYTES,
    group_ops,
    merged_notify,
    merged_read,
    share,
)
from kvsidecar.daemon.transport.ops import NotifyOp, ReadOp, check_read

__all__ = ["PostQueue"]

Op = ReadOp | NotifyOp


class PostQueue:
    """``job_of(op)`` makes a checked op's job (what it is, the function the
    thread runs); ``put(jobs)`` queues them as one entry and returns False if
    the worker stopped. ``join_notifs`` makes one notification of several
    (without it every op is its own transfer), within ``max_notif_bytes``; a
    read over ``merge_max_read_bytes`` goes alone."""

    def __init__(self, job_of: Callable[[Op], tuple[str, JobFn]],
                 put: Callable[[tuple[Job, ...]], bool], *,
                 join_notifs: Callable[[list[bytes]], bytes] | None = None,
                 max_notif_bytes: int = 16384,
                 merge_max_read_bytes: int = MERGE_MAX_READ_BYTES) -> None:
        self._job_of = job_of
        self._put = put
        self._join = join_notifs
        self.max_notif_bytes = max_notif_bytes
        self.merge_max_read_bytes = merge_max_read_bytes
        self._soon: list[tuple[Op, Fut]] = []

    def post(self, loop: asyncio.AbstractEventLoop, op: Op) -> Fut:
        """Queue ``op`` for the flush after this loop iteration; its future."""
        fut: Fut = loop.create_future()
        if not self._soon:
            loop.call_soon(self.flush)
        self._soon.append((op, fut))
        return fut

    def flush(self) -> None:
        ops, self._soon = self._soon, []
        valid: list[tuple[Op, Fut]] = []
        for op, fut in ops:
            if fut.done():  # cancelled before it was handed over
                continue
            if isinstance(op, ReadOp):
                try:
                    check_read(op)
                except (ValueError, TypeError) as exc:
                    fut.set_exception(exc)
                    continue
            valid.append((op, fut))
        jobs: list[Job] = []
        for group in self._group([op for op, _ in valid]):
            if len(group) == 1:
                op, fut = valid[group[0]]
                what, fn = self._job_of(op)
                jobs.append(Job(fn, fut, what, op.remote_agent))
            else:
                jobs.append(self._merged_job([valid[i] for i in group]))
        if jobs and not self._put(tuple(jobs)):
            for job in jobs:
                job.fut.set_exception(NixlError(f"{job.what}: worker stopped",
                                                remote=job.remote))

    def _group(self, ops: Sequence[Op]) -> list[list[int]]:
        """Which valid posts of this flush share a transfer (index groups)."""
        if self._join is None or len(ops) < 2:
            return [[i] for i in range(len(ops))]
        return group_ops(ops, self.max_notif_bytes, self.merge_max_read_bytes)

    def _merged_job(self, members: list[tuple[Op, Fut]]) -> Job:
        """One job for posts :meth:`_group` put together: one transfer (or one
        notification) whose outcome every member's future gets."""
        assert self._join is not None
        ops = [op for op, _ in members]
        futs = [fut for _, fut in members]
        fut: Fut = futs[0].get_loop().create_future()
        if isinstance(ops[0], NotifyOp):
            what, fn = self._job_of(merged_notify(
                [op for op in ops if isinstance(op, NotifyOp)], self._join))
            fut.add_done_callback(functools.partial(share, futs, None))
        else:
            reads = [op for op in ops if isinstance(op, ReadOp)]
            merged, parts = merged_read(reads, self._join)
            what, fn = self._job_of(merged)
            what = f"{what} ({len(reads)} reads in one transfer)"
            fut.add_done_callback(functools.partial(share, futs, parts))
        return Job(fn, fut, what, ops[0].remote_agent)
