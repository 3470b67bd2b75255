"""Descriptor economy: post scattered descriptors, or read whole remote runs into staging.

Pure plan math for one P rank's post (no I/O). NIXL over UCX costs a few
microseconds per descriptor whatever its size, so a post of thousands of
2 KiB pieces spends most of its time on descriptors, not bytes. The other way
is to read each *remote run* (neighbouring pieces, with the small gaps
between them) as one descriptor into sidecar-owned staging memory, then copy
every piece from staging into the engine's blocks: more bytes on the wire,
one extra local copy, far fewer descriptors.

:func:`plan_staging` decides per post with :class:`CostModel` and returns
either ``None`` (post the scattered descriptors as they are) or a
:class:`StagedPlan`: what to post (runs into staging, plus pieces that make a
run alone and gain nothing from staging, read directly) and the scatter list
(staging offset -> engine address, length).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

I64 = NDArray[np.int64]

#: staging offsets of runs keep the remote address modulo this (row-view friendly copies)
ALIGN = 4096

MODES = ("off", "auto", "always")

#: ``auto`` stages a post only if its runs carry at most this share of bytes
#: beyond the post's own (the gaps between its pieces: other ranks' heads). Why:
#: measured on the hetero demo (docs/performance.md), staging whose runs carry no
#: foreign bytes (2→1: wire = delivered) won 1.6x, while staging 1→2 (the runs
#: carry the other D rank's halves too: wire 1.36-1.66x delivered) used as much
#: D CPU as posting scattered (49.5 vs 51.8 ms in one quick run) and took
#: 0.53-2.48x its wall time (median 1.07, 3 full and 8 quick runs), although the
#: model gave it 0.65-0.86 of the scattered cost. The model prices a post on one thread; on
#: this host the staged path's extra bytes and the scatter run beside the other
#: D rank's work on the same two cores, so they cost more than it says.
MAX_WIRE_OVERHEAD = 0.25


@dataclass(frozen=True)
class CostModel:
    """Seconds a post costs, from four constants measured on the 2-core CPU host
    (UCX over CMA, host DRAM; ``benchmarks/suite.py`` bench_staging and the
    quiet baseline of 2026-11-23, /tmp/RESULTS-quiet-baseline.md at 040739b).

    - ``desc_s``: one scattered descriptor. bench_staging: 28.2 ms for 8,192
      descriptors of 2 KiB minus 4.1 ms of wire time -> 2.9 us; 9.3 ms for 2,048
      of 8 KiB -> 2.6 us; the hetero baseline's raw NIXL posting 29,440
      descriptors: 5.5 us (load 3.5: 5.3 us). 3 us is the low end (staging must
      win on its merit).
    - ``wire_bps``: one READ of a 32 MiB run in 8.2 ms -> 4.1 GB/s.
    - ``piece_s`` and ``copy_bps``: the daemon's own
      :func:`~kvsidecar.daemon.staging.scatter` of 16 MiB into faulted-in
      memory, every other slot (2026-11-23 23:01, load
      3.3, best of 5): 7.5 ms in 2 KiB pieces, 4.8-5.1 ms in 8 KiB pieces; the
      two-point fit gives 0.4 us per piece plus 4.0-4.4 GB/s. (The first
      constants, 0.2 us and 5.8 GB/s, came from a bare numpy row copy, which the
      real scatter, grouping pieces by region and length, does not reach.)

    What made staging lose in the benchmarks was not these constants but costs
    outside the model, now gone: the staging pool mapped at the first reads
    instead of at registration, and page faults in the sidecar's fresh mapping
    of the engine's blocks (:mod:`~kvsidecar.daemon.prefault`), which the
    scatter paid in user space, 1.1 us per 4 KiB.
    """

    desc_s: float = 3e-6
    wire_bps: float = 4.1e9
    piece_s: float = 0.4e-6
    copy_bps: float = 4.0e9

    @property
    def merge_gap(self) -> int:
        """Largest gap worth reading to save one descriptor (bytes)."""
        return int(self.desc_s * self.wire_bps)

    def scattered_s(self, descriptors: int, nbytes: int) -> float:
        return descriptors * self.desc_s + nbytes / self.wire_bps

    def staged_s(self, descriptors: int, wire_bytes: int, pieces: int, copy_bytes: int) -> float:
        return (descriptors * self.desc_s + wire_bytes / self.wire_bps
                + pieces * self.piece_s + copy_bytes / self.copy_bps)


@dataclass(frozen=True)
class StagedPlan:
    """One P rank's post through staging.

    Post ``i`` reads ``length[i]`` bytes at ``remote[i]`` into the staging area
    at offset ``local[i]`` when ``into_staging[i]``, else straight into the
    engine address ``local[i]``. Then scatter piece ``j``: ``size[j]`` bytes
    from staging offset ``src[j]`` to engine address ``dst[j]``.
    """

    local: I64
    remote: I64
    length: I64
    into_staging: NDArray[np.bool_]
    src: I64
    dst: I64
    size: I64
    staging_bytes: int
    scattered_s: float
    staged_s: float

    def post_local(self, base: int) -> I64:
        """Absolute local addresses once the staging area sits at ``base``."""
        return np.where(self.into_staging, self.local + base, self.local)

    @property
    def wire_bytes(self) -> int:
        return int(self.length.sum())


def run_starts(remote: I64, length: I64, gap: int, region: I64 | None = None
               ) -> NDArray[np.bool_]:
    """Which pieces (sorted by ``remote`` address) begin a run: the first, each
    that begins more than ``gap`` bytes past everything before it, and each
    whose remote region differs from the previous piece's (``region``, when
    given: a run reads one region only). Pure."""
    n = int(remote.size)
    starts = np.empty(n, dtype=bool)
    if n == 0:
        return starts
    end = np.maximum.accumulate(remote + length)
    starts[0] = True
    starts[1:] = remote[1:] > end[:-1] + gap
    if region is not None:
        starts[1:] |= region[1:] != region[:-1]
    return starts


def plan_staging(local: I64, remote: I64, length: I64, *, mode: str = "auto",
                 model: CostModel | None = None,
                 merge_gap: int | None = None,
                 region: I64 | None = None) -> StagedPlan | None:
    """The staged plan for one post, or None to post it scattered.

    ``auto`` stages when the model says it is cheaper and the runs carry at
    most :data:`MAX_WIRE_OVERHEAD` more bytes than the pieces; ``always`` stages
    every piece (tests, and the property "a failed read never wrote engine memory").
    Whether ``staging_bytes`` fits is the caller's question (its pool).
    ``merge_gap`` overrides the model's gap threshold (tests).

    ``region``: the remote region (registration) of each piece. A run never
    spans two: one READ descriptor must lie inside one registered region
    (NIXL refuses it otherwise, NIXL_ERR_NOT_FOUND), and regions may sit
    next to each other in P's address space (mappings placed one below the
    other, or views of one reservation a page apart). None: one region.
    """
    if mode not in MODES:
        raise ValueError(f"staging mode must be one of {MODES}, got {mode!r}")
    n = int(length.size)
    if mode == "off" or n == 0:
        return None
    m = model or CostModel()
    gap = m.merge_gap if merge_gap is None else merge_gap
    order = np.argsort(remote, kind="stable")
    r = remote[order]
    ln = length[order]
    starts = run_starts(r, ln, gap, None if region is None else region[order])
    run_id = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    run_start = r[first]
    run_end = np.maximum.reduceat(r + ln, first)
    run_len = run_end - run_start
    pieces = np.diff(np.append(first, n))
    staged_run = np.ones(first.size, dtype=bool) if mode == "always" else pieces > 1
    if not staged_run.any():
        return None
    # Staging offsets: runs packed in order, each keeping its start's address
    # modulo ALIGN (so equal alignments on both sides allow row-view copies).
    need = np.where(staged_run, run_len + 2 * ALIGN, 0)
    slot = np.concatenate(([0], np.cumsum(need)[:-1]))
    run_off = slot + (ALIGN - slot % ALIGN) % ALIGN + run_start % ALIGN
    run_off = np.where(staged_run, run_off, 0)
    staging_bytes = int((run_off + run_len)[staged_run].max())
    piece_staged = staged_run[run_id]
    direct = ~piece_staged
    nd = int(direct.sum())
    post_local = np.concatenate([local[order][direct], run_off[staged_run]]).astype(np.int64)
    post_remote = np.concatenate([r[direct], run_start[staged_run]]).astype(np.int64)
    post_len = np.concatenate([ln[direct], run_len[staged_run]]).astype(np.int64)
    into = np.zeros(post_len.size, dtype=bool)
    into[nd:] = True
    src = (run_off[run_id] + r - run_start[run_id])[piece_staged]
    dst = local[order][piece_staged]
    size = ln[piece_staged]
    wanted, wire = int(length.sum()), int(post_len.sum())
    scattered = m.scattered_s(n, wanted)
    staged = m.staged_s(int(post_len.size), wire, int(size.size), int(size.sum()))
    if mode == "auto" and (staged >= scattered or wire > (1 + MAX_WIRE_OVERHEAD) * wanted):
        return None
    return StagedPlan(post_local, post_remote, post_len, into, src.astype(np.int64),
                      dst.astype(np.int64), size.astype(np.int64), staging_bytes,
                      scattered, staged)
