"""Whether a request's block ids name pages the planner may touch: one validation.

One side's block ids are a list per KV-cache group of the layout. They are
valid when

- there is one list per group (:class:`GroupCountError`),
- every id is an integer in ``[0, num_blocks)`` of that side
  (:class:`BlockRangeError`, naming the first bad id), and
- on the local side, no id appears twice across all groups, since all groups
  share the pages and a page would be written twice
  (:class:`DuplicateBlockError`); the same on the held side (a P engine's
  ``hold``): a page is held once, so a hold names at most ``num_blocks`` ids
  and keeps no more for its life. Remote ids (a read's ``remote_block_ids``)
  may repeat for the planner; a read's acceptance asks for them unique too
  (they are what P held).

:func:`check_block_ids` is that validation; :func:`validate_block_ids` is the
same, returning the ids as arrays (the planner's input). Ids are whatever
``np.asarray(ids, dtype=np.int64)`` accepts. A plain list of a few ints is
checked as it is, with no numpy call: the event loop checks every read's ids
on acceptance, a numpy call costs a microsecond even on one id, and numpy's
sort drops the GIL even for 16 ids, which makes the loop wait for the
planning or NIXL thread to hand it back. Anything else is checked as int64
arrays, which many ids reach faster.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvsidecar.daemon.planner.arrays import I64, uany, umax
from kvsidecar.daemon.planner.errors import BlockRangeError, DuplicateBlockError, GroupCountError
from kvsidecar.ipc.layout import Layout

#: one side's block ids: one list (or integer array) per group of its layout
BlockIds = Sequence[Sequence[int] | NDArray[np.integer]]

_INT = {int}
FEW = 512  # up to this many ids, checked as Python ints (a duplicate: the first seen twice)


def check_block_ids(layout: Layout, block_ids: BlockIds, side: str = "local", *,
                    unique: bool | None = None, num_blocks: int | None = None) -> None:
    """Check count, range and uniqueness of one side's block ids (all groups share
    pages): raise the PlanError of the first rule they break.

    ``unique`` (default: every side but ``"remote"``) asks that no id appear
    twice across all groups; ``num_blocks`` replaces the layout's (a remote
    side whose layout is not known yet: its group count is the local one's)."""
    _checked(layout, block_ids, side, side != "remote" if unique is None else unique,
             layout.num_blocks if num_blocks is None else num_blocks)


def validate_block_ids(layout: Layout, block_ids: BlockIds, side: str = "local") -> list[I64]:
    """:func:`check_block_ids`, returning the ids as one int64 array per group."""
    return [np.asarray(g, np.int64) if isinstance(g, list) else g
            for g in _checked(layout, block_ids, side, side != "remote", layout.num_blocks)]


def _checked(layout: Layout, block_ids: BlockIds, side: str, unique: bool,
             nb: int) -> list[list[int] | I64]:
    """The validation: each group's ids as it checked them (a plain list of a few
    ints as it is, else a flat int64 array)."""
    if len(block_ids) != len(layout.groups):
        raise GroupCountError(
            f"{side} block ids name {len(block_ids)} groups, the layout has {len(layout.groups)}"
        )
    groups: list[list[int] | I64] = []
    for gi, ids in enumerate(block_ids):
        g = _ids(ids, side, gi)
        if not in_range(g, nb):
            _as_int64(ids, side, gi)  # an id beyond int64 is no integer id: that error first
            bad = next(i for i in _as_list(g) if i < 0 or i >= nb)
            raise BlockRangeError(f"{side} group {gi}: block id {bad} out of range [0, {nb})")
        groups.append(g)
    if unique:
        twice = _named_twice(groups)
        if twice is not None:
            raise DuplicateBlockError(f"{side} block id {twice} named twice: {_ONCE[side]}")
    return groups


_ONCE = {"local": "a page would be written twice",
         "held": "a hold names each page once",
         "remote": "a hold names each page once, so a read does too"}


def _ids(ids: Sequence[int] | NDArray[Any], side: str, gi: int) -> list[int] | I64:
    if type(ids) is list and len(ids) <= FEW and set(map(type, ids)) <= _INT:  # C-level
        return ids
    arr = _as_int64(ids, side, gi)
    return arr if arr.ndim == 1 else arr.reshape(-1)


def _as_int64(ids: Sequence[int] | NDArray[Any], side: str, gi: int) -> I64:
    try:
        return np.asarray(ids, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise BlockRangeError(f"{side} group {gi}: block ids are not integers ({e})") from None


def _as_list(g: list[int] | I64) -> list[int]:
    out: list[int] = g if isinstance(g, list) else g.tolist()
    return out


def _named_twice(groups: list[list[int] | I64]) -> int | None:
    """An id named twice across all groups, or None: among ``FEW`` ids or fewer
    the first seen twice, among more the smallest (sorted: np.unique costs 5x more)."""
    total = sum(map(len, groups))
    if total <= FEW:
        flat: list[int] = []
        for g in groups:
            flat += _as_list(g)
        if len(set(flat)) == total:
            return None
        seen: set[int] = set()
        for i in flat:
            if i in seen:
                return i
            seen.add(i)
    allids = np.concatenate([np.asarray(g, np.int64) for g in groups])
    allids.sort()
    same = allids[1:] == allids[:-1]
    return int(allids[1:][same][0]) if same.size and uany(same) else None


def in_range(ids: list[int] | I64, num_blocks: int) -> bool:
    """Whether every id lies in ``[0, num_blocks)``; for an array, one C reduction
    (a negative id is huge as unsigned)."""
    if isinstance(ids, list):
        return not ids or (min(ids) >= 0 and max(ids) < num_blocks)
    return not ids.size or int(umax(ids.view(np.uint64))) < num_blocks


def repeated_within(ids: I64, owners: I64) -> bool:
    """Whether some id appears twice with the same owner: the uniqueness rule
    over many requests' local ids at once, ``owners`` naming the request of each."""
    if ids.size < 2:
        return False
    order = np.lexsort((ids, owners))
    ids, owners = ids[order], owners[order]
    return bool(uany((ids[1:] == ids[:-1]) & (owners[1:] == owners[:-1])))
