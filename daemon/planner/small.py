"""A read of a few attention pages, planned with Python ints.

The same plan as :func:`~kvsidecar.daemon.planner.plan.plan_read` (a property
test holds the two equal, errors included), for the reads a D sidecar plans
on its event loop the moment they arrive: there, for a few pages, numpy's
per-call overhead is nearly all of the work (a 1-page read planned in about
65 us hot and 240 us in the daemon between reads, with cold caches), and
several of its calls release the GIL even for a handful of elements, which
hands the loop's GIL to the NIXL worker thread whenever it is runnable.

Only attention groups without a sliding window, block ids as plain lists of
ints and at most :data:`SMALL_PIECES` descriptors before coalescing qualify
(:func:`plan_small` returns None otherwise: past that the Python loop, about
1.5 us a descriptor, costs more than numpy's vectorised pass). The pieces
come from the same :class:`~kvsidecar.daemon.planner.pieces.PieceCache`, the
pairing rule from :func:`~kvsidecar.daemon.planner.pairing.attention_pairs`,
the validation from :func:`~kvsidecar.daemon.planner.block_ids.check_block_ids`.
"""

from __future__ import annotations

import numpy as np

from kvsidecar.daemon.planner.arrays import I64
from kvsidecar.daemon.planner.block_ids import BlockIds, check_block_ids
from kvsidecar.daemon.planner.cost import plan_cost
from kvsidecar.daemon.planner.pairing import attention_pairs
from kvsidecar.daemon.planner.pieces import SHARED_PIECES, PieceCache, PieceGroup
from kvsidecar.daemon.planner.plan import Addresses, RankRead, ReadPlan
from kvsidecar.daemon.planner.ranks import candidate_ranks
from kvsidecar.ipc.layout import Group, Layout

__all__ = ["SMALL_PIECES", "plan_small"]

#: at most this many descriptors before coalescing (:func:`plan_cost`), and as
#: many pages named on either side
SMALL_PIECES = 32

_INT = {int}


def _qualifies(local: Layout, remote: Layout, lids: BlockIds, rids: BlockIds) -> bool:
    """Checked cheapest first: a large read (planned on the planning thread)
    is turned away by its counts before any of its ids is looked at."""
    if not all(g.kind == "attention" and not g.window_tokens
               for g in (*local.groups, *remote.groups)):
        return False
    if not all(type(ids) is list for ids in (*lids, *rids)):
        return False
    if (sum(map(len, rids)) > SMALL_PIECES
            or plan_cost(local, remote.tp_size, sum(map(len, lids))) > SMALL_PIECES):
        return False
    return all(set(map(type, ids)) <= _INT for ids in (*lids, *rids))


def _views(layout: Layout, group: Group, ids: list[int]) -> list[int]:
    """:func:`~kvsidecar.ipc.layout.view_offsets` with Python ints."""
    page = layout.page_bytes
    if group.sub_blocks == 1:
        return [b * page for b in ids]
    kb = group.kernel_block_bytes
    return [b * page + k * kb for b in ids for k in range(group.sub_blocks)]


def plan_small(local: Layout, d_rank: int, remote: Layout, local_ids: BlockIds,
               remote_ids: BlockIds, skip_tokens: int | None = None,
               num_tokens: int | None = None, *, local_bases: I64 | None = None,
               remote_bases: dict[int, I64] | None = None, cache: PieceCache | None = None,
               ) -> tuple[ReadPlan, Addresses] | None:
    """:func:`~kvsidecar.daemon.planner.plan.plan_read` (``check=False``) of one
    small request, or None when it does not qualify (see the module). Raises
    the PlanError ``plan_read`` raises. With ``local_bases`` and
    ``remote_bases`` the descriptors' absolute addresses per P rank come with
    it (as :func:`~kvsidecar.daemon.planner.plan.plan_many_addressed` gives
    them); else the addresses are empty."""
    notify = candidate_ranks(local.tp_size, d_rank, remote.tp_size)
    if not _qualifies(local, remote, local_ids, remote_ids):
        return None
    check_block_ids(local, local_ids, "local")
    check_block_ids(remote, remote_ids, "remote")
    pairs: list[tuple[list[int], list[int]]] = []
    for gi, (lg, rg) in enumerate(zip(local.groups, remote.groups)):
        lids, rids = local_ids[gi], remote_ids[gi]
        if not lids:
            pairs.append(([], []))
            continue
        skip_k, n = attention_pairs(gi, lg, rg, len(lids), len(rids), skip_tokens, num_tokens)
        pairs.append((_views(local, lg, list(lids))[:n],
                      _views(remote, rg, list(rids))[skip_k:skip_k + n]))
    reads: list[RankRead] = []
    addrs: Addresses = {}
    lbase = local_bases.tolist() if local_bases is not None else None
    for p, groups in (cache or SHARED_PIECES).get(local, d_rank, remote):
        regs, los, ros, lns, before = _coalesced(groups, pairs)
        if not before:
            continue
        reads.append(RankRead(p, np.array(regs, np.int32), np.array(los, np.int64),
                              np.array(ros, np.int64), np.array(lns, np.int64), before))
        if lbase is not None and remote_bases is not None:
            rbase = remote_bases[p].tolist()
            addrs[p] = (np.array([lbase[r] + o for r, o in zip(regs, los)], np.int64),
                        np.array([rbase[r] + o for r, o in zip(regs, ros)], np.int64))
    return ReadPlan(notify, tuple(reads)), addrs


def _coalesced(groups: list[PieceGroup], pairs: list[tuple[list[int], list[int]]]
               ) -> tuple[list[int], list[int], list[int], list[int], int]:
    """One P rank's descriptors in the planner's order (piece group by piece
    group, each region by region, pair by pair, piece by piece), each merged
    into its predecessor when it continues it on both sides: regions, local
    offsets, remote offsets, lengths, and how many there were before merging."""
    regs: list[int] = []
    los: list[int] = []
    ros: list[int] = []
    lns: list[int] = []
    before = 0
    for gi, regions, po_l, po_r, po_n in groups:
        lk, rk = pairs[gi]
        if not lk:
            continue
        pieces = list(zip(po_l.tolist(), po_r.tolist(), po_n.tolist()))
        for reg in regions.tolist():
            for lv, rv in zip(lk, rk):
                for a, b, n in pieces:
                    before += 1
                    lo, ro = lv + a, rv + b
                    if (regs and regs[-1] == reg and los[-1] + lns[-1] == lo
                            and ros[-1] + lns[-1] == ro):
                        lns[-1] += n
                    else:
                        regs.append(reg)
                        los.append(lo)
                        ros.append(ro)
                        lns.append(n)
    return regs, los, ros, lns, before
