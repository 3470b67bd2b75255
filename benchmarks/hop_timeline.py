"""Where a 1-block read's time goes, on one clock across the engine, D and P.

The latency row's hop table adds up D's histogram means, and its hops overlap
(a read posts during its lease claim). This benchmark instead timestamps each
read at a dozen points in three processes with ``time.monotonic_ns()`` (one
system-wide clock on Linux) and prints, point by point, the median offset
from the engine's ``read`` call: a timeline that accounts for its own p50.
The reads are 1-block reads alone (the read path's small-read branch).

The sidecars are the daemon as shipped: the points are wrappers installed
around daemon functions at start-up by a ``sitecustomize`` module this
benchmark writes and puts on the sidecars' ``PYTHONPATH`` (nothing in the
daemon knows of it), never around a function the daemon compares by
identity. Each wrapper costs about a microsecond. A point a refactor
renamed is reported missing, one seen in fewer than half the reads is
named with its count; neither is dropped silently. Runs with the
default flags and with ``--nixl-progress-thread-ms`` on P, in alternating
blocks (see benchmarks/progress_thread.py).
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

from suite import CpuWindow, Figure, Pair, Scale, SidecarProcess, pct, small_attention, us

#: where each point is, as (module, attribute path, "entry" or "exit"); the
#: label says which process's point it is in the table (D's loop, D's NIXL
#: worker thread, P)
POINTS: dict[str, tuple[str, str, str]] = {
    "engine message in (D loop)": ("kvsidecar.daemon.engine_server", "EngineServer._message",
                                   "entry"),
    # at entry: the engine a send wakes may run (and stamp its end) before
    # the send returns to D
    "reply to the engine leaving (D loop)": ("kvsidecar.daemon.engine_connection",
                                             "Connection._flush", "entry"),
    "read task's first step (D loop)": ("kvsidecar.daemon.d_side.driver", "_link", "entry"),
    "lease claim sent (D loop)": ("kvsidecar.daemon.peers.client",
                                  "HandshakeClient.control_soon", "exit"),
    # not plan_and_address itself: the read table's planning job finds its
    # batched variant by that function's identity
    "planned (D loop)": ("kvsidecar.daemon.d_side.addresses", "posts_of", "exit"),
    "claim received (P loop)": ("kvsidecar.daemon.peers.server", "HandshakeServer._handle",
                                "entry"),
    "claim granted (P loop)": ("kvsidecar.daemon.p_side.control", "_claim", "exit"),
    "post taken (D NIXL worker)": ("kvsidecar.daemon.transport.worker", "NixlWorker._do_read",
                                   "entry"),
    "post() returned (D NIXL worker)": ("kvsidecar.daemon.transport.inflight",
                                        "InflightReads.post", "exit"),
    "transfer DONE (D NIXL worker)": ("kvsidecar.daemon.transport.inflight",
                                      "InflightReads._finish", "entry"),
    "results back on the loop (D loop)": ("kvsidecar.daemon.transport.worker",
                                          "NixlWorker._deliver", "entry"),
    "lease claim granted (D loop)": ("kvsidecar.daemon.d_side.driver", "_claim", "exit"),
    "read completed (D loop)": ("kvsidecar.daemon.d_side.table", "ReadTable._complete",
                                "entry"),
}

_SITECUSTOMIZE = '''\
"""Written by benchmarks/hop_timeline.py: timestamps at daemon functions."""
import collections, functools, importlib, inspect, os, signal, sys, time

_OUT = os.environ.get("KVSIDECAR_BENCH_TIMELINE")
if _OUT and "serve" in open("/proc/self/cmdline").read().split("\\0"):
    _EV = collections.deque(maxlen=400_000)
    _now = time.monotonic_ns

    def _wrap(label, fn, where):
        if inspect.iscoroutinefunction(fn):
            async def wrapped(*a, **k):
                if where == "entry":
                    _EV.append((_now(), label))
                try:
                    return await fn(*a, **k)
                finally:
                    if where == "exit":
                        _EV.append((_now(), label))
        else:
            def wrapped(*a, **k):
                if where == "entry":
                    _EV.append((_now(), label))
                try:
                    return fn(*a, **k)
                finally:
                    if where == "exit":
                        _EV.append((_now(), label))
        return functools.wraps(fn)(wrapped)

    _missing = []
    for _label, (_mod, _path, _where) in %(points)r.items():
        try:
            _owner = importlib.import_module(_mod)
            *_outer, _name = _path.split(".")
            for _part in _outer:
                _owner = getattr(_owner, _part)
            setattr(_owner, _name, _wrap(_label, getattr(_owner, _name), _where))
        except (ImportError, AttributeError):
            _missing.append(_label)

    def _dump(*_a):
        with open(os.path.join(_OUT, "%%d.txt" %% os.getpid()), "w") as f:
            for m in _missing:
                f.write("missing %%s\\n" %% m)
            for t, label in list(_EV):
                f.write("%%d %%s\\n" %% (t, label))

    signal.signal(signal.SIGUSR2, _dump)
'''

ORDER = ("default", "thread")
BLOCKS = 2


def _site_dir(root: Path) -> Path:
    site = root / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE % {"points": POINTS})
    return site


def _start(root: Path, name: str, flags: list[str], out: Path) -> SidecarProcess:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(_site_dir(root)),
                                                      os.environ.get("PYTHONPATH", "")])),
           "KVSIDECAR_BENCH_TIMELINE": str(out)}
    return SidecarProcess(root, name, env=env,
                          args=["--metrics-port", "0", "--engine-lease", "600", *flags]).start()


def _events(out: Path, pids: dict[int, str]) -> tuple[list[tuple[int, str]], list[str]]:
    """The points each sidecar dumped, each kept only from the process its
    label names (P's own engine messages are no part of D's read), and the
    points a sidecar could not find."""
    events, missing = [], []
    for f in out.glob("*.txt"):
        who = pids.get(int(f.stem))
        if who is None:
            continue
        for line in f.read_text().splitlines():
            head, _, rest = line.partition(" ")
            if head == "missing":
                missing.append(rest)
            elif f"({who} " in rest:
                events.append((int(head), rest))
    return events, sorted(set(missing))


def timeline(events: list[tuple[int, str]], marks: list[tuple[int, int]]
             ) -> tuple[list[tuple[str, list[float]]], dict[str, int]]:
    """Each point's offsets (seconds) from the engine's call, per read window
    ``marks`` (engine call, engine received, monotonic ns); a point seen twice
    in a window (the reply to the read, then the poll's) is numbered; a point
    seen in fewer than half the windows is left out of the rows and returned
    with the number of windows it was seen in. Rows ordered by median offset.
    Pure: the clock's values in, the table's out."""
    events = sorted(events)
    offsets: dict[str, list[float]] = collections.defaultdict(list)
    i = 0
    for start, end in marks:
        while i < len(events) and events[i][0] < start:
            i += 1
        seen: collections.Counter[str] = collections.Counter()
        j = i
        while j < len(events) and events[j][0] <= end:
            t, label = events[j]
            seen[label] += 1
            key = label if seen[label] == 1 else f"{label} #{seen[label]}"
            offsets[key].append((t - start) / 1e9)
            j += 1
        offsets["engine has the completion"].append((end - start) / 1e9)
    rows = [(k, v) for k, v in offsets.items() if len(v) >= len(marks) / 2]
    rare = {k: len(v) for k, v in offsets.items() if len(v) < len(marks) / 2}
    return sorted(rows, key=lambda kv: statistics.median(kv[1])), rare


def window_cpu_note(cpu_s: list[float], wall_s: list[float], cores: int) -> str:
    """The CPU the engines' process and both sidecars ran inside the reads'
    windows (engine call to completion; per read, as :class:`CpuWindow`
    counts it), the share of ``cores`` cores that kept busy, and the median
    CPU spread over every core at once: no read costing that much CPU ends
    sooner on these cores, a lower bound on the p50 as long as it does. Pure."""
    share = [c / w / cores for c, w in zip(cpu_s, wall_s) if w > 0]
    cpu = statistics.median(cpu_s)
    return (f"CPU inside the reads' windows (the engines' process and both sidecars): "
            f"median {us(cpu)} a read, keeping {statistics.median(share):.0%} of the "
            f"{cores} cores busy (p10 {pct(share, 10):.0%}, p90 {pct(share, 90):.0%}); "
            f"that CPU spread over every core at once takes {us(cpu / cores)}, a lower "
            f"bound on the p50 as long as a read costs this much CPU")


def bench(fleet: object, s: Scale) -> list[Figure]:
    del fleet  # its own sidecars: they carry the timestamps
    root = Path(tempfile.mkdtemp(prefix="kvs-hops-"))
    outs = {mode: root / f"out-{mode}" for mode in ORDER}
    started: list[SidecarProcess] = []
    pairs: dict[str, Pair] = {}
    try:
        procs: dict[str, list[SidecarProcess]] = {}
        for mode, names, flags in (("default", ("hp0", "hd0"), []),
                                   ("thread", ("hpt0", "hdt0"),
                                    ["--nixl-progress-thread-ms", "10"])):
            outs[mode].mkdir()
            procs[mode] = []
            for name, args in zip(names, (flags, [])):  # the flag on P only
                started.append(_start(root, name, args, outs[mode]))
                procs[mode].append(started[-1])
        marks: dict[str, list[tuple[int, int]]] = {m: [] for m in ORDER}
        lat: dict[str, list[float]] = {m: [] for m in ORDER}
        cpu: dict[str, list[float]] = {m: [] for m in ORDER}
        for m, (p, d) in procs.items():
            pairs[m] = Pair(p, d, small_attention, 8, f"hops-{m}")
        n = max(5, s.latency_reads // BLOCKS)
        for block in range(BLOCKS):
            for mode in ORDER if block % 2 == 0 else reversed(ORDER):
                pair = pairs[mode]
                cpu_win = CpuWindow(*(sc.proc.pid for sc in procs[mode] if sc.proc is not None))
                for i in range(n + 3):
                    t0, t1, cpu_s = pair.timed_read(cpu=cpu_win)
                    if i >= 3:  # the first reads link
                        marks[mode].append((t0, t1))
                        lat[mode].append((t1 - t0) / 1e9)
                        cpu[mode].append(cpu_s)
        for sc in started:
            assert sc.proc is not None
            os.kill(sc.proc.pid, signal.SIGUSR2)
        time.sleep(1.0)
        for pair in pairs.values():
            pair.close()
        pairs.clear()
        for sc in started:
            sc.stop()
        started.clear()
        return _figures(procs, outs, marks, lat, cpu)
    finally:
        for pair in pairs.values():
            pair.close()
        for sc in started:
            sc.stop()
        shutil.rmtree(root, ignore_errors=True)


def _figures(procs: dict[str, list[SidecarProcess]], outs: dict[str, Path],
             marks: dict[str, list[tuple[int, int]]], lat: dict[str, list[float]],
             cpu: dict[str, list[float]]) -> list[Figure]:
    figures = []
    for mode, (p, d) in procs.items():
        assert p.proc is not None and d.proc is not None
        events, missing = _events(outs[mode], {p.proc.pid: "P", d.proc.pid: "D"})
        if not any("(D loop)" in label for _, label in events):
            raise RuntimeError(f"no timeline came from the {mode} pair's D sidecar")
        rows, rare = timeline(events, marks[mode])
        steps = [f"{us(statistics.median(v))} {k} (p10 {us(pct(v, 10))}, p90 "
                 f"{us(pct(v, 90))})" for k, v in rows]
        notes = ["timeline, median offset from the engine's `read` call: " + "; ".join(steps),
                 window_cpu_note(cpu[mode], lat[mode], os.cpu_count() or 1)]
        if rare:
            notes.append(f"seen in fewer than half of the {len(marks[mode])} reads, so left out "
                         "above: " + ", ".join(f"{k} ({n})" for k, n in sorted(rare.items())))
        if missing:
            notes.append("points not found in this daemon (renamed?): " + ", ".join(missing))
        flag = " with --nixl-progress-thread-ms 10 on P" if mode == "thread" else ""
        figures.append(Figure(
            f"1-block (16 KiB) read, hop by hop on one clock (engine, D, P){flag} "
            f"({len(lat[mode])} reads in {BLOCKS} blocks alternating with the "
            f"{'default' if mode == 'thread' else 'flag'}, waiting poll)",
            f"p50 {us(pct(lat[mode], 50))}, p99 {us(pct(lat[mode], 99))}",
            "—", "—", "table (where the p50 goes)", None, notes))
    return figures
