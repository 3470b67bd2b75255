"""Would a second NIXL agent per D engine rank ("lanes") post faster? Bare NIXL,
no sidecar, both ways in the same run, alternating rounds.

Two target processes stand in for P ranks 0 and 1 (each a bare agent with its
own shared memory); this process is D: one region registered in TWO agents.

- hetero 2→1 shape: D's pages hold both P ranks' halves, so each P rank's
  transfer is ``--descs`` scattered descriptors of ``--piece`` bytes (every
  other piece on D's side). Serial: agent A posts P rank 0's transfer, then P
  rank 1's (what D's one worker thread does today). Lanes: agent A on one
  thread posts P rank 0's while agent B on another posts P rank 1's.
- bulk: one READ of ``--bulk`` bytes from P rank 0 on agent A, vs its two
  halves posted by agents A and B on two threads.

Each transfer is timed from building its descriptor lists to DONE and release
(what the worker's read job does). NIXL releases the GIL inside transfer()
(the CMA copy), so two threads can copy at once on two cores.

    .venv/bin/python benchmarks/raw_lanes.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvsidecar.sim.raw_nixl import _region, bare_agent


def _target(name: str, span: int, conn: Connection) -> None:
    agent = bare_agent(name)
    with _region(span) as region:
        region.numpy()[:] = 7
        descs = agent.get_reg_descs([(region.address, span, 0, "")], "DRAM")
        agent.register_memory(descs)
        conn.send((agent.get_agent_metadata(), region.address))
        while not conn.poll():
            agent.get_new_notifs()
            time.sleep(0.0001)
        agent.deregister_memory(descs)


def _table(base: int, slots: np.ndarray, size: int) -> np.ndarray:
    return np.stack([base + slots * size, np.full(slots.size, size),
                     np.zeros(slots.size, np.int64)], 1).astype(np.int64)


class Lanes:
    """D's region in ``n`` agents, each linked to both targets."""

    def __init__(self, span: int, n: int = 2) -> None:
        ctx = mp.get_context("spawn")
        self.procs, self.conns, self.remote = [], [], []
        metas = []
        for r in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_target, args=(f"lanes-p{r}", span, child), daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(parent)
        self.region = _region(span)
        self.agents = [bare_agent(f"lanes-d{k}") for k in range(n)]
        for a in self.agents:
            a.register_memory(a.get_reg_descs([(self.region.address, span, 0, "")], "DRAM"))
        for c in self.conns:
            if not c.poll(60):
                raise RuntimeError("target did not start")
            meta, addr = c.recv()
            metas.append(meta)
            self.remote.append(addr)
        self.peers = [[a.add_remote_agent(m) for m in metas] for a in self.agents]

    def read(self, k: int, r: int, local: np.ndarray, remote: np.ndarray) -> float:
        """Agent ``k`` reads from target ``r``: descriptor lists, post, poll, release."""
        a = self.agents[k]
        t0 = time.perf_counter()
        h = a.initialize_xfer("READ", a.get_xfer_descs(local, "DRAM"),
                              a.get_xfer_descs(remote, "DRAM"), self.peers[k][r], b"")
        state = a.transfer(h)
        while state not in ("DONE", "ERR"):
            state = a.check_xfer_state(h)
        a.release_xfer_handle(h)
        if state == "ERR":
            raise RuntimeError("transfer failed")
        return time.perf_counter() - t0

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        self.region.close()
        self.region.unlink()


def parallel(jobs: list[Callable[[], Any]]) -> float:
    """Wall seconds for ``jobs`` each on its own thread, started together."""
    go = threading.Barrier(len(jobs) + 1)

    def run(j: Callable[[], Any]) -> None:
        go.wait()
        j()

    ts = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in ts:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def measure(rounds: int, descs: int, piece: int = 4096, bulk: int = 256 << 20
            ) -> dict[str, list[float]]:
    """Seconds per round, alternating: ``h1``/``h2`` the 2→1 shape (two P ranks x
    ``descs`` scattered descriptors of ``piece`` bytes) from one agent serially /
    two agents on two threads; ``b1``/``b2`` one READ of ``bulk`` bytes / its
    two halves on two agents and threads."""
    span = max(2 * descs * piece, bulk)
    lanes = Lanes(span)
    try:
        i = np.arange(descs, dtype=np.int64)
        hetero = [(_table(lanes.region.address, 2 * i + r, piece),
                   _table(lanes.remote[r], i, piece)) for r in range(2)]
        half = bulk // 2
        one = np.zeros(1, np.int64)
        bulk_whole = (_table(lanes.region.address, one, bulk),
                      _table(lanes.remote[0], one, bulk))
        bulk_half = [(_table(lanes.region.address + h * half, one, half),
                      _table(lanes.remote[0] + h * half, one, half)) for h in range(2)]
        for k in range(2):  # wire every agent to every target
            for r in range(2):
                lanes.read(k, r, *hetero[r])
        res: dict[str, list[float]] = {k: [] for k in ("h1", "h2", "b1", "b2")}
        for _ in range(rounds):
            t0 = time.perf_counter()
            for r in range(2):
                lanes.read(0, r, *hetero[r])
            res["h1"].append(time.perf_counter() - t0)
            res["h2"].append(parallel([lambda r=r: lanes.read(r, r, *hetero[r])
                                       for r in range(2)]))
            res["b1"].append(parallel([lambda: lanes.read(0, 0, *bulk_whole)]))
            res["b2"].append(parallel([lambda h=h: lanes.read(h, 0, *bulk_half[h])
                                       for h in range(2)]))
        if int(lanes.region.numpy()[0]) != 7:
            raise RuntimeError("no data moved")
    finally:
        lanes.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--descs", type=int, default=16_384, help="descriptors per P rank")
    ap.add_argument("--piece", type=int, default=4096)
    ap.add_argument("--bulk", type=int, default=256 << 20)
    args = ap.parse_args()
    res = measure(args.rounds, args.descs, args.piece, args.bulk)
    ms = lambda xs: " ".join(f"{x * 1e3:.1f}" for x in xs)  # noqa: E731
    print(f"load {os.getloadavg()[0]:.2f}; {args.rounds} rounds, alternating")
    for key, what in (("h", f"2→1, 2 x {args.descs:,} descriptors of {args.piece} B"),
                      ("b", f"bulk {args.bulk >> 20} MiB from one P")):
        a, b = statistics.median(res[key + "1"]), statistics.median(res[key + "2"])
        pairs = statistics.median(x / y for x, y in zip(res[key + "1"], res[key + "2"]))
        print(f"{what}: one agent {a * 1e3:.1f} ms [{ms(res[key + '1'])}], two agents/threads "
              f"{b * 1e3:.1f} ms [{ms(res[key + '2'])}]: {a / b:.2f}x (median of the rounds' "
              f"ratios {pairs:.2f}x)")


if __name__ == "__main__":
    main()
