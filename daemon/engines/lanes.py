"""The NIXL workers of one engine rank: created, started and registered side by side.

Lane 0 is the agent peers know (handshake, notifications in and out, holds);
lanes past 0 (``--post-lanes``) only post reads, so they get no notification
callback and their resets publish nothing (see
:mod:`~kvsidecar.daemon.engines.rank` and ``d_side.parts.lane_of``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from kvsidecar.daemon import notifications
from kvsidecar.daemon.cuda_device import CudaDevice
from kvsidecar.daemon.thread_names import name_this_thread
from kvsidecar.daemon.transport.worker import AgentReset, NixlWorker, WorkerOptions
from kvsidecar.ipc.layout import Layout
from kvsidecar.ipc.regions import Region

T = TypeVar("T")


@dataclass
class Lanes:
    """A rank's started workers, lane 0 first, with its memory registered in each."""

    workers: list[NixlWorker]
    reg_id: int
    #: lane 0's agent metadata (what the handshake publishes)
    metadata: bytes


def make_lanes(agent: str, backends: Sequence[str], count: int, gpu: CudaDevice | None,
               on_notif: Callable[[str, bytes], None],
               on_reset: Callable[[AgentReset], None],
               on_lane_reset: Callable[[AgentReset], None], *,
               progress_thread_ms: int = 0) -> list[NixlWorker]:
    """Lane 0 (named ``agent``, notifications in) and ``count - 1`` posting lanes;
    ``progress_thread_ms``: lane 0's, see ``WorkerOptions.progress_thread_ms``
    (the posting lanes only read: their own polls progress them)."""
    worker = NixlWorker(agent, WorkerOptions(backends=backends,
                                             join_notifs=notifications.join,
                                             max_notif_bytes=notifications.MAX_NOTIF_BYTES,
                                             progress_thread_ms=progress_thread_ms),
                        on_notif=on_notif, on_reset=on_reset,
                        thread_init=partial(worker_thread_init, gpu))
    return [worker] + [
        NixlWorker(f"{agent}-l{k}", WorkerOptions(backends=backends),
                   on_reset=on_lane_reset, thread_init=partial(worker_thread_init, gpu))
        for k in range(1, count)]


async def start_lanes(lanes: list[NixlWorker], layout: Layout, regions: list[Region],
                      mem_type: str, dev_id: int) -> Lanes:
    """Start every lane and register ``regions`` in each, each lane on its own
    thread; on failure every lane is stopped again and the failure raised."""
    try:
        await every(lane.start() for lane in lanes)
        reg_id, *_ = await every(
            lane.register([(r.address, layout.region_bytes) for r in regions], mem_type, dev_id)
            for lane in lanes)
        meta = await lanes[0].metadata()
    except BaseException:
        for lane in lanes:
            with contextlib.suppress(Exception):
                await lane.stop()
        raise
    return Lanes(lanes, reg_id, meta)


async def every(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Await all side by side; raise the first failure once every one ended.
    (``gather`` raises at the first and leaves the others' failures unread:
    asyncio then logs "Task exception was never retrieved" for each lane that
    failed too, and a lane may still be starting while the caller stops it.)"""
    got = await asyncio.gather(*aws, return_exceptions=True)
    for g in got:
        if isinstance(g, BaseException):
            raise g
    return got  # type: ignore[return-value]


def worker_thread_init(gpu: CudaDevice | None) -> None:
    """First thing on a NIXL worker thread: its OS name, then (GPU) its CUDA context."""
    name_this_thread("kvs-nixl")
    if gpu is not None:
        gpu.make_current()
