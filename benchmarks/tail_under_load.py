"""1-block read latency while 16-block reads keep 64 in flight on the same pair.

The outside harness of issue #31 ("the hot path"): a P and a D sidecar
started as ``kvsidecar serve`` processes (:class:`~kvsidecar.sim.cluster.SidecarProcess`,
as ``make bench``'s fleet starts them), and this one process playing both
engines through the public asyncio client only
(:class:`~kvsidecar.ipc.client.AsyncSidecarClient`; the engines are
registered and P's blocks filled with the oracle's bytes by
:class:`~kvsidecar.sim.cluster.SimEngine`). Every read has its own ``hold``
on P (its token presented by D's ``read``), one ``read`` message each:

- the load: ``--window`` (64) slots, each a loop of hold, read 16 blocks
  (256 KiB), wait for ``received``, again;
- the probe: one 1-block (16 KiB) read at a time, each after a hold and a
  short random gap, timed from the engine's ``read`` call to the moment
  the engine has its ``received`` completion (a waiting ``poll`` parked on
  D for each engine, answered as soon as D queues a completion);
- raw NIXL in the same minutes: a child process with two bare agents
  (:class:`~kvsidecar.sim.raw_nixl.RawPair`) timing a 16 KiB READ posted
  and polled to DONE every 2 ms while the load and probe run.

Printed: the probe's p50 / p99 / p99.9 with no load and under the load,
raw NIXL's, the load's reads/s, and the ten slowest probe reads. The
first read of each kind is checked byte for byte against P's memory.

``--old ROOT`` runs the same phases against sidecars started from another
checkout (``ROOT`` is a directory holding ``kvsidecar``, e.g. a worktree's
``.typecheck``), alternating old and new ``--rounds`` times: a same-run A/B.

Run (repo root on ``PYTHONPATH`` as the package ``kvsidecar``)::

    python benchmarks/tail_under_load.py            # ~3,000 probes, ~1 min
    python benchmarks/tail_under_load.py --smoke    # a few seconds
    python benchmarks/tail_under_load.py --old /tmp/ab-old/.typecheck --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from kvsidecar.ipc.client import AsyncSidecarClient
from kvsidecar.ipc.protocol import Completion
from kvsidecar.sim.cluster import SidecarProcess, SimEngine
from kvsidecar.sim.oracle import Request, fill_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite import small_attention

LOAD_BLOCKS = 16
#: the probe's gap between reads: uniform in this range (seconds)
GAP_S = (0.0005, 0.0015)


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``xs``."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summary(xs: Sequence[float]) -> str:
    if not xs:
        return "no reads"
    return (f"p50 {pct(xs, 50) * 1e3:.2f} ms, p99 {pct(xs, 99) * 1e3:.2f} ms, "
            f"p99.9 {pct(xs, 99.9) * 1e3:.2f} ms, max {max(xs) * 1e3:.2f} ms ({len(xs)})")


# ----------------------------------------------------------------- raw NIXL


def _raw_child(conn: Connection, period_s: float) -> None:
    """Time a 16 KiB READ between two bare agents every ``period_s`` until told."""
    from kvsidecar.sim.raw_nixl import RawPair, RawReader

    out: list[float] = []
    with RawPair(1 << 16) as pair:
        reader = RawReader(pair, 16384)
        for _ in range(3):
            reader.once()  # wire-up
        conn.send("ready")
        while not conn.poll():
            out.append(reader.once())
            time.sleep(period_s)
    conn.send(out)


class RawProbe:
    """Raw NIXL's 16 KiB READ latency, timed in a child process meanwhile."""

    def __init__(self, period_s: float = 0.002) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # not a daemon: RawPair starts its target as a child of this one
        self._proc = ctx.Process(target=_raw_child, args=(child, period_s))
        self._proc.start()
        child.close()
        if not self._conn.poll(60) or self._conn.recv() != "ready":
            raise RuntimeError("raw NIXL probe did not start")

    def stop(self) -> list[float]:
        self._conn.send("stop")
        out: list[float] = self._conn.recv() if self._conn.poll(60) else []
        self._proc.join(30)
        return out


# ----------------------------------------------------------------- engines


@dataclass
class Phase:
    probe_s: list[float] = field(default_factory=list)
    #: (engine read call, completion in hand) per probe read, monotonic ns
    marks: list[tuple[int, int]] = field(default_factory=list)
    rids: list[str] = field(default_factory=list)
    load_reads: int = 0
    load_s: float = 0.0
    raw_s: list[float] = field(default_factory=list)


class Engines:
    """A P and a D engine (tp 1) on two sidecars; the async calls of both."""

    def __init__(self, p: SidecarProcess, d: SidecarProcess, name: str, window: int) -> None:
        blocks = window * LOAD_BLOCKS + 8
        self.P = SimEngine(f"{name}-P", small_attention, 1, blocks, [p])
        self.D = SimEngine(f"{name}-D", small_attention, 1, blocks, [d])
        self.p_sock, self.d_sock = p.socket, d.socket
        # P's blocks: filled once with the oracle's bytes, held again per read
        self.slots = [self._filled(i, LOAD_BLOCKS) for i in range(window)]
        self.probe_remote = self._filled(window, 1)
        self.local = [self.D.alloc(LOAD_BLOCKS) for _ in range(window)]
        self.probe_local = self.D.alloc(1)
        self.n = 0
        self.waiting: dict[str, asyncio.Future[Completion]] = {}

    def _filled(self, seed: int, blocks: int) -> list[int]:
        ids = self.P.alloc(blocks)
        fill_shard(self.P.buffers[0], self.P.layout, 0, [ids],
                   Request(seed=seed + 1, prompt_tokens=8 * blocks))
        return ids

    def same_bytes(self, local: list[int], remote: list[int]) -> bool:
        pb = self.P.layout.page_bytes
        return all(np.array_equal(d[lb * pb:(lb + 1) * pb], p[rb * pb:(rb + 1) * pb])
                   for d, p in zip(self.D.buffers[0], self.P.buffers[0])
                   for lb, rb in zip(local, remote))

    async def _poller(self, client: AsyncSidecarClient, engine_id: str, route: bool) -> None:
        while True:
            for c in await client.poll(engine_id, wait_s=1.0):
                if c.kind not in ("received", "sent"):
                    raise RuntimeError(f"{c.request_id}: {c.kind} ({c.reason})")
                fut = self.waiting.pop(c.request_id, None) if route else None
                if fut is not None and not fut.done():
                    fut.set_result(c)

    async def read(self, pc: AsyncSidecarClient, dc: AsyncSidecarClient, local: list[int],
                   remote: list[int], prefix: str = "r") -> tuple[str, int, int]:
        """Hold ``remote`` on P, read it into ``local`` on D; the read's id,
        start and its completion on the engine (monotonic ns)."""
        self.n += 1
        rid = f"{prefix}{self.n}"
        held = await pc.hold(self.P.engine_id, rid, [remote])
        fut = asyncio.get_running_loop().create_future()
        self.waiting[rid] = fut
        t0 = time.monotonic_ns()
        await dc.read(self.D.engine_id, rid, [local], self.P.remote, [remote],
                      remote_request_id=rid, skip_tokens=0, num_tokens=8 * len(remote),
                      remote_tokens=[held.token])
        await fut
        return rid, t0, time.monotonic_ns()

    async def run(self, probes: int, loaded: bool, warm_s: float, raw: bool) -> Phase:
        out = Phase()
        stop = asyncio.Event()
        async with AsyncSidecarClient(self.p_sock) as pc, \
                AsyncSidecarClient(self.d_sock) as dc, \
                AsyncSidecarClient(self.p_sock) as pp, \
                AsyncSidecarClient(self.d_sock) as dp:
            pollers = [asyncio.ensure_future(self._poller(pp, self.P.engine_id, False)),
                       asyncio.ensure_future(self._poller(dp, self.D.engine_id, True))]
            counting = False

            async def slot(i: int) -> None:
                while not stop.is_set():
                    await self.read(pc, dc, self.local[i], self.slots[i])
                    if counting:
                        out.load_reads += 1

            # the first read of each kind is checked against P's bytes
            await self.read(pc, dc, self.probe_local, self.probe_remote)
            await self.read(pc, dc, self.local[0], self.slots[0])
            if not (self.same_bytes(self.probe_local, self.probe_remote)
                    and self.same_bytes(self.local[0], self.slots[0])):
                raise RuntimeError("a read's bytes differ from P's")
            loads = ([asyncio.ensure_future(slot(i)) for i in range(len(self.slots))]
                     if loaded else [])
            await asyncio.sleep(warm_s)
            rawp = await asyncio.to_thread(RawProbe) if raw else None
            counting = True
            t0 = time.perf_counter()
            try:
                for _ in range(probes):
                    rid, a, b = await self.read(pc, dc, self.probe_local, self.probe_remote,
                                                "PROBE")
                    out.rids.append(rid)
                    out.marks.append((a, b))
                    out.probe_s.append((b - a) / 1e9)
                    await asyncio.sleep(random.uniform(*GAP_S))
                    if any(t.done() for t in loads + pollers):
                        break
                out.load_s = time.perf_counter() - t0
                counting = False
            finally:
                stop.set()
                if rawp is not None:
                    out.raw_s = await asyncio.to_thread(rawp.stop)
                await asyncio.wait(loads, timeout=30) if loads else None
                for t in loads + pollers:
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                    t.cancel()
        return out

    def close(self) -> None:
        self.D.close()
        self.P.close()


def start_pair(root: Path, tag: str, pythonpath: str | None, flags: Sequence[str],
               stamps: Path | None = None) -> list[SidecarProcess]:
    """A P and a D sidecar, started from ``pythonpath`` (None: as this process
    imports kvsidecar), with the timestamps of tail_stamps.py into ``stamps``."""
    path = [pythonpath or os.environ.get("PYTHONPATH", "")]
    env = {}
    if stamps is not None:
        import tail_stamps

        path.insert(0, str(tail_stamps.site_dir(root)))
        env["KVSIDECAR_TAIL_STAMPS"] = str(stamps)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    return [SidecarProcess(root, f"{tag}-{side}", env=env,
                           args=["--metrics-port", "0", "--engine-lease", "600", *flags]).start()
            for side in ("p", "d")]


def phase(root: Path, tag: str, pythonpath: str | None, probes: int, idle: int, window: int,
          warm_s: float, flags: Sequence[str] = (), stamps: bool = False
          ) -> tuple[Phase, Phase]:
    """Idle probes, then loaded ones, on a fresh pair started from ``pythonpath``."""
    out = root / f"stamps-{tag}" if stamps else None
    if out is not None:
        out.mkdir()
    procs = start_pair(root, tag, pythonpath, flags, out)
    try:
        eng = Engines(procs[0], procs[1], tag, window)
        try:
            quiet = asyncio.run(eng.run(idle, False, 0.0, False))
            loaded = asyncio.run(eng.run(probes, True, warm_s, True))
        finally:
            eng.close()
        if out is not None:
            for sc in procs:
                assert sc.proc is not None
                os.kill(sc.proc.pid, signal.SIGUSR2)
            time.sleep(1.5)
            explain(out, procs, loaded)
    finally:
        for p in procs:
            p.stop()
    return quiet, loaded


def explain(out: Path, procs: list[SidecarProcess], loaded: Phase) -> None:
    """Where the probe's time went under load, from the sidecars' stamps:
    median offsets over every probe and over the slowest 1 %, the size of the
    task each probe rode in, and the ten slowest reads one by one."""
    import tail_stamps as ts

    p, d = (ts.read_logs(out, sc.proc.pid) if sc.proc is not None else None for sc in procs)
    if d is None:
        print("no stamps came from D")
        return
    for logs in (d, p):
        if logs is not None and logs.missing:
            print("points not found (renamed?): " + ", ".join(logs.missing))
    if p is not None:  # one clock (CLOCK_MONOTONIC): P's points join D's timelines
        for rid, pts in p.points.items():
            d.points[rid].extend(pts)
    order = sorted(range(len(loaded.probe_s)), key=loaded.probe_s.__getitem__)
    slow = order[-max(1, len(order) // 100):]
    fast = order[:len(order) // 2]
    for name, idx in (("all probes", order), ("fastest half", fast), ("slowest 1 %", slow)):
        rids = [loaded.rids[i] for i in idx]
        print(ts.table(d, rids, [loaded.marks[i] for i in idx], name))
        print(f"  task sizes (reads in the probe's task: probes): "
              f"{dict(sorted(ts.groups_of(d, rids).items()))}")
    for i in order[::-1][:10]:
        t0, t1 = loaded.marks[i]
        print(f"  {loaded.probe_s[i] * 1e3:.1f} ms: {ts.timeline(d, loaded.rids[i], t0, t1, p)}")
    walls = [(b - a) / 1e3 for a, b, *_ in d.jobs]
    print(f"D worker read jobs: {len(d.jobs)}, µs each p50 {pct(walls, 50):.0f} "
          f"p99 {pct(walls, 99):.0f} max {max(walls):.0f}")
    w0, w1 = loaded.marks[0][0], loaded.marks[-1][1]
    for who, logs in (("D", d), ("P", p)):
        gcs = [g for g in logs.gcs if w0 <= g[0] <= w1] if logs is not None else []
        if gcs:
            gc_us = [(b - a) / 1e3 for a, b, _ in gcs]
            long = [f"gen{g} {(b - a) / 1e6:.1f} ms" for a, b, g in gcs if b - a > 1e6]
            print(f"{who} GCs while timed: {len(gc_us)}, µs p50 {pct(gc_us, 50):.0f} max "
                  f"{max(gc_us):.0f}; over 1 ms: {', '.join(long) or 'none'}")


def report(label: str, quiet: Phase, loaded: Phase) -> None:
    print(f"[{label}] idle pair, 1-block: {summary(quiet.probe_s)}")
    print(f"[{label}] under load, 1-block: {summary(loaded.probe_s)}")
    print(f"[{label}] raw NIXL 16 KiB READ meanwhile: {summary(loaded.raw_s)}")
    rate = loaded.load_reads / loaded.load_s if loaded.load_s else 0.0
    print(f"[{label}] load: {loaded.load_reads} 16-block reads in {loaded.load_s:.1f} s, "
          f"{rate:,.0f} reads/s")
    slow = sorted(loaded.probe_s)[-10:][::-1]
    print(f"[{label}] slowest probes (ms): " + ", ".join(f"{s * 1e3:.1f}" for s in slow))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probes", type=int, default=3000)
    ap.add_argument("--idle", type=int, default=300, help="probes on the idle pair first")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--warm", type=float, default=2.0, help="seconds of load before timing")
    ap.add_argument("--smoke", action="store_true", help="a few seconds: 100 probes")
    ap.add_argument("--old", help="a directory holding another kvsidecar: A/B against it")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--flag", action="append", default=[], help="a sidecar flag (repeat)")
    ap.add_argument("--stamps", action="store_true",
                    help="timestamps inside the sidecars (benchmarks/tail_stamps.py)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.probes, args.idle, args.warm = 100, 20, 0.5
    root = Path(tempfile.mkdtemp(prefix="kvs-tail-"))
    try:
        runs: list[tuple[str, str | None]] = [("new", None)]
        if args.old:
            runs = [("old", args.old), ("new", None)]
        for r in range(args.rounds):
            for label, path in runs if r % 2 == 0 else runs[::-1]:
                quiet, loaded = phase(root, f"{label}{r}", path, args.probes, args.idle,
                                      args.window, args.warm, [
                                          f for fl in args.flag for f in fl.split()],
                                      args.stamps)
                report(f"{label} #{r}", quiet, loaded)
                sys.stdout.flush()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
