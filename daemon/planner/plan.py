"""Plans: every descriptor D rank j reads for a request, per P rank, coalesced.

A request's descriptors are its paired views (:mod:`.pairing`) times the
pieces of their group (:mod:`.pieces`): for each P rank, group by group,
each in (region, pair, piece) order, so descriptors that touch on both sides
are neighbours and merge in one vectorised pass (:func:`coalesce`).

There is one planning implementation, for several requests between the same
two layouts (:func:`plan_many`): the descriptors of every request are built,
ordered and coalesced in one pass per P rank (at 16 blocks a request, numpy's
per-call cost, not the data, was most of a read's planning), and coalescing
never merges two requests. :func:`plan_read` is a plan of one request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from kvsidecar.daemon.planner.arrays import I32, I64, uadd
from kvsidecar.daemon.planner.block_ids import BlockIds
from kvsidecar.daemon.planner.errors import PlanError
from kvsidecar.daemon.planner.pairing import ManyRequest, Paired, pair_requests
from kvsidecar.daemon.planner.pieces import SHARED_PIECES, PieceCache, PieceGroup
from kvsidecar.daemon.planner.ranks import candidate_ranks
from kvsidecar.ipc.layout import Layout, check_compatible


@dataclass(frozen=True, slots=True)
class RankRead:
    """All descriptors D reads from one P rank for one request.

    Offsets are relative to the start of region ``region[i]`` on each side;
    the daemon adds the registered base addresses.
    """

    remote_rank: int
    region: I32
    local_offset: I64
    remote_offset: I64
    length: I64
    descriptors_before_coalescing: int

    @property
    def descriptors(self) -> int:
        return int(self.length.size)

    @property
    def nbytes(self) -> int:
        return int(uadd(self.length))


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """What one D rank does for one request.

    ``notify`` lists every candidate P rank: each gets exactly one
    notification, even when nothing is read from it (full prefix hit,
    replicated units read elsewhere).
    """

    notify: tuple[int, ...]
    reads: tuple[RankRead, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reads)

    @property
    def descriptors(self) -> int:
        return sum(r.descriptors for r in self.reads)

    @property
    def descriptors_before_coalescing(self) -> int:
        return sum(r.descriptors_before_coalescing for r in self.reads)


#: descriptors as parallel arrays: region, local offset, remote offset, length
Descriptors = tuple[I32, I64, I64, I64]

#: per P rank, the absolute (local, remote) addresses of a plan's descriptors
Addresses = dict[int, tuple[I64, I64]]


def coalesce(region: I32, loff: I64, roff: I64, length: I64) -> Descriptors:
    """Merge each descriptor into its predecessor when both sides continue it."""
    return merge_runs(region, loff, roff, length, run_starts(region, loff, roff, length))


def run_starts(region: I32, loff: I64, roff: I64, length: I64, owner: I64 | None = None
               ) -> NDArray[np.intp]:
    """Where each run of descriptors starts that continue one another on both
    sides, in one region (and, with ``owner``, of one owner): :func:`coalesce`'s rule."""
    n = length.size
    if n < 2:
        return np.arange(n)
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    np.not_equal(loff[1:], loff[:-1] + length[:-1], out=brk[1:])
    brk[1:] |= roff[1:] != roff[:-1] + length[:-1]
    brk[1:] |= region[1:] != region[:-1]
    if owner is not None:
        brk[1:] |= owner[1:] != owner[:-1]
    return brk.nonzero()[0]


def merge_runs(region: I32, loff: I64, roff: I64, length: I64, starts: NDArray[np.intp]
               ) -> Descriptors:
    """One descriptor per run of :func:`run_starts` (the arrays themselves when
    every run is one descriptor)."""
    if starts.size == length.size:
        return region, loff, roff, length
    return region[starts], loff[starts], roff[starts], np.add.reduceat(length, starts)


def _descriptors(regions: I32, lpair: I64, rpair: I64, po_l: I64, po_r: I64, po_n: I64
                 ) -> Descriptors:
    """Every (region, pair, piece) descriptor of one piece group, in that order.

    Filled by broadcasting assignment into preallocated arrays: C-level only
    (``np.broadcast_to`` + ``reshape`` cost several Python calls per array, a
    quarter of a small read's planning)."""
    shape = (regions.size, lpair.size, po_n.size)
    reg = np.empty(shape, np.int32)
    reg[...] = regions[:, None, None]
    lo = np.empty(shape, np.int64)
    np.add(lpair[:, None], po_l[None, :], out=lo[0])
    ro = np.empty(shape, np.int64)
    np.add(rpair[:, None], po_r[None, :], out=ro[0])
    if shape[0] > 1:
        lo[1:] = lo[0]
        ro[1:] = ro[0]
    ln = np.empty(shape, np.int64)
    ln[...] = po_n
    return reg.reshape(-1), lo.reshape(-1), ro.reshape(-1), ln.reshape(-1)


def plan_read(
    local: Layout,
    d_rank: int,
    remote: Layout,
    local_block_ids: BlockIds,
    remote_block_ids: BlockIds,
    *,
    skip_tokens: int | None = None,
    num_tokens: int | None = None,
    check: bool = True,
    cache: PieceCache | None = None,
) -> ReadPlan:
    """Plan one request's reads for D rank ``d_rank``: :func:`plan_many` of one
    request, its PlanError raised.

    ``num_tokens`` (the request's length) drops attention kernel blocks that
    start at or after it. ``check=False`` skips the compatibility check that
    the daemon already did at handshake time.
    """
    if check:
        check_compatible(local, remote)
    request = (local_block_ids, remote_block_ids, skip_tokens, num_tokens)
    (plan,), _ = _plan_many(local, d_rank, remote, (request,), None, cache)
    if isinstance(plan, PlanError):
        raise plan
    return plan


def plan_many(local: Layout, d_rank: int, remote: Layout, requests: Sequence[ManyRequest],
              cache: PieceCache | None = None) -> list[ReadPlan | PlanError]:
    """:func:`plan_read` (``check=False``) for several requests between the same
    two layouts, in one pass per P rank. A request that cannot be planned gets
    its PlanError in its place; the others are planned as usual."""
    return _plan_many(local, d_rank, remote, requests, None, cache)[0]


def plan_many_addressed(local: Layout, d_rank: int, remote: Layout,
                        requests: Sequence[ManyRequest], local_bases: I64,
                        remote_bases: dict[int, I64], cache: PieceCache | None = None,
                        ) -> list[tuple[ReadPlan, Addresses] | PlanError]:
    """:func:`plan_many`, each plan with its descriptors' absolute addresses per
    P rank (``local_bases[region] + local_offset``, and the same with P rank
    ``p``'s ``remote_bases[p]``): added once per P rank over every request's
    descriptors, not once per request (two fancy indexings and two additions
    per request and rank were a fifth of a batched read's planning)."""
    plans, addrs = _plan_many(local, d_rank, remote, requests, (local_bases, remote_bases),
                              cache)
    return [p if isinstance(p, PlanError) else (p, a) for p, a in zip(plans, addrs)]


def _plan_many(local: Layout, d_rank: int, remote: Layout, requests: Sequence[ManyRequest],
               bases: tuple[I64, dict[int, I64]] | None, cache: PieceCache | None,
               ) -> tuple[list[ReadPlan | PlanError], list[Addresses]]:
    """:func:`plan_many`, with the addresses of :func:`plan_many_addressed` when
    ``bases`` (local, per P rank remote) are given (else every dict is empty)."""
    addrs: list[Addresses] = [{} for _ in requests]
    notify = candidate_ranks(local.tp_size, d_rank, remote.tp_size)
    ok, paired, failed = pair_requests(local, remote, requests)
    reads: dict[int, list[RankRead]] = {r: [] for r in ok}
    if cache is None:
        cache = SHARED_PIECES
    for p, groups in cache.get(local, d_rank, remote) if ok else ():
        built = _rank_descriptors(groups, paired, ok)
        if built is None:
            continue
        (reg, lo, ro, ln), spans = _coalesced(*built, ok, len(requests))
        if bases is not None:
            la, ra = bases[0][reg] + lo, bases[1][p][reg] + ro
        for r, a, b, before in spans:
            reads[r].append(RankRead(p, reg[a:b], lo[a:b], ro[a:b], ln[a:b], before))
            if bases is not None:
                addrs[r][p] = (la[a:b], ra[a:b])
    out: list[ReadPlan | PlanError] = [
        failed[r] if r in failed else ReadPlan(notify, tuple(reads[r]))
        for r in range(len(requests))
    ]
    return out, addrs


def _rank_descriptors(groups: list[PieceGroup], paired: Paired, ok: list[int]
                      ) -> tuple[Descriptors, I64 | None] | None:
    """Every descriptor of one P rank's piece groups, request-major and, within a
    request, group by group, each in region, pair, piece order; with the request
    of each (None for a single request). None when there is none."""
    oks = np.asarray(ok, np.int64) if len(ok) > 1 else None
    chunks: list[Descriptors] = []
    owners: list[I64] = []
    for gi, regions, po_l, po_r, po_n in groups:
        lpair, rpair, counts = paired[gi]
        if not lpair.size:
            continue
        chunks.append(_descriptors(regions, lpair, rpair, po_l, po_r, po_n))
        if oks is not None:  # the request of each descriptor, as _descriptors orders them
            owner = np.empty((regions.size, lpair.size, po_n.size), np.int64)
            owner[...] = np.repeat(oks, counts)[None, :, None]
            owners.append(owner.reshape(-1))
    if not chunks:
        return None
    if len(chunks) == 1:
        reg, lo, ro, ln = chunks[0]
    else:
        reg = np.concatenate([c[0] for c in chunks])
        lo = np.concatenate([c[1] for c in chunks])
        ro = np.concatenate([c[2] for c in chunks])
        ln = np.concatenate([c[3] for c in chunks])
    if oks is None:
        return (reg, lo, ro, ln), None
    owner = np.concatenate(owners) if len(owners) > 1 else owners[0]
    order = np.argsort(owner, kind="stable")  # request-major, each request's order kept
    return (reg[order], lo[order], ro[order], ln[order]), owner[order]


def _coalesced(descs: Descriptors, owner: I64 | None, ok: list[int], nreq: int
               ) -> tuple[Descriptors, list[tuple[int, int, int, int]]]:
    """``descs`` coalesced, never across two requests, and each request's share:
    (request, first, end, descriptors before coalescing), requests without any
    left out."""
    reg, lo, ro, ln = descs
    if owner is None:  # one request
        before = int(ln.size)
        merged = merge_runs(reg, lo, ro, ln, run_starts(reg, lo, ro, ln))
        return merged, [(ok[0], 0, int(merged[3].size), before)]
    counts = np.bincount(owner, minlength=nreq).tolist()
    starts = run_starts(reg, lo, ro, ln, owner)
    merged = merge_runs(reg, lo, ro, ln, starts)
    bounds = np.searchsorted(owner[starts], np.arange(nreq + 1)).tolist()
    return merged, [(r, bounds[r], bounds[r + 1], counts[r]) for r in ok if counts[r]]
