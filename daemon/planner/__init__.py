"""Which bytes a decode (D) rank reads from which prefill (P) rank: pure math.

No I/O and no state: every function maps layouts and block ids to numpy
arrays, so the whole transfer logic can be tested exhaustively without NIXL
(``tests/unit/test_planner_oracle.py``) and the daemon only turns offsets into
addresses.

The rule (LAYOUT.md sections 3-4) is the same for every segment of every
family. A segment is ``[units][unit_bytes]``; each rank holds a contiguous
unit range, and D rank j takes each unit it needs from the first candidate P
rank that holds it::

    P tp=1, D tp=2 (D reads a slice of one P rank: D_tp/P_tp = 2 readers per P)

      P0 conv page:  | x0 x1 x2 x3 | B0 B1 | C0 C1 | ssm h0 h1 h2 h3 |
                       \\___/ \\___/  \\_/ \\_/  \\_/ \\_/   \\___/ \\___/
      D0 reads          x0 x1        B0     C0        h0 h1            (4 reads)
      D1 reads                x2 x3     B1     C1           h2 h3      (4 reads)

    P tp=4, D tp=1, K=2 KV heads (D gathers; replicated heads are read once)

      P0: head 0   P1: head 0   P2: head 1   P3: head 1     (attention)
      P0..P3: a quarter of every Mamba segment each          (mamba)
      D0 reads attention from P0 and P2, Mamba from P0..P3, and notifies all four.

Attention blocks are paired by token, not by block id: each side's logical
blocks are expanded into kernel blocks (``sub_blocks`` per page, which differ
between P and D when their tp differs), the i-th local kernel block pairs with
remote kernel block ``skip / block_tokens + i``, and pairing stops at the
shorter list. A sliding-window group (``window_tokens``) names the tails of
both sides' pages, each ending with the page of token ``num_tokens - 1``: the
two tails pair by token where they overlap. Mamba pages pair one to one and
are never trimmed.

Descriptors come out in (region, block, offset) order, so descriptors that
touch on both sides are merged in one vectorised pass (:func:`coalesce`).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvsidecar.ipc.layout import (
    Group,
    Layout,
    check_compatible,
    segment_regions,
    unit_bytes,
    unit_range,
    view_offsets,
)

I64 = NDArray[np.int64]
I32 = NDArray[np.int32]
BlockIds = Sequence[Sequence[int] | NDArray[np.integer]]


_SET_CHECK_MAX = 512  # local ids up to this many are checked for duplicates with a set
_umax = np.maximum.reduce
_uany = np.logical_or.reduce
_uadd = np.add.reduce


class PlanError(ValueError):
    """A read request that cannot be planned; the message names the problem."""


class TpError(PlanError):
    """The two engines' tensor-parallel sizes cannot be paired."""


class GroupCountError(PlanError):
    """A request names block ids for a different number of groups than the layout has."""


class BlockRangeError(PlanError):
    """A block id lies outside ``[0, num_blocks)`` of the side it refers to."""


class DuplicateBlockError(PlanError):
    """A local block id appears twice, so a byte would be written twice."""


class PairingError(PlanError):
    """Local and remote block lists cannot be paired (prefix ``skip``, Mamba counts)."""


# --------------------------------------------------------------------------
# Ranks
# --------------------------------------------------------------------------


def _check_tp(d_tp: int, d_rank: int, p_tp: int) -> None:
    if d_tp < 1 or p_tp < 1:
        raise TpError(f"tp sizes must be >= 1 (local {d_tp}, remote {p_tp})")
    if not 0 <= d_rank < d_tp:
        raise TpError(f"local rank {d_rank} outside tp size {d_tp}")
    if max(d_tp, p_tp) % min(d_tp, p_tp):
        raise TpError(
            f"tp sizes {d_tp} (local) and {p_tp} (remote) are not multiples of one another"
        )


def candidate_ranks(d_tp: int, d_rank: int, p_tp: int) -> tuple[int, ...]:
    """The P ranks D rank ``d_rank`` may read from, and must notify, in read-preference order."""
    _check_tp(d_tp, d_rank, p_tp)
    if d_tp >= p_tp:
        return (d_rank // (d_tp // p_tp),)
    a = p_tp // d_tp
    return tuple(range(d_rank * a, (d_rank + 1) * a))


def expected_notifications(p_tp: int, d_tp: int) -> int:
    """How many notifications one P rank receives per request from one D engine."""
    _check_tp(d_tp, 0, p_tp)
    return d_tp // p_tp if d_tp > p_tp else 1


# --------------------------------------------------------------------------
# Segment pieces: which slice of which view, from which rank (block independent)
# --------------------------------------------------------------------------


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
            ub = unit_bytes(ls, local.tp_size)
            lo, hi = unit_range(ls, local.tp_size, d_rank)
            needed = [(lo, hi)]
            for p in cands:
                plo, phi = unit_range(rs, remote.tp_size, p)
                rest: list[tuple[int, int]] = []
                for a, b in needed:
                    s, e = max(a, plo), min(b, phi)
                    if s >= e:
                        rest.append((a, b))
                        continue
                    out.append(
                        Piece(
                            group=gi,
                            segment=ls.name,
                            remote_rank=p,
                            local_offset=ls.offset + (s - lo) * ub,
                            remote_offset=rs.offset + (s - plo) * ub,
                            nbytes=(e - s) * ub,
                            regions=segment_regions(ls, local.num_regions),
                        )
                    )
                    if a < s:
                        rest.append((a, s))
                    if e < b:
                        rest.append((e, b))
                needed = rest
            if needed:  # pragma: no cover - impossible for layouts that pass validate()
                raise PlanError(
                    f"segment {ls.name!r}: units {needed} held by none of P ranks {cands}"
                )
    return out


# --------------------------------------------------------------------------
# Block pairing
# --------------------------------------------------------------------------


def _ids(ids: Sequence[int] | NDArray[Any], side: str, gi: int, num_blocks: int) -> I64:
    try:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as e:
        raise BlockRangeError(f"{side} group {gi}: block ids are not integers ({e})") from None
    # One C-level reduction for both bounds: a negative id is huge as unsigned.
    # (ufunc.reduce directly: ndarray.max() goes through a Python wrapper, and
    # this runs for every group of every read.)
    if arr.size and int(_umax(arr.view(np.uint64))) >= num_blocks:
        bad = int(arr[(arr < 0) | (arr >= num_blocks)][0])
        raise _out_of_range(side, gi, bad, num_blocks)
    return arr


def _out_of_range(side: str, gi: int, bad: int, num_blocks: int) -> BlockRangeError:
    return BlockRangeError(f"{side} group {gi}: block id {bad} out of range [0, {num_blocks})")


def _check_group_count(layout: Layout, block_ids: BlockIds, side: str) -> None:
    if len(block_ids) != len(layout.groups):
        raise GroupCountError(
            f"{side} block ids name {len(block_ids)} groups, the layout has {len(layout.groups)}"
        )


def validate_block_ids(layout: Layout, block_ids: BlockIds, side: str = "local") -> list[I64]:
    """Check count, range and uniqueness of one side's block ids (all groups share pages)."""
    _check_group_count(layout, block_ids, side)
    nb = layout.num_blocks
    arrs = [_ids(ids, side, gi, nb) for gi, ids in enumerate(block_ids)]
    if side == "local" and arrs:
        total = sum(a.size for a in arrs)
        if total <= _SET_CHECK_MAX:
            # A Python set: numpy's sort drops the GIL even for 16 ids, and this
            # runs on the event loop (accept) for every read, which then waits
            # for the planning or NIXL thread to hand the GIL back.
            flat = [i for a in arrs for i in a.tolist()]
            if len(set(flat)) == total:
                return arrs
            _raise_first_duplicate(flat)
        # sort + neighbours: np.unique costs 5x more
        allids = np.concatenate(arrs) if len(arrs) > 1 else arrs[0].copy()
        allids.sort()
        same = allids[1:] == allids[:-1]
        if same.size and _uany(same):
            twice = allids[1:][same]
            raise DuplicateBlockError(
                f"local block id {int(twice[0])} named twice: a page would be written twice"
            )
    return arrs


def check_block_ids(layout: Layout, block_ids: BlockIds, side: str = "local") -> None:
    """:func:`validate_block_ids` (same checks, same errors) without building
    arrays: for the event loop, which checks every read's ids on acceptance and
    has no use for the arrays. Lists of up to ``_SET_CHECK_MAX`` Python ints
    are checked in Python (``np.asarray`` of a 16-id list cost a few percent of
    the loop); anything else goes through :func:`validate_block_ids`."""
    _check_group_count(layout, block_ids, side)
    nb = layout.num_blocks
    flat: list[int] = []
    for gi, ids in enumerate(block_ids):
        if type(ids) is not list or not all(type(i) is int for i in ids):
            validate_block_ids(layout, block_ids, side)
            return
        if ids and (min(ids) < 0 or max(ids) >= nb):
            bad = next(i for i in ids if i < 0 or i >= nb)
            raise _out_of_range(side, gi, bad, nb)
        flat.extend(ids)
    if side != "local" or len(set(flat)) == len(flat):
        return
    if len(flat) > _SET_CHECK_MAX:  # the same duplicate as validate_block_ids names
        validate_block_ids(layout, block_ids, side)
        return
    _raise_first_duplicate(flat)


def _raise_first_duplicate(flat: list[int]) -> None:
    """Raise DuplicateBlockError naming the first id of ``flat`` seen twice."""
    seen: set[int] = set()
    for i in flat:
        if i in seen:
            raise DuplicateBlockError(
                f"local block id {i} named twice: a page would be written twice")
        seen.add(i)


def pair_group(
    gi: int,
    local: Layout,
    remote: Layout,
    lids: I64,
    rids: I64,
    skip_tokens: int | None,
    num_tokens: int | None = None,
) -> tuple[I64, I64]:
    """Byte offsets (within a region) of paired views: (local, remote), one entry per pair."""
    lg, rg = local.groups[gi], remote.groups[gi]
    if lids.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    if lg.kind == "mamba":
        if lids.size != rids.size:
            raise PairingError(
                f"group {gi} (mamba): {lids.size} local pages vs {rids.size} remote pages; "
                "Mamba state pairs page to page and is never trimmed"
            )
        return view_offsets(local, lg, lids), view_offsets(remote, rg, rids)
    if lg.window_tokens:
        l0, r0, n = _window_pairs(gi, lg, rg, int(lids.size), int(rids.size), num_tokens)
        lk = view_offsets(local, lg, lids)
        rk = view_offsets(remote, rg, rids)
        return lk[l0:l0 + n], rk[r0:r0 + n]
    skip_k, n = _attention_pairs(gi, lg, rg, int(lids.size), int(rids.size), skip_tokens,
                                 num_tokens)
    lk = view_offsets(local, lg, lids)
    rk = view_offsets(remote, rg, rids)
    return lk[:n], rk[skip_k : skip_k + n]


def _window_pairs(gi: int, lg: Group, rg: Group, nl: int, nr: int,
                  num_tokens: int | None) -> tuple[int, int, int]:
    """For a sliding-window group with ``nl`` local and ``nr`` remote pages
    (nl > 0), both the tails of the request's pages: (first local kernel block
    paired, first remote kernel block paired, kernel blocks paired).

    Each side's tail ends with the page holding token ``num_tokens - 1``, so
    its first kernel block is token ``(pages_spanned - n) * page_tokens``; the
    pairs are the kernel blocks both tails hold, up to the last token."""
    if num_tokens is None or num_tokens < 1:
        raise PairingError(f"group {gi} (sliding window): a read into it needs num_tokens "
                           "(its block lists are tails ending at the last token)")
    kbs = lg.block_tokens
    firsts = []
    for side, g, n in (("local", lg, nl), ("remote", rg, nr)):
        spanned = -(-num_tokens // (g.sub_blocks * kbs))
        if n > spanned:
            raise PairingError(f"group {gi} (sliding window): {n} {side} pages, but "
                               f"{num_tokens} tokens span only {spanned}")
        firsts.append((spanned - n) * g.sub_blocks)
    lfirst, rfirst = firsts
    start = max(lfirst, rfirst)
    end = min(lfirst + nl * lg.sub_blocks, rfirst + nr * rg.sub_blocks, -(-num_tokens // kbs))
    return start - lfirst, start - rfirst, max(0, end - start)


def _attention_pairs(gi: int, lg: Group, rg: Group, nl: int, nr: int,
                     skip_tokens: int | None, num_tokens: int | None) -> tuple[int, int]:
    """For an attention group with ``nl`` local and ``nr`` remote blocks (nl > 0):
    (remote kernel blocks skipped, kernel blocks paired); raises PairingError."""
    kbs = lg.block_tokens
    if skip_tokens is None:
        if lg.sub_blocks == rg.sub_blocks:
            # vLLM's "read the remote tail": the blocks D lacks are the first ones.
            skip_k = max(0, nr - nl) * rg.sub_blocks
        elif num_tokens is not None:
            # D's list is the tail of the ceil(num_tokens / D-block) blocks the prompt spans.
            total = -(-num_tokens // (lg.sub_blocks * kbs))
            skip_k = max(0, total - nl) * lg.sub_blocks
        else:
            # Block counts of the two sides cover different token spans, so no count
            # comparison can tell a prefix hit from none (stricter than LAYOUT.md 5).
            raise PairingError(
                f"group {gi}: sub_blocks differ ({lg.sub_blocks} local, {rg.sub_blocks} "
                "remote), so a prefix hit cannot be inferred from block counts; "
                "state skip_tokens or num_tokens"
            )
    else:
        logical = lg.sub_blocks * kbs
        if skip_tokens < 0 or skip_tokens % logical:
            raise PairingError(
                f"skip_tokens {skip_tokens} is not a whole number of local logical blocks "
                f"({logical} tokens)"
            )
        skip_k = skip_tokens // kbs
    lsize, rsize = nl * lg.sub_blocks, nr * rg.sub_blocks  # kernel blocks (view_offsets)
    if skip_k > rsize:
        raise PairingError(
            f"group {gi}: skip of {skip_k * kbs} tokens exceeds the {rsize * kbs} tokens "
            "the remote blocks hold"
        )
    n = min(lsize, rsize - skip_k)
    if num_tokens is not None:
        # Kernel block i starts at token (skip_k + i) * kbs; later ones hold no token.
        n = max(0, min(n, -(-num_tokens // kbs) - skip_k))
    return skip_k, n


# --------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------


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
        return int(_uadd(self.length))  # the ufunc: ndarray.sum() has a Python wrapper


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


def coalesce(region: I32, loff: I64, roff: I64, length: I64) -> tuple[I32, I64, I64, I64]:
    """Merge each descriptor into its predecessor when both sides continue it."""
    n = length.size
    if n < 2:
        return region, loff, roff, length
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    np.not_equal(loff[1:], loff[:-1] + length[:-1], out=brk[1:])
    brk[1:] |= roff[1:] != roff[:-1] + length[:-1]
    brk[1:] |= region[1:] != region[:-1]
    starts = brk.nonzero()[0]
    if starts.size == n:
        return region, loff, roff, length
    return region[starts], loff[starts], roff[starts], np.add.reduceat(length, starts)


_PieceGroup = tuple[int, I32, I64, I64, I64]  # group, regions, local/remote offset, bytes
_PIECE_CACHE_SIZE = 64
_piece_cache: collections.OrderedDict[
    tuple[int, int, int], tuple[Layout, Layout, list[tuple[int, list[_PieceGroup]]]]
] = collections.OrderedDict()


def _piece_groups(local: Layout, d_rank: int, remote: Layout
                  ) -> list[tuple[int, list[_PieceGroup]]]:
    """Per candidate P rank, :func:`segment_pieces` grouped by (group, region set)
    as arrays, in (region, pair, offset) order so neighbours are adjacent.

    It depends on the two layouts only, so it is memoised (by identity: the
    daemon keeps one Layout object per engine and per link; the entry keeps
    both alive, so an id is never reused while cached) instead of being rebuilt
    for every request, where it was a fifth of a small read's planning.
    """
    key = (id(local), d_rank, id(remote))
    hit = _piece_cache.get(key)
    if hit is not None and hit[0] is local and hit[1] is remote:
        _piece_cache.move_to_end(key)
        return hit[2]
    pieces = segment_pieces(local, d_rank, remote)
    out: list[tuple[int, list[_PieceGroup]]] = []
    for p in candidate_ranks(local.tp_size, d_rank, remote.tp_size):
        by_key: dict[tuple[int, tuple[int, ...]], list[Piece]] = {}
        for pc in pieces:
            if pc.remote_rank == p:
                by_key.setdefault((pc.group, pc.regions), []).append(pc)
        groups: list[_PieceGroup] = []
        for (gi, regions), pcs in by_key.items():
            pcs.sort(key=lambda x: x.local_offset)
            arrays = (np.asarray(regions, dtype=np.int32),
                      np.array([x.local_offset for x in pcs], dtype=np.int64),
                      np.array([x.remote_offset for x in pcs], dtype=np.int64),
                      np.array([x.nbytes for x in pcs], dtype=np.int64))
            for a in arrays:
                a.setflags(write=False)  # shared by every plan of these layouts
            groups.append((gi, *arrays))
        out.append((p, groups))
    _piece_cache[key] = (local, remote, out)
    while len(_piece_cache) > _PIECE_CACHE_SIZE:
        _piece_cache.popitem(last=False)
    return out


def _descriptors(regions: I32, lpair: I64, rpair: I64, po_l: I64, po_r: I64, po_n: I64
                 ) -> tuple[I32, I64, I64, I64]:
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
) -> ReadPlan:
    """Plan one request's reads for D rank ``d_rank``.

    ``num_tokens`` (the request's length) drops attention kernel blocks that
    start at or after it. ``check=False`` skips the compatibility check that
    the daemon already did at handshake time.
    """
    if check:
        check_compatible(local, remote)
    notify = candidate_ranks(local.tp_size, d_rank, remote.tp_size)
    lids = validate_block_ids(local, local_block_ids, "local")
    rids = validate_block_ids(remote, remote_block_ids, "remote")
    pairs = [
        pair_group(gi, local, remote, lids[gi], rids[gi], skip_tokens, num_tokens)
        for gi in range(len(local.groups))
    ]
    reads: list[RankRead] = []
    for p, groups in _piece_groups(local, d_rank, remote):
        chunks: list[tuple[I32, I64, I64, I64]] = []
        for gi, regions, po_l, po_r, po_n in groups:
            lpair, rpair = pairs[gi]
            if lpair.size:
                chunks.append(_descriptors(regions, lpair, rpair, po_l, po_r, po_n))
        if not chunks:
            continue
        if len(chunks) == 1:
            reg, lo, ro, ln = chunks[0]
        else:
            reg = np.concatenate([c[0] for c in chunks])
            lo = np.concatenate([c[1] for c in chunks])
            ro = np.concatenate([c[2] for c in chunks])
            ln = np.concatenate([c[3] for c in chunks])
        before = int(ln.size)
        reg, lo, ro, ln = coalesce(reg, lo, ro, ln)
        reads.append(RankRead(p, reg, lo, ro, ln, before))
    return ReadPlan(notify, tuple(reads))



#: one request's ids for :func:`plan_many`: local ids, remote ids, skip_tokens, num_tokens
ManyRequest = tuple[BlockIds, BlockIds, int | None, int | None]


#: per P rank, the absolute (local, remote) addresses of a plan's descriptors
Addresses = dict[int, tuple[I64, I64]]


def plan_many(local: Layout, d_rank: int, remote: Layout, requests: Sequence[ManyRequest]
              ) -> list[ReadPlan | PlanError]:
    """:func:`plan_read` (``check=False``) for several requests between the same
    two layouts: the same plans, but the descriptors of every request are built,
    ordered and coalesced in one vectorised pass per P rank instead of one per
    request (at 16 blocks a request, numpy's per-call cost, not the data, was
    most of a read's planning). A request that cannot be planned gets its
    PlanError in its place; the others are planned as usual."""
    return _plan_many(local, d_rank, remote, requests, None)[0]


def plan_many_addressed(local: Layout, d_rank: int, remote: Layout,
                        requests: Sequence[ManyRequest], local_bases: I64,
                        remote_bases: dict[int, I64]
                        ) -> list[tuple[ReadPlan, Addresses] | PlanError]:
    """:func:`plan_many`, each plan with its descriptors' absolute addresses per
    P rank (``local_bases[region] + local_offset``, and the same with P rank
    ``p``'s ``remote_bases[p]``): added once per P rank over every request's
    descriptors, not once per request (two fancy indexings and two additions
    per request and rank were a fifth of a batched read's planning)."""
    plans, addrs = _plan_many(local, d_rank, remote, requests, (local_bases, remote_bases))
    return [p if isinstance(p, PlanError) else (p, a) for p, a in zip(plans, addrs)]


def _plan_many(local: Layout, d_rank: int, remote: Layout, requests: Sequence[ManyRequest],
               bases: tuple[I64, dict[int, I64]] | None,
               ) -> tuple[list[ReadPlan | PlanError], list[Addresses]]:
    """:func:`plan_many`, with the addresses of :func:`plan_many_addressed` when
    ``bases`` (local, per P rank remote) are given (else every dict is empty)."""
    addrs: list[Addresses] = [{} for _ in requests]
    notify = candidate_ranks(local.tp_size, d_rank, remote.tp_size)
    ngroups = len(local.groups)
    out: list[ReadPlan | PlanError] = [ReadPlan(notify, ())] * len(requests)
    ok = list(range(len(requests)))  # the requests that pair
    # per group: every ok request's paired views (local, remote), and how many each
    paired = _attention_pairs_many(local, remote, requests)
    if paired is None:  # not all attention, or some request fails a check: one by one
        ok, pairs = [], []
        for r, (lb, rb, skip, num) in enumerate(requests):
            try:
                lids = validate_block_ids(local, lb, "local")
                rids = validate_block_ids(remote, rb, "remote")
                pairs.append([pair_group(gi, local, remote, lids[gi], rids[gi], skip, num)
                              for gi in range(ngroups)])
            except PlanError as e:
                out[r] = e
                continue
            ok.append(r)
        if not ok:
            return out, addrs
        paired = []
        for gi in range(ngroups):
            lps = [pr[gi][0] for pr in pairs]
            paired.append((np.concatenate(lps), np.concatenate([pr[gi][1] for pr in pairs]),
                           np.fromiter((a.size for a in lps), np.int64, len(lps))))
    if not ok:
        return out, addrs
    oks = np.asarray(ok, np.int64)
    reads: list[list[RankRead]] = [[] for _ in requests]
    for p, groups in _piece_groups(local, d_rank, remote):
        chunks: list[tuple[I32, I64, I64, I64, I64]] = []
        for gi, regions, po_l, po_r, po_n in groups:
            lpair, rpair, counts = paired[gi]
            if not lpair.size:
                continue
            reg, lo, ro, ln = _descriptors(regions, lpair, rpair, po_l, po_r, po_n)
            # the request of each descriptor (region x pair x piece, as _descriptors)
            owner = np.empty((regions.size, lpair.size, po_n.size), np.int64)
            owner[...] = np.repeat(oks, counts)[None, :, None]
            chunks.append((reg, lo, ro, ln, owner.reshape(-1)))
        if not chunks:
            continue
        reg = np.concatenate([c[0] for c in chunks])
        lo = np.concatenate([c[1] for c in chunks])
        ro = np.concatenate([c[2] for c in chunks])
        ln = np.concatenate([c[3] for c in chunks])
        owner = np.concatenate([c[4] for c in chunks])
        # Request-major and, within a request, the order plan_read builds (group
        # by group, each in region, pair, piece order): a stable sort by request.
        order = np.argsort(owner, kind="stable")
        reg, lo, ro, ln, owner = reg[order], lo[order], ro[order], ln[order], owner[order]
        before = np.bincount(owner, minlength=len(requests)).tolist()
        # coalesce (as coalesce() does), never across two requests
        brk = np.empty(ln.size, dtype=bool)
        brk[0] = True
        np.not_equal(lo[1:], lo[:-1] + ln[:-1], out=brk[1:])
        brk[1:] |= ro[1:] != ro[:-1] + ln[:-1]
        brk[1:] |= reg[1:] != reg[:-1]
        brk[1:] |= owner[1:] != owner[:-1]
        starts = brk.nonzero()[0]
        reg, lo, ro, owner = reg[starts], lo[starts], ro[starts], owner[starts]
        ln = np.add.reduceat(ln, starts)
        bounds = np.searchsorted(owner, np.arange(len(requests) + 1)).tolist()
        if bases is not None:
            la, ra = bases[0][reg] + lo, bases[1][p][reg] + ro
        for r in ok:
            if before[r]:
                a, b = bounds[r], bounds[r + 1]
                reads[r].append(RankRead(p, reg[a:b], lo[a:b], ro[a:b], ln[a:b], before[r]))
                if bases is not None:
                    addrs[r][p] = (la[a:b], ra[a:b])
    for r in ok:
        out[r] = ReadPlan(notify, tuple(reads[r]))
    return out, addrs


def _attention_pairs_many(local: Layout, remote: Layout, requests: Sequence[ManyRequest]
                          ) -> list[tuple[I64, I64, I64]] | None:
    """What :func:`pair_group` gives every request, per group, for requests whose
    groups are all attention and whose ids are plain lists: the ids of all
    requests are checked and turned into views in one pass per group. Per
    group: the paired local and remote views of every request in turn, and how
    many each has. None when that is not the case or when any request fails a
    check (the caller then plans one by one and so names the request)."""
    ngroups = len(local.groups)
    nreq = len(requests)
    if nreq < 2 or any(g.kind != "attention" or g.window_tokens
                       for g in (*local.groups, *remote.groups)):
        return None  # Mamba and sliding-window groups pair one request at a time
    for lb, rb, _, _ in requests:
        if (type(lb) is not list or type(rb) is not list or len(lb) != ngroups
                or len(rb) != ngroups):
            return None
        if ngroups == 1:  # the usual case, without two generators per request
            if type(lb[0]) is not list or type(rb[0]) is not list:
                return None
        elif any(type(ids) is not list for ids in lb) or any(type(ids) is not list for ids in rb):
            return None
    chain = itertools.chain.from_iterable
    out: list[tuple[I64, I64, I64]] = []
    owners: list[I64] = []
    lall: list[I64] = []
    req_idx = np.arange(nreq, dtype=np.int64)
    for gi in range(ngroups):
        lg, rg = local.groups[gi], remote.groups[gi]
        nl = [len(lb[gi]) for lb, _, _, _ in requests]
        nr = [len(rb[gi]) for _, rb, _, _ in requests]
        try:
            lids = np.fromiter(chain(lb[gi] for lb, _, _, _ in requests), np.int64, sum(nl))
            rids = np.fromiter(chain(rb[gi] for _, rb, _, _ in requests), np.int64, sum(nr))
        except (TypeError, ValueError, OverflowError):
            return None
        if (lids.size and int(_umax(lids.view(np.uint64))) >= local.num_blocks) or (
                rids.size and int(_umax(rids.view(np.uint64))) >= remote.num_blocks):
            return None
        lall.append(lids)
        owners.append(np.repeat(req_idx, nl))
        skips: list[int] = []
        counts: list[int] = []
        try:
            for (_, _, skip, num), a, b in zip(requests, nl, nr):
                k, n = _attention_pairs(gi, lg, rg, a, b, skip, num) if a else (0, 0)
                skips.append(k)
                counts.append(n)
        except PlanError:
            return None
        cnt = np.asarray(counts, np.int64)
        total = int(_uadd(cnt))
        # request r pairs local views [lstart_r, +n_r) with remote [rstart_r + skip_r, +n_r)
        lstart = np.zeros(nreq, np.int64)
        np.cumsum(np.asarray(nl[:-1], np.int64) * lg.sub_blocks, out=lstart[1:])
        rstart = np.zeros(nreq, np.int64)
        np.cumsum(np.asarray(nr[:-1], np.int64) * rg.sub_blocks, out=rstart[1:])
        first = np.zeros(nreq, np.int64)
        np.cumsum(cnt[:-1], out=first[1:])
        within = np.arange(total, dtype=np.int64) - np.repeat(first, cnt)
        lk = view_offsets(local, lg, lids)
        rk = view_offsets(remote, rg, rids)
        out.append((lk[np.repeat(lstart, cnt) + within],
                    rk[np.repeat(rstart + np.asarray(skips, np.int64), cnt) + within], cnt))
    # a local page named twice within one request (every group shares the pages)
    ids = np.concatenate(lall) if ngroups > 1 else lall[0]
    own = np.concatenate(owners) if ngroups > 1 else owners[0]
    if ids.size > 1:
        order = np.lexsort((ids, own))
        ids, own = ids[order], own[order]
        if _uany((ids[1:] == ids[:-1]) & (own[1:] == own[:-1])):
            return None
    return out
