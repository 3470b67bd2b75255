"""Which slice of which segment D rank j reads from which P rank: block independent.

The rule (LAYOUT.md sections 3-4) is the same for every segment of every
family. A segment is ``[units][unit_bytes]``; each rank holds a contiguous
unit range, and D rank j takes each unit it needs from the first candidate P
rank (:func:`~kvsidecar.daemon.planner.ranks.candidate_ranks`) that holds it::

    P tp=1, D tp=2 (D reads a slice of one P rank: D_tp/P_tp = 2 readers per P)

      P0 conv page:  | x0 x1 x2 x3 | B0 B1 | C0 C1 | ssm h0 h1 h2 h3 |
                       \\___/ \\___/  \\_/ \\_/  \\_/ \\_/   \\___/ \\___/
      D0 reads          x0 x1        B0     C0        h0 h1            (4 reads)
      D1 reads                x2 x3     B1     C1           h2 h3      (4 reads)

    P tp=4, D tp=1, K=2 KV heads (D gathers; replicated heads are read once)

      P0: head 0   P1: head 0   P2: head 1   P3: head 1     (attention)
      P0..P3: a quarter of every Mamba segment each          (mamba)
      D0 reads attention from P0 and P2, Mamba from P0..P3, and notifies all four.

The result, a list of :class:`Piece`, depends on the two layouts and the D
rank only; every paired view of a request multiplies it later. A
:class:`PieceCache` keeps it, as arrays grouped per P rank, for the layouts a
daemon plans between.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

from kvsidecar.daemon.planner.arrays import I32, I64
from kvsidecar.daemon.planner.errors import PlanError
from kvsidecar.daemon.planner.ranks import candidate_ranks
from kvsidecar.ipc.layout import Layout, Segment, segment_regions, unit_bytes, unit_range


@dataclass(frozen=True, slots=True)
class Piece:
    """One contiguous slice of a segment that D reads from one P rank.

    Offsets are within the view (kernel block or page) of each side.
    """

    group: int
    segment: str
    remote_rank: int
    local_offset: int
    remote_offset: int
    nbytes: int
    regions: tuple[int, ...]


def segment_pieces(local: Layout, d_rank: int, remote: Layout) -> list[Piece]:
    """Apply LAYOUT.md section 4 to every segment once; blocks multiply it later."""
    cands = candidate_ranks(local.tp_size, d_rank, remote.tp_size)
    out: list[Piece] = []
    for gi, (lg, rg) in enumerate(zip(local.groups, remote.groups)):
        for ls, rs in zip(lg.segments, rg.segments):
            out.extend(_pieces_of_segment(gi, ls, rs, local, d_rank, remote, cands))
    return out


def _pieces_of_segment(gi: int, ls: Segment, rs: Segment, local: Layout, d_rank: int,
                       remote: Layout, cands: tuple[int, ...]) -> list[Piece]:
    """The units of local segment ``ls`` D rank ``d_rank`` holds, each from the
    first of ``cands`` whose share of remote segment ``rs`` holds it."""
    ub = unit_bytes(ls, local.tp_size)
    lo, hi = unit_range(ls, local.tp_size, d_rank)
    regions = segment_regions(ls, local.num_regions)
    out: list[Piece] = []
    needed = [(lo, hi)]
    for p in cands:
        plo, phi = unit_range(rs, remote.tp_size, p)
        rest: list[tuple[int, int]] = []
        for a, b in needed:
            s, e = max(a, plo), min(b, phi)
            if s >= e:
                rest.append((a, b))
                continue
            out.append(Piece(group=gi, segment=ls.name, remote_rank=p,
                             local_offset=ls.offset + (s - lo) * ub,
                             remote_offset=rs.offset + (s - plo) * ub,
                             nbytes=(e - s) * ub, regions=regions))
            if a < s:
                rest.append((a, s))
            if e < b:
                rest.append((e, b))
        needed = rest
    if needed:  # pragma: no cover - impossible for layouts that pass validate()
        raise PlanError(f"segment {ls.name!r}: units {needed} held by none of P ranks {cands}")
    return out


#: pieces of one group over one region set, as read-only arrays in local
#: offset order: (group, regions, local offsets, remote offsets, bytes)
PieceGroup = tuple[int, I32, I64, I64, I64]

#: per candidate P rank, in read-preference order: that rank's piece groups
RankPieces = list[tuple[int, list[PieceGroup]]]


def rank_pieces(local: Layout, d_rank: int, remote: Layout) -> RankPieces:
    """Per candidate P rank, :func:`segment_pieces` grouped by (group, region set)
    as arrays, in (region, pair, offset) order so neighbours are adjacent."""
    pieces = segment_pieces(local, d_rank, remote)
    out: RankPieces = []
    for p in candidate_ranks(local.tp_size, d_rank, remote.tp_size):
        by_key: dict[tuple[int, tuple[int, ...]], list[Piece]] = {}
        for pc in pieces:
            if pc.remote_rank == p:
                by_key.setdefault((pc.group, pc.regions), []).append(pc)
        out.append((p, [_piece_group(gi, regions, pcs)
                        for (gi, regions), pcs in by_key.items()]))
    return out


def _piece_group(gi: int, regions: tuple[int, ...], pcs: list[Piece]) -> PieceGroup:
    pcs = sorted(pcs, key=lambda x: x.local_offset)
    arrays = (np.asarray(regions, dtype=np.int32),
              np.array([x.local_offset for x in pcs], dtype=np.int64),
              np.array([x.remote_offset for x in pcs], dtype=np.int64),
              np.array([x.nbytes for x in pcs], dtype=np.int64))
    for a in arrays:
        a.setflags(write=False)  # shared by every plan of these layouts
    return (gi, *arrays)


class PieceCache:
    """:func:`rank_pieces` of the last ``size`` (local layout, D rank, remote
    layout) triples asked for, least recently used out first.

    Layouts are found by identity, not by value: a Layout holds a dict, so it
    has no hash, and the daemon keeps one Layout object per engine and per
    link. An entry holds both layouts, so their ids are never reused while it
    is cached; a different object with equal fields is a miss (and is built
    again), never a wrong hit.
    """

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._entries: collections.OrderedDict[
            tuple[int, int, int], tuple[Layout, Layout, RankPieces]
        ] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, local: Layout, d_rank: int, remote: Layout) -> RankPieces:
        """The pieces of these layouts: from the cache, or built and cached."""
        key = (id(local), d_rank, id(remote))
        hit = self._entries.get(key)
        if hit is not None and hit[0] is local and hit[1] is remote:
            self._entries.move_to_end(key)
            return hit[2]
        out = rank_pieces(local, d_rank, remote)
        self._entries[key] = (local, remote, out)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return out


#: the cache of planning calls that bring none of their own
SHARED_PIECES = PieceCache()
