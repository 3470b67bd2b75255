"""Does NIXL's prepped path (prep_xfer_dlist once + make_prepped_xfer per request)
beat building descriptor lists per request (get_xfer_descs + initialize_xfer)?

The sidecar builds descriptors per request because its plans are arbitrary
slices at kernel-block granularity; a prepped list at that granularity would
need an entry per (region, kernel block, slice). This measures what that
choice costs: 45,000 scattered 4 KiB descriptors, two processes, CMA.

    .venv/bin/python benchmarks/prepped_vs_dynamic.py
"""

from __future__ import annotations

import time

import numpy as np

from kvsidecar.sim.raw_nixl import RawPair

N, SIZE = 45_000, 4096


def main() -> None:
    # Descriptors use every other 4 KiB slot: nothing is adjacent.
    with RawPair(2 * N * SIZE) as pair:
        a, lbase, rbase = pair.agent, pair.region.address, pair.remote_addr
        slots = np.arange(N, dtype=np.int64) * 2
        dyn_post, dyn_xfer = [], []
        for _ in range(4):
            t0 = time.perf_counter()
            h = a.initialize_xfer("READ", a.get_xfer_descs(pair.table(lbase, slots, SIZE), "DRAM"),
                                  a.get_xfer_descs(pair.table(rbase, slots, SIZE), "DRAM"),
                                  pair.peer, b"")
            t1 = time.perf_counter()
            pair.finish(h)
            dyn_post.append(t1 - t0)
            dyn_xfer.append(time.perf_counter() - t1)
        every = np.arange(2 * N, dtype=np.int64)
        t0 = time.perf_counter()
        lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", pair.table(lbase, every, SIZE), "DRAM")
        rh = a.prep_xfer_dlist(pair.peer, pair.table(rbase, every, SIZE), "DRAM")
        prep = time.perf_counter() - t0
        sel = slots.astype(np.int32)
        pre_post, pre_xfer = [], []
        for _ in range(4):
            t0 = time.perf_counter()
            h = a.make_prepped_xfer("READ", lh, sel, rh, sel, b"")
            t1 = time.perf_counter()
            pair.finish(h)
            pre_post.append(t1 - t0)
            pre_xfer.append(time.perf_counter() - t1)
    d = min(dyn_post[1:]) * 1e3, min(dyn_xfer[1:]) * 1e3
    p = min(pre_post[1:]) * 1e3, min(pre_xfer[1:]) * 1e3
    print(f"{N:,} scattered {SIZE} B descriptors, best of 3 after a warm-up")
    print(f"  dynamic (get_xfer_descs + initialize_xfer): build {d[0]:.1f} ms, "
          f"transfer {d[1]:.1f} ms")
    print(f"  prepped (make_prepped_xfer; prep once {prep * 1e3:.1f} ms): build {p[0]:.2f} ms, "
          f"transfer {p[1]:.1f} ms")
    print(f"  prepped / dynamic, build + transfer: {(p[0] + p[1]) / (d[0] + d[1]):.2f}x")


if __name__ == "__main__":
    main()
