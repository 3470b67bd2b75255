"""D side: one accepted read request, from handshake to completion.

::

    accepted ─▶ linking (handshake + add_remote per candidate P rank, shared)
             ─▶ planning (planner + addresses, on the planning thread)
             ─▶ posted (one NIXL READ per P rank with bytes, carrying the notification;
                        a bare notification to candidates we read nothing from)
             ─▶ received | failed | aborted

An abort before posting cancels the job at once. After posting the job waits
for every transfer to finish before it reports ``aborted``: the engine may
only reuse its blocks once nothing writes into them any more.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvsidecar.daemon import notifications
from kvsidecar.daemon.engines import EngineRank
from kvsidecar.daemon.nixl_worker import TransferStats
from kvsidecar.daemon.peers import Peer
from kvsidecar.daemon.planner import ReadPlan, candidate_ranks, plan_read
from kvsidecar.ipc.layout import Layout
from kvsidecar.ipc.protocol import Completion, Read

log = logging.getLogger(__name__)

I64 = NDArray[np.int64]


class PartialReadError(RuntimeError):
    """Some P ranks were read and notified, others failed: never retried."""


@dataclass
class ReadJob:
    req: Read
    accepted_at: float = field(default_factory=time.monotonic)
    posted: bool = False
    abort_reason: str | None = None
    peers: list[Peer] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    def abort(self, reason: str) -> None:
        """Abort now if nothing is posted yet; else report ``aborted`` once transfers end."""
        if self.abort_reason is None:
            self.abort_reason = reason
        if not self.posted and self.task is not None:
            self.task.cancel()


@dataclass(frozen=True)
class PostList:
    """Absolute addresses for one P rank; empty arrays mean notify only."""

    rank: int
    local: I64
    remote: I64
    length: I64


@dataclass(frozen=True)
class ReadOutcome:
    nbytes: int
    descriptors: int
    descriptors_before: int
    stats: list[TransferStats]


def build_posts(plan: ReadPlan, local_bases: I64, remote_bases: dict[int, I64]) -> list[PostList]:
    """Turn region-relative plan offsets into addresses (vectorised; planning thread)."""
    by_rank = {r.remote_rank: r for r in plan.reads}
    out = []
    empty = np.empty(0, np.int64)
    for p in plan.notify:
        rr = by_rank.get(p)
        if rr is None:
            out.append(PostList(p, empty, empty, empty))
        else:
            out.append(PostList(p, local_bases[rr.region] + rr.local_offset,
                                remote_bases[p][rr.region] + rr.remote_offset, rr.length))
    return out


def _plan_and_address(local: Layout, rank: int, remote: Layout, req: Read,
                      local_bases: I64, remote_bases: dict[int, I64]
                      ) -> tuple[ReadPlan, list[PostList]]:
    plan = plan_read(local, rank, remote, req.local_block_ids, req.remote_block_ids,
                     skip_tokens=req.skip_tokens, num_tokens=req.num_tokens, check=False)
    return plan, build_posts(plan, local_bases, remote_bases)


async def run_read(eng: EngineRank, job: ReadJob, planner: Executor,
                   timeout_s: float | None = None) -> ReadOutcome:
    """Carry one read through; raises on failure (the caller turns it into a completion)."""
    req = job.req
    remote = req.remote
    cands = candidate_ranks(eng.layout.tp_size, eng.tp_rank, remote.tp_size)
    peers: list[Peer] = await asyncio.gather(
        *(eng.peers.get(remote.handshake[p], remote.engine_id, remote.tp_size, p) for p in cands)
    )
    job.peers = peers
    layout = peers[0].info.layout
    for p, peer in zip(cands[1:], peers[1:]):
        if peer.info.layout != layout:
            raise RuntimeError(
                f"remote engine {remote.engine_id!r} ranks {cands[0]} and {p} report different "
                "layouts (cache sizes differ between ranks)"
            )
    loop = asyncio.get_running_loop()
    plan, posts = await loop.run_in_executor(
        planner, _plan_and_address, eng.layout, eng.tp_rank, layout, req, eng.bases,
        {p: peer.bases for p, peer in zip(cands, peers)},
    )
    if job.abort_reason is not None:
        raise asyncio.CancelledError
    job.posted = True
    note = notifications.encode(remote.engine_id, req.remote_request_id or req.request_id,
                                eng.engine_id, eng.tp_rank, eng.layout.tp_size)
    agents = {p: peer.agent for p, peer in zip(cands, peers)}
    ops: list[Coroutine[Any, Any, TransferStats | None]] = []
    for post in posts:
        if post.length.size:
            ops.append(eng.worker.read(agents[post.rank], post.local, post.remote, post.length,
                                       notif=note, timeout_s=timeout_s))
        else:
            ops.append(eng.worker.notify(agents[post.rank], note))
    results = await asyncio.gather(*ops, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors and len(errors) < len(results):
        # Some ranks were read and notified: their holds may be released already,
        # so this read must not be retried as a whole.
        raise PartialReadError(
            f"{len(errors)} of {len(results)} remote ranks failed ({errors[0]}); the others "
            "were read and notified"
        ) from errors[0]
    if errors:
        raise errors[0]
    return ReadOutcome(plan.nbytes, plan.descriptors, plan.descriptors_before_coalescing,
                       [r for r in results if isinstance(r, TransferStats)])


def failed(req: Read, reason: str) -> Completion:
    return Completion(req.request_id, "failed", reason,
                      invalid_block_ids=[list(g) for g in req.local_block_ids])


def aborted(req: Read, reason: str) -> Completion:
    return Completion(req.request_id, "aborted", reason,
                      invalid_block_ids=[list(g) for g in req.local_block_ids])
