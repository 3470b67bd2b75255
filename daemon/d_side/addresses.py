"""D side: a read's plan turned into addresses, one :class:`PostList` per
candidate P rank (the planning thread's work), and for host memory the staged
plan of each (see :mod:`~kvsidecar.daemon.staging_plan`). Pure functions."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvsidecar.daemon.planner import (
    Addresses,
    PlanError,
    ReadPlan,
    plan_many,
    plan_many_addressed,
    plan_read,
)
from kvsidecar.daemon.planner.small import plan_small
from kvsidecar.daemon.staging_plan import StagedPlan, plan_staging
from kvsidecar.ipc.layout import Layout
from kvsidecar.ipc.protocol import Read

#: the read path logs as kvsidecar.daemon.reads (what log filters name)
log = logging.getLogger("kvsidecar.daemon.reads")

I64 = NDArray[np.int64]

#: A planning job (the reads of one loop iteration) whose reads come to at most
#: this many pieces (:func:`plan_cost`) is planned on the loop, not on the
#: planning thread (see ThreadGroups); a job of one read, up to
#: :data:`INLINE_PLAN_PIECES_ALONE`. A trip to the thread and back costs the
#: loop and that thread about 200 us of CPU and two wake-ups, and on two busy
#: cores it waits for both. Each read of a job also costs a fixed 10-35 us:
#: on the development host 16 reads of 16 one-layer blocks (512 pieces) plan
#: together in 170 us, 16 reads of 8,192 pieces in all in 300-860 us.
INLINE_PLAN_PIECES = 1024

#: A job of one read plans on the loop up to this many pieces. Planned alone on
#: the development host, a 32-layer model's read of 16 / 64 / 128 blocks
#: (1,024 / 4,096 / 8,192 pieces) takes 36-40 / 48-67 / 70-107 us, 64 blocks
#: read from two P ranks (8,192) about 103 us; 16,384 pieces take 116-380 us,
#: so the loop stops short of them. A 256 MiB read (8,192 pieces) waited
#: about 1 ms on the thread for 110 us of planning.
INLINE_PLAN_PIECES_ALONE = 8192


@dataclass(frozen=True)
class PostList:
    """Absolute addresses for one P rank; empty arrays mean notify only."""

    rank: int
    local: I64
    remote: I64
    length: I64
    descriptors_before: int = 0
    #: the bytes the plan reads from this rank (``length``'s sum, taken on the
    #: planning thread: a numpy reduction on the loop per read cost ~1.6 us)
    nbytes: int = 0



def posts_of(plan: ReadPlan, addrs: Addresses) -> list[PostList]:
    """:func:`build_posts` of a plan whose addresses the planner added
    (:func:`~kvsidecar.daemon.planner.plan_many_addressed`)."""
    by_rank = {r.remote_rank: r for r in plan.reads}
    out = []
    for p in plan.notify:
        rr = by_rank.get(p)
        if rr is None:
            out.append(PostList(p, _EMPTY, _EMPTY, _EMPTY))
        else:
            local, remote = addrs[p]
            out.append(PostList(p, local, remote, rr.length, rr.descriptors_before_coalescing,
                                rr.nbytes))
    return out


_EMPTY = np.empty(0, np.int64)
_EMPTY.setflags(write=False)


def build_posts(plan: ReadPlan, local_bases: I64, remote_bases: dict[int, I64]) -> list[PostList]:
    """Turn region-relative plan offsets into addresses (vectorised; planning thread)."""
    return posts_of(plan, {rr.remote_rank: (local_bases[rr.region] + rr.local_offset,
                                            remote_bases[rr.remote_rank][rr.region]
                                            + rr.remote_offset)
                           for rr in plan.reads})


def plan_and_address(local: Layout, rank: int, remote: Layout, req: Read,
                      local_bases: I64, remote_bases: dict[int, I64],
                      staging: dict[int, str] | None = None,
                      ) -> tuple[ReadPlan, list[PostList], list[StagedPlan | None]]:
    """Plan, addresses, and per P rank the staged plan (``staging``: mode per rank).
    A small attention read with nothing staged is planned with Python ints
    (:func:`~kvsidecar.daemon.planner.small.plan_small`: the same plan)."""
    if not staging or all(m == "off" for m in staging.values()):
        small = plan_small(local, rank, remote, req.local_block_ids, req.remote_block_ids,
                           req.skip_tokens, req.num_tokens, local_bases=local_bases,
                           remote_bases=remote_bases)
        if small is not None:
            posts = posts_of(*small)
            return small[0], posts, [None] * len(posts)
    plan = plan_read(local, rank, remote, req.local_block_ids, req.remote_block_ids,
                     skip_tokens=req.skip_tokens, num_tokens=req.num_tokens, check=False)
    return _address(plan, local_bases, remote_bases, staging)


def _address(plan: ReadPlan, local_bases: I64, remote_bases: dict[int, I64],
             staging: dict[int, str] | None,
             ) -> tuple[ReadPlan, list[PostList], list[StagedPlan | None]]:
    posts = build_posts(plan, local_bases, remote_bases)
    modes = staging or {}
    # a staged run reads inside one remote region (each is its own registration)
    regions = {rr.remote_rank: rr.region.astype(np.int64) for rr in plan.reads}
    return plan, posts, [plan_staging(p.local, p.remote, p.length, mode=modes[p.rank],
                                      region=regions[p.rank])
                         if p.length.size and modes.get(p.rank, "off") != "off" else None
                         for p in posts]


def plan_and_address_many(calls: list[tuple[Any, ...]]) -> list[tuple[bool, Any]]:
    """:func:`plan_and_address` for the reads of one planning job (a Batch), each
    call's outcome in its place: the reads between the same two layouts are
    planned together (:func:`~kvsidecar.daemon.planner.plan_many`); those with
    nothing staged over the very same base arrays get their addresses added by
    the planner in one pass (:func:`~kvsidecar.daemon.planner.plan_many_addressed`)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, (local, rank, remote, _, local_bases, remote_bases, *staging) in enumerate(calls):
        staged = bool(staging and staging[0])
        key = (id(local), rank, id(remote), staged, id(local_bases),
               *((p, id(b)) for p, b in remote_bases.items()))
        groups.setdefault(key, []).append(i)
    out: list[tuple[bool, Any]] = [(False, None)] * len(calls)
    for key, idx in groups.items():
        local, rank, remote, _, local_bases, remote_bases, *_ = calls[idx[0]]
        many = [(r.local_block_ids, r.remote_block_ids, r.skip_tokens, r.num_tokens)
                for r in (calls[i][3] for i in idx)]
        if not key[3]:
            try:
                addressed = plan_many_addressed(local, rank, remote, many, local_bases,
                                                remote_bases)
            except Exception:  # planned one by one below: a failure stays its read's own
                log.exception("planning %d reads with their addresses failed", len(idx))
            else:
                for i, got in zip(idx, addressed):
                    if isinstance(got, PlanError):
                        out[i] = (False, got)
                    else:
                        posts = posts_of(*got)
                        out[i] = (True, (got[0], posts, [None] * len(posts)))
                continue
        plans = plan_many(local, rank, remote, many)
        for i, plan in zip(idx, plans):
            if isinstance(plan, PlanError):
                out[i] = (False, plan)
                continue
            _, _, _, _, local_bases, remote_bases, *staging = calls[i]
            try:
                out[i] = (True, _address(plan, local_bases, remote_bases,
                                         staging[0] if staging else None))
            except Exception as e:
                out[i] = (False, e)
    return out
