"""Does NIXL's prepped path (prep_xfer_dlist once + make_prepped_xfer per request)
beat building descriptor lists per request (get_xfer_descs + initialize_xfer)?

The sidecar builds descriptors per request because its plans are arbitrary
slices at kernel-block granularity; a prepped list at that granularity would
need an entry per (region, kernel block, slice). This measures what that
choice costs: 45,000 scattered 4 KiB descriptors, two processes, CMA.

    .venv/bin/python benchmarks/prepped_vs_dynamic.py
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvsidecar.ipc.memory import ShmRegion, unique_name

N, SIZE = 45_000, 4096
SPAN = 2 * N * SIZE  # descriptors use every other 4 KiB slot: nothing is adjacent


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _target(conn: Connection) -> None:
    a = _agent("bench-target")
    with ShmRegion.create(unique_name("bt"), SPAN) as r:
        a.register_memory(a.get_reg_descs([(r.address, SPAN, 0, "")], "DRAM"))
        conn.send((a.get_agent_metadata(), r.address))
        done = False
        while not done:
            for msgs in a.get_new_notifs().values():
                done = done or b"stop" in msgs
            time.sleep(0.0001)


def _table(base: int, slots: np.ndarray) -> np.ndarray:
    return np.stack([base + slots * SIZE, np.full(slots.size, SIZE),
                     np.zeros(slots.size, np.int64)], 1).astype(np.int64)


def main() -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child,), daemon=True)
    proc.start()
    a = _agent("bench-initiator")
    with ShmRegion.create(unique_name("bi"), SPAN) as r:
        a.register_memory(a.get_reg_descs([(r.address, SPAN, 0, "")], "DRAM"))
        meta, raddr = parent.recv()
        peer = a.add_remote_agent(meta)
        slots = np.arange(N, dtype=np.int64) * 2

        def finish(h: Any) -> None:
            s = a.transfer(h)
            while s not in ("DONE", "ERR"):
                s = a.check_xfer_state(h)
            a.release_xfer_handle(h)
            assert s == "DONE"

        dyn_post, dyn_xfer = [], []
        for _ in range(4):
            t0 = time.perf_counter()
            h = a.initialize_xfer("READ", a.get_xfer_descs(_table(r.address, slots), "DRAM"),
                                  a.get_xfer_descs(_table(raddr, slots), "DRAM"), peer, b"")
            t1 = time.perf_counter()
            finish(h)
            dyn_post.append(t1 - t0)
            dyn_xfer.append(time.perf_counter() - t1)
        every = np.arange(2 * N, dtype=np.int64)
        t0 = time.perf_counter()
        lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", _table(r.address, every), "DRAM")
        rh = a.prep_xfer_dlist(peer, _table(raddr, every), "DRAM")
        prep = time.perf_counter() - t0
        sel = slots.astype(np.int32)
        pre_post, pre_xfer = [], []
        for _ in range(4):
            t0 = time.perf_counter()
            h = a.make_prepped_xfer("READ", lh, sel, rh, sel, b"")
            t1 = time.perf_counter()
            finish(h)
            pre_post.append(t1 - t0)
            pre_xfer.append(time.perf_counter() - t1)
        a.send_notif(peer, b"stop")
        for _ in range(50):
            a.get_new_notifs()
            time.sleep(0.002)
    proc.join(10)
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
