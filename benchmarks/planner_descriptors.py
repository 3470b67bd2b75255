"""How fast the planner turns a request into NIXL descriptor arrays.

Case from issue #2: 64 regions x 20,000 named pages x 6 segments (7.68 M
descriptors before coalescing), D tp 2 reading from P tp 1 so every segment is
a slice. Baseline measured in the same run: building the same descriptors as a
Python list of tuples (the in-engine style), timed on a slice of the pages and
scaled linearly.

    .venv/bin/python benchmarks/planner_descriptors.py
"""

from __future__ import annotations

import time

import numpy as np

from kvsidecar.daemon.planner import plan_read, segment_pieces
from kvsidecar.ipc.layout import Group, Layout, Segment, validate

REGIONS, PAGES, SEGS = 64, 20_000, 6


def six_segment_layout(tp: int, num_blocks: int) -> Layout:
    sizes = [(4096, 64), (1024, 8), (1024, 8), (8192, 32), (2048, 16), (2048, 16)]
    segs, off = [], 0
    for i, (per_unit, units) in enumerate(sizes):
        n = units // tp
        segs.append(Segment(f"s{i}", off, n * per_unit, units))
        off += n * per_unit
    return validate(Layout("bench", tp, REGIONS, num_blocks, off, (Group("mamba", tuple(segs)),),
                           {"name": "bench"}))


def python_baseline(D: Layout, P: Layout, d_ids: np.ndarray, p_ids: np.ndarray) -> float:
    """Seconds per page for list-of-tuples descriptors (addr, len) on both sides."""
    pieces = [p for p in segment_pieces(D, 1, P)]
    n = 200
    t0 = time.perf_counter()
    local, remote = [], []
    for r in range(REGIONS):
        for lb, rb in zip(d_ids[:n].tolist(), p_ids[:n].tolist()):
            for pc in pieces:
                local.append((r * 10**9 + lb * D.page_bytes + pc.local_offset, pc.nbytes, 0))
                remote.append((r * 10**9 + rb * P.page_bytes + pc.remote_offset, pc.nbytes, 0))
    return (time.perf_counter() - t0) / n


def main() -> None:
    P, D = six_segment_layout(1, PAGES), six_segment_layout(2, PAGES)
    rng = np.random.default_rng(0)
    p_ids, d_ids = rng.permutation(PAGES), rng.permutation(PAGES)
    plan_read(D, 1, P, [d_ids[:100]], [p_ids[:100]])  # warm up
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        plan = plan_read(D, 1, P, [d_ids], [p_ids])
        best = min(best, time.perf_counter() - t0)
    base = python_baseline(D, P, d_ids, p_ids) * PAGES
    print(f"scattered, P tp1 -> D tp2: {plan.descriptors_before_coalescing:,} descriptors "
          f"-> {plan.descriptors:,} after coalescing, {best * 1e3:.0f} ms "
          f"(python tuples baseline {base * 1e3:.0f} ms, {base / best:.1f}x faster)")
    homog_P, homog_D = six_segment_layout(2, PAGES), six_segment_layout(2, PAGES)
    ids = np.arange(PAGES)
    t0 = time.perf_counter()
    plan = plan_read(homog_D, 1, homog_P, [ids], [ids])
    dt = time.perf_counter() - t0
    print(f"homogeneous tp2, consecutive pages: {plan.descriptors_before_coalescing:,} "
          f"descriptors -> {plan.descriptors:,} after coalescing, {dt * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
