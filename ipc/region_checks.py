"""Vectorised checks on a peer's region numbers: pure functions over numpy arrays.

A peer's handshake names up to ``MAX_REGIONS`` (65,536) region indices per
segment and as many base addresses. Checking them one Python iteration at a
time cost ~50 ms per handshake at that size (docs/performance.md, "A
handshake's checks"); these functions answer the same questions in a few
sorts. Each returns the value (or position) the one-at-a-time loop it
replaces would have reported first, so the callers' errors name exactly what
they named before: :func:`kvsidecar.ipc.layout.validate` and
:func:`kvsidecar.daemon.peers.messages.check_bases`. No I/O, no state.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

__all__ = ["as_int64", "extremes", "first_close_pair", "first_outside", "first_repeat",
           "first_shared_overlap"]


def as_int64(values: Sequence[int]) -> NDArray[np.int64] | None:
    """``values`` as an int64 array, or None when one of them does not fit."""
    try:
        return np.fromiter(values, dtype=np.int64, count=len(values))
    except OverflowError:
        return None


def first_repeat(arr: NDArray[np.int64]) -> int | None:
    """The first value of ``arr`` (in order) equal to one before it, or None.

    Values are >= 0 (region indices, checked in range first): one count per
    value says whether any repeats; only then one stable sort finds the
    earliest position that is not its value's first occurrence."""
    if arr.size < 2 or int(np.bincount(arr).max()) < 2:
        return None
    _, firsts = np.unique(arr, return_index=True)  # first occurrences (a stable sort)
    repeat = np.ones(arr.size, dtype=bool)
    repeat[firsts] = False
    return int(arr[int(np.argmax(repeat))])


def first_shared_overlap(spans: Sequence[tuple[NDArray[np.int64], int, int]]) -> int | None:
    """The lowest region in which two spans overlap, or None.

    Span ``(regions, begin, end)`` is ``[begin, end)`` (not empty) in each of
    ``regions`` (distinct indices); all numbers fit int64. Every (region,
    begin, end) is sorted once and neighbours in one region compared: what
    sorting each region's spans and comparing neighbours finds (a span that
    overlaps a later-starting one overlaps the next one to start)."""
    if len(spans) < 2:
        return None
    counts = [len(r) for r, _, _ in spans]
    where = np.concatenate([r for r, _, _ in spans])
    b = np.repeat(np.array([b for _, b, _ in spans], dtype=np.int64), counts)
    e = np.repeat(np.array([e for _, _, e in spans], dtype=np.int64), counts)
    order = np.lexsort((e, b, where))
    where, b, e = where[order], b[order], e[order]
    clash = (where[1:] == where[:-1]) & (b[1:] < e[:-1])
    if not clash.any():
        return None
    return int(where[int(np.argmax(clash))])


def extremes(arr: NDArray[np.int64]) -> tuple[int, int]:
    """``(min, max)`` of a non-empty ``arr``, as Python ints."""
    return int(arr.min()), int(arr.max())


def first_outside(arr: NDArray[np.int64], above: int, at_most: int) -> int | None:
    """The position of the first value not in ``(above, at_most]``, or None."""
    if at_most <= above:
        return 0 if arr.size else None
    bad = (arr <= above) | (arr > at_most)
    return int(np.argmax(bad)) if bad.any() else None


def first_close_pair(arr: NDArray[np.int64], gap: int) -> tuple[int, int] | None:
    """The first neighbours ``(lo, hi)`` of sorted ``arr`` with ``hi - lo < gap``,
    or None. Values are positive int64 (``hi - lo`` cannot overflow)."""
    if arr.size < 2:
        return None
    ordered = np.sort(arr)
    close = (ordered[1:] - ordered[:-1]) < gap
    if not close.any():
        return None
    i = int(np.argmax(close))
    return int(ordered[i]), int(ordered[i + 1])
