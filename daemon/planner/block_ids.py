"""Whether a request's block ids name pages the planner may touch: one validation.

One side's block ids are a list per KV-cache group of the layout. They are
valid when

- there is one list per group (:class:`GroupCountError`),
- every id is an integer in ``[0, num_blocks)`` of that side
  (:class:`BlockRangeError`, naming the first bad id), and
- on the local side, no id appears twice across all groups, since all groups
  share the pages and a page would be written twice
  (:class:`DuplicateBlockError`).

:func:`check_block_ids` is that validation; :func:`validate_block_ids` is the
same, returning the ids as arrays (the planner's input). Ids are whatever
``np.asarray(ids, dtype=np.int64)`` accepts; the rules run on Python ints
(for a plain list of ints, with no numpy call at all), because the event loop
checks every read's ids on acceptance: a numpy call costs a microsecond even
on one id, and numpy's sort drops the GIL even for 16 ids, which makes the loop
wait for the planning or NIXL thread to hand it back.
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
FIRST_NAMED_MAX = 512  # a duplicate among up to this many ids is named by order, else by value


def check_block_ids(layout: Layout, block_ids: BlockIds, side: str = "local") -> None:
    """Check count, range and uniqueness of one side's block ids (all groups share
    pages): raise the PlanError of the first rule they break."""
    if len(block_ids) != len(layout.groups):
        raise GroupCountError(
            f"{side} block ids name {len(block_ids)} groups, the layout has {len(layout.groups)}"
        )
    nb = layout.num_blocks
    flat: list[int] = []
    for gi, ids in enumerate(block_ids):
        ints = _ints(ids, side, gi)
        if ints and (min(ints) < 0 or max(ints) >= nb):
            _as_int64(ids, side, gi)  # raises first if some id does not fit int64
            bad = next(i for i in ints if i < 0 or i >= nb)
            raise BlockRangeError(f"{side} group {gi}: block id {bad} out of range [0, {nb})")
        flat += ints
    if side == "local" and len(set(flat)) != len(flat):
        raise DuplicateBlockError(
            f"local block id {_named_twice(flat)} named twice: a page would be written twice")


def validate_block_ids(layout: Layout, block_ids: BlockIds, side: str = "local") -> list[I64]:
    """:func:`check_block_ids`, then the ids as one int64 array per group."""
    check_block_ids(layout, block_ids, side)
    out = []
    for ids in block_ids:
        arr = np.asarray(ids, dtype=np.int64)
        out.append(arr if arr.ndim == 1 else arr.reshape(-1))
    return out


def _ints(ids: Sequence[int] | NDArray[Any], side: str, gi: int) -> list[int]:
    """Group ``gi``'s ids as Python ints (a plain list of ints as it is)."""
    if type(ids) is list and set(map(type, ids)) <= _INT:  # C-level, unlike all(...)
        return ids
    out: list[int] = _as_int64(ids, side, gi).reshape(-1).tolist()
    return out


def _as_int64(ids: Sequence[int] | NDArray[Any], side: str, gi: int) -> I64:
    try:
        return np.asarray(ids, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise BlockRangeError(f"{side} group {gi}: block ids are not integers ({e})") from None


def _named_twice(flat: list[int]) -> int:
    """The id of ``flat`` an error names as named twice: the first seen twice
    (up to ``FIRST_NAMED_MAX`` ids), else the smallest repeated."""
    seen: set[int] = set()
    twice: list[int] = []
    for i in flat:
        if i in seen:
            if len(flat) <= FIRST_NAMED_MAX:
                return i
            twice.append(i)
        seen.add(i)
    return min(twice)


def in_range(arr: I64, num_blocks: int) -> bool:
    """Whether every id of ``arr`` lies in ``[0, num_blocks)``: the range rule
    over many requests' ids at once (one C reduction: a negative id is huge as
    unsigned)."""
    return not arr.size or int(umax(arr.view(np.uint64))) < num_blocks


def repeated_within(ids: I64, owners: I64) -> bool:
    """Whether some id appears twice with the same owner: the uniqueness rule
    over many requests' local ids at once, ``owners`` naming the request of each."""
    if ids.size < 2:
        return False
    order = np.lexsort((ids, owners))
    ids, owners = ids[order], owners[order]
    return bool(uany((ids[1:] == ids[:-1]) & (owners[1:] == owners[:-1])))
