"""Staging memory of one engine rank, and the local scatter out of it.

The thin I/O side of :mod:`~kvsidecar.daemon.staging_plan`: a bounded pool of
sidecar-owned host memory (anonymous ``mmap``, page aligned), mapped, faulted
in and registered with the engine rank's NIXL worker in the background as soon
as the engine rank registers, carved into areas first-fit, one area per staged
transfer.

Why at registration and not at the first staged read: faulting in 256 MiB
takes 0.2-0.7 s of CPU on the 2-core host. Done lazily it landed exactly on
the first burst of reads: they could not stage yet (the pool was not ready)
and paid for the mapping's CPU on top (hetero 2→1, 8 requests: 494 ms with
nothing staged against 314 ms with staging off). Registering the memory with
NIXL itself costs about 1 ms.

Safety rules (the read path in :mod:`~kvsidecar.daemon.d_side` keeps them):

- a staged READ lands only in its area; engine blocks are written by
  :func:`scatter` only after every transfer of the read finished DONE and the
  lease check passed, so a failed staged read never writes engine memory;
- an area goes back to the pool when its transfer ended: DONE, or failed
  (the worker reports a failure only after destroying the agent that carried
  it, so nothing writes there any more). An area whose outcome is unknown
  (the awaiting task was cancelled) is quarantined until the generation of
  the worker (lane) that carried its transfer moves on (an agent reset kills
  every transfer of the old agent; other lanes' resets prove nothing about it);
- a read that finds no room is posted scattered, counted, never refused.

GPU (VRAM) engines never stage: this module is for host DRAM only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided
from numpy.typing import NDArray

from kvsidecar.daemon.transport.worker import NixlWorker

log = logging.getLogger(__name__)

I64 = NDArray[np.int64]
U8 = NDArray[np.uint8]

#: pieces per (region, length) group below which a plain loop of slice copies is used
_MIN_VECTOR = 16
#: fewest pieces in a run worth one strided copy
_MIN_RUN = 4
#: smallest row (bytes) worth a fancy-indexed copy, and most rows per piece
_MIN_ROW = 256
_MAX_ROWS = 64


@dataclass(frozen=True)
class Area:
    offset: int
    nbytes: int
    address: int


class Extents:
    """First-fit allocator over ``[0, capacity)`` with coalescing frees (pure)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity > 0 else []
        self.used = 0

    def take(self, nbytes: int) -> int | None:
        for i, (off, size) in enumerate(self._free):
            if size >= nbytes:
                if size == nbytes:
                    del self._free[i]
                else:
                    self._free[i] = (off + nbytes, size - nbytes)
                self.used += nbytes
                return off
        return None

    def give(self, off: int, nbytes: int) -> None:
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < off:
            i += 1
        if (i and free[i - 1][0] + free[i - 1][1] > off) or (
                i < len(free) and off + nbytes > free[i][0]):
            raise ValueError(f"extent [{off}, {off + nbytes}) overlaps a free extent")
        free.insert(i, (off, nbytes))
        if i + 1 < len(free) and off + nbytes == free[i + 1][0]:
            free[i] = (off, nbytes + free[i + 1][1])
            del free[i + 1]
        if i and free[i - 1][0] + free[i - 1][1] == off:
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            del free[i]
        self.used -= nbytes


def _populated(nbytes: int) -> mmap.mmap:
    """Anonymous private memory with every page faulted in (MAP_POPULATE)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, nbytes, flags=flags)


class StagingPool:
    """Bounded staging memory for one engine rank's staged reads.

    ``on_change(in_use, quarantined)`` is told the byte counts after every
    change, ``on_mapped(nbytes)`` the bytes mapped and registered once the pool
    is ready (the owner sets its gauges).
    """

    def __init__(self, capacity: int, worker: NixlWorker,
                 on_change: Callable[[int, int], None] | None = None,
                 on_mapped: Callable[[int], None] | None = None,
                 lanes: Sequence[NixlWorker] = ()) -> None:
        self.capacity = capacity
        self._worker = worker
        #: every worker a staged read may be posted on (lane 0, ``worker``, first):
        #: the pool is registered in each
        self._lanes = list(lanes) or [worker]
        self._on_change = on_change
        self._on_mapped = on_mapped
        self._closed = False
        self._extents = Extents(capacity)
        self._quarantine: list[tuple[Area, int, int]] = []  # (area, generation, lane)
        self._mm: mmap.mmap | None = None
        self._view: U8 | None = None
        self._base = 0
        self._ready: asyncio.Future[bool] | None = None
        self._task: asyncio.Future[bool] | None = None

    @property
    def ready(self) -> bool:
        return self._view is not None

    @property
    def failed(self) -> bool:
        """Mapping or registering failed (it is not tried again)."""
        r = self._ready
        return r is not None and r.done() and not r.result()

    def prepare(self) -> None:
        """Start mapping and registering in the background (once; the owner calls
        this when the engine rank registers, so reads find the pool ready)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self.ensure())

    async def ensure(self) -> bool:
        """Map and register the pool once; False if it cannot be (reads then post
        scattered)."""
        if self._ready is None:
            self._ready = asyncio.get_running_loop().create_future()
            ok = False
            done: list[tuple[NixlWorker, int]] = []  # lanes registered in so far
            try:
                # Faulted in up front, off the loop: a READ into fresh pages pays a page
                # fault per 4 KiB inside the transfer (touching 256 MiB: 0.7 s here).
                mm = await asyncio.get_running_loop().run_in_executor(None, _populated,
                                                                      self.capacity)
                view = np.frombuffer(mm, dtype=np.uint8)
                base = int(view.ctypes.data)
                for lane in self._lanes:
                    if not self._closed:
                        done.append((lane, await lane.register([(base, self.capacity)],
                                                               "DRAM", 0)))
                if self._closed:  # the engine left meanwhile: its worker is gone
                    del view
                    mm.close()
                else:
                    self._mm, self._view, self._base, ok = mm, view, base, True
                    if self._on_mapped is not None:
                        self._on_mapped(self.capacity)
            except Exception as e:
                # Registered in some lanes, not all: those registrations go now,
                # while the memory is still mapped. Left there, they outlived the
                # mapping, and a lane's reset registered the unmapped range again.
                for lane, reg_id in done:
                    with contextlib.suppress(Exception):
                        await lane.deregister(reg_id)
                log.warning("staging pool of %d bytes unavailable (%s); reads post scattered "
                            "descriptors", self.capacity, e)
            self._ready.set_result(ok)
        return await asyncio.shield(self._ready)

    @property
    def in_use(self) -> int:
        return self._extents.used

    @property
    def quarantined(self) -> int:
        return sum(a.nbytes for a, _, _ in self._quarantine)

    @staticmethod
    def rounded(nbytes: int) -> int:
        """What an area of ``nbytes`` takes of the pool: whole pages."""
        return math.ceil(nbytes / mmap.PAGESIZE) * mmap.PAGESIZE

    def fits(self, nbytes: int) -> bool:
        """Whether an area of ``nbytes`` could ever be had (the pool empty)."""
        return self.rounded(nbytes) <= self.capacity

    def acquire(self, nbytes: int) -> Area | None:
        """An area of ``nbytes`` (rounded to pages), or None when the pool has no room."""
        if self._view is None or nbytes <= 0:
            return None
        self._reclaim()
        size = self.rounded(nbytes)
        off = self._extents.take(size)
        if off is None:
            return None
        self._changed()
        return Area(off, size, self._base + off)

    def release(self, area: Area) -> None:
        """Its transfer ended (DONE, or failed and reported dead by the worker)."""
        self._extents.give(area.offset, area.nbytes)
        self._changed()

    def quarantine(self, area: Area, generation: int, lane: int = 0) -> None:
        """Outcome unknown: keep it until the agent generation of lane ``lane`` (the
        worker its transfer was posted on) passes ``generation``."""
        self._quarantine.append((area, generation, lane))
        self._changed()

    def view(self, area: Area) -> U8:
        assert self._view is not None
        return self._view[area.offset:area.offset + area.nbytes]

    def close(self) -> None:
        """Unmap; only after the worker stopped (its agent, and every transfer, is gone).
        A preparation still under way unmaps what it mapped when it sees this."""
        self._closed = True
        self._view = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a scatter's view is still referenced; GC unmaps it
                log.debug("staging pool still referenced at close")
            self._mm = None

    def _reclaim(self) -> None:
        keep = []
        for area, g, lane in self._quarantine:
            if self._lanes[lane].generation > g:
                self._extents.give(area.offset, area.nbytes)
            else:
                keep.append((area, g, lane))
        if len(keep) != len(self._quarantine):
            self._quarantine = keep
            self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.in_use - self.quarantined, self.quarantined)


def strided_runs(s_off: I64, d_off: I64, length: int, min_run: int) -> tuple[I64, I64]:
    """Runs of pieces (indices ``[start, stop)`` into the arrays as given) whose
    source and destination offsets both advance by one constant step, the
    destination's at least ``length`` (pieces never overlap there) and the
    source's positive: each run is one strided copy. Runs shorter than
    ``min_run`` pieces are not returned; a piece belongs to at most one run.

    Pure and vectorised (no loop over pieces): the scatter of a staged hetero
    read is tens of thousands of pieces, most of them in such runs (one
    segment's pieces of consecutive pages).
    """
    n = s_off.size
    empty = np.empty(0, np.int64)
    if n < max(2, min_run):
        return empty, empty
    ds, dd = np.diff(s_off), np.diff(d_off)
    # link i joins piece i and i + 1; maximal stretches of equal links
    brk = np.flatnonzero((ds[1:] != ds[:-1]) | (dd[1:] != dd[:-1])) + 1
    a = np.concatenate(([0], brk)).astype(np.int64)          # first link of each stretch
    b = np.concatenate((brk, [n - 1])).astype(np.int64)      # one past its last link
    ok = (ds[a] > 0) & (dd[a] >= length) & (b - a + 1 >= min_run)
    # a stretch's first piece is the previous stretch's last: the earlier one keeps it
    prev_ok = np.concatenate(([False], ok[:-1]))
    start = a + prev_ok
    stop = b + 1
    keep = ok & (stop - start >= min_run)
    return start[keep], stop[keep]


def _strided_copy(src: U8, s0: int, s_step: int, dst: U8, d0: int, d_step: int,
                  count: int, length: int) -> None:
    """``dst[d0 + i*d_step:][:length] = src[s0 + i*s_step:][:length]`` for ``i < count``,
    as one numpy copy over strided views (no temporary, no index arrays)."""
    if (s0 < 0 or d0 < 0 or s0 + (count - 1) * s_step + length > src.size
            or d0 + (count - 1) * d_step + length > dst.size):
        raise ValueError(f"strided copy of {count} x {length} bytes out of bounds")
    sv = as_strided(src[s0:], shape=(count, length), strides=(s_step, 1), writeable=False)
    dv = as_strided(dst[d0:], shape=(count, length), strides=(d_step, 1))
    np.copyto(dv, sv)


def scatter(area: U8, src: I64, dst: I64, size: I64, bases: I64, views: list[U8]) -> int:
    """Copy piece ``j`` (``size[j]`` bytes at ``area[src[j]:]``) to engine address
    ``dst[j]``, which lies in region ``i`` at ``bases[i]`` (viewed by ``views[i]``).

    Per (region, length) group, in source order: runs of pieces at constant
    source and destination steps go as one strided copy each (no temporary;
    numpy releases the GIL for it); the rest as one fancy-indexed row copy
    when their offsets share a row size ``g`` (the gcd), otherwise as a loop
    of slice copies. Returns how many vectorised copies (strided runs and
    fancy-indexed groups) it made, for tests and benchmarks.
    """
    order = np.argsort(bases)
    sb = bases[order]
    region = order[np.searchsorted(sb, dst, side="right") - 1]
    off = dst - bases[region]
    vectorised = 0
    keys = np.lexsort((src, size, region))
    r_s, l_s = region[keys], size[keys]
    cut = np.flatnonzero((np.diff(r_s) != 0) | (np.diff(l_s) != 0)) + 1
    for grp in np.split(keys, cut):
        reg = int(region[grp[0]])
        length = int(size[grp[0]])
        dview = views[reg]
        s_off, d_off = src[grp], off[grp]
        if grp.size >= _MIN_RUN:
            starts, stops = strided_runs(s_off, d_off, length, _MIN_RUN)
            if starts.size:
                left = np.ones(grp.size, bool)
                for a, b in zip(starts.tolist(), stops.tolist()):
                    s0, d0 = int(s_off[a]), int(d_off[a])
                    _strided_copy(area, s0, int(s_off[a + 1]) - s0, dview, d0,
                                  int(d_off[a + 1]) - d0, b - a, length)
                    left[a:b] = False
                vectorised += starts.size
                s_off, d_off = s_off[left], d_off[left]
        if s_off.size >= _MIN_VECTOR:
            g = int(np.gcd.reduce(np.concatenate((s_off, d_off, [length]))))
            rows = length // g
            if g >= _MIN_ROW and rows <= _MAX_ROWS:
                s2 = area[:area.size // g * g].reshape(-1, g)
                d2 = dview[:dview.size // g * g].reshape(-1, g)
                if rows == 1:
                    d2[d_off // g] = s2[s_off // g]
                else:
                    k = np.arange(rows)
                    d2[(d_off // g)[:, None] + k] = s2[(s_off // g)[:, None] + k]
                vectorised += 1
                continue
        for s, d in zip(s_off.tolist(), d_off.tolist()):
            dview[d:d + length] = area[s:s + length]
    return vectorised
