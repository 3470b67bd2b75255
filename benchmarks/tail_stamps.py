"""Per-read timestamps inside the sidecars, for benchmarks/tail_under_load.py.

As benchmarks/hop_timeline.py does, a ``sitecustomize`` written here wraps
daemon functions at start-up (nothing in the daemon knows of it), but each
point here is kept only for the probe's reads (request ids starting with
``PROBE``), found in the wrapped call's arguments (in a control frame's
bytes for the claim's hops: D sends it, P answers it, D has the reply; one
clock, ``CLOCK_MONOTONIC``, so P's points join D's), so the timeline of one
1-block read can be told apart from the 64 16-block reads around it. Two
more logs cover everything: each job the D NIXL worker ran for a read (its
start, end, bytes and descriptors, and whether a small read was in it), and
each garbage collection (``gc.callbacks``), in both sidecars. A sidecar
writes its logs on SIGUSR2.
"""

from __future__ import annotations

import bisect
import collections
import statistics
from collections.abc import Sequence
from pathlib import Path

#: label -> (module, attribute path, "entry" or "exit", index of the argument
#: naming the read(s): an Attempt, a ReadJob, a list of either or of tuples
#: starting with one; None: the argument is an engine message's bytes)
POINTS: dict[str, tuple[str, str, str, int | None]] = {
    "message in": ("kvsidecar.daemon.engine_server", "EngineServer._message", "entry", None),
    "task made": ("kvsidecar.daemon.d_side.table", "ReadTable._start_group", "entry", 2),
    "first step": ("kvsidecar.daemon.d_side.table", "ReadTable._run", "entry", 2),
    "claims sent, planning": ("kvsidecar.daemon.d_side.driver", "_claim_and_plan", "entry", 0),
    "claimed and planned": ("kvsidecar.daemon.d_side.driver", "_claim_and_plan", "exit", 0),
    "post first (alone)": ("kvsidecar.daemon.d_side.driver", "_post_first", "entry", 0),
    "claim granted (alone)": ("kvsidecar.daemon.d_side.driver", "_claim", "exit", 0),
    "group posts": ("kvsidecar.daemon.d_side.driver", "post_all", "entry", 1),
    "completed": ("kvsidecar.daemon.d_side.table", "ReadTable._complete", "entry", 2),
    # the claim's path: D's peer channel (the frame it sends, a claim alone or
    # a batch of them, and its reply), P's handshake server answering it
    "claim on D's wire": ("kvsidecar.daemon.peers.client", "HandshakeClient._send", "entry", 3),
    "claim reply on D": ("kvsidecar.daemon.peers.client", "HandshakeClient._send", "exit", 3),
    "P answers claim": ("kvsidecar.daemon.peers.server", "HandshakeServer._answer", "entry", 1),
}

#: a read job of the D worker "has the probe" when a descriptor is this small
#: (the probe reads 1 block of 16 KiB, the load 16 contiguous blocks)
SMALL_DESC = 32 << 10

_SITE = '''\
"""Written by benchmarks/tail_stamps.py: per-read timestamps at daemon functions."""
import collections, functools, gc, importlib, inspect, os, signal, sys, time

_OUT = os.environ.get("KVSIDECAR_TAIL_STAMPS")
if _OUT and "serve" in open("/proc/self/cmdline").read().split("\\0"):
    _EV = collections.deque(maxlen=500_000)
    _now = time.monotonic_ns

    import re
    _PROBE_RE = re.compile(rb"PROBE[0-9]+")

    def _rids(x, depth=0):
        if isinstance(x, (bytes, bytearray)):  # a control frame: its claims' ids
            probes = [m.decode() for m in _PROBE_RE.findall(x)]
            n = max(x.count(b"request_id"), len(probes))
            return probes + ["-"] * (n - len(probes))
        req = getattr(x, "req", None)
        if req is None:
            job = getattr(x, "job", None)
            req = getattr(job, "req", None)
        if req is not None:
            return [req.request_id]
        if isinstance(x, (list, tuple)) and depth < 2:
            return [r for y in x[:256] for r in _rids(y, depth + 1)]
        return []

    def _probe(args, at):
        if at is None:
            try:
                data = bytes(args[1][:8192])
            except Exception:
                return None
            return "" if b"PROBE" in data else None
        if at >= len(args):
            return None
        rids = _rids(args[at])
        probes = [r for r in rids if r.startswith("PROBE")]
        return ",".join(probes) + "|%%d" %% len(rids) if probes else None

    def _wrap(label, fn, where, at):
        def stamp(args, t=None):
            tag = _probe(args, at)
            if tag is not None:
                _EV.append((t or _now(), label, tag))
        if inspect.iscoroutinefunction(fn):
            async def wrapped(*a, **k):
                if where == "entry":
                    stamp(a)
                try:
                    return await fn(*a, **k)
                finally:
                    if where == "exit":
                        stamp(a)
        else:
            def wrapped(*a, **k):
                if where == "entry":
                    stamp(a)
                try:
                    return fn(*a, **k)
                finally:
                    if where == "exit":
                        stamp(a)
        return functools.wraps(fn)(wrapped)

    _missing = []
    for _label, (_mod, _path, _where, _at) in %(points)r.items():
        try:
            _owner = importlib.import_module(_mod)
            *_outer, _name = _path.split(".")
            for _part in _outer:
                _owner = getattr(_owner, _part)
            setattr(_owner, _name, _wrap(_label, getattr(_owner, _name), _where, _at))
        except (ImportError, AttributeError):
            _missing.append(_label)

    # every read job of the NIXL worker: start, end, bytes, descriptors, small
    _JOBS = collections.deque(maxlen=500_000)
    try:
        from kvsidecar.daemon.transport import worker as _w
        _do_read = _w.NixlWorker._do_read

        def _timed_read(self, op, fut):
            t0 = _now()
            try:
                return _do_read(self, op, fut)
            finally:
                lens = op.length
                _JOBS.append((t0, _now(), int(sum(lens)), len(lens),
                              int(min(lens) <= %(small)d) if len(lens) else 0))
        _w.NixlWorker._do_read = _timed_read
    except (ImportError, AttributeError):
        _missing.append("worker jobs")

    _GC = collections.deque(maxlen=100_000)
    _gc_t = [0]

    def _gc_cb(phase, info):
        if phase == "start":
            _gc_t[0] = _now()
        else:
            _GC.append((_gc_t[0], _now(), info.get("generation", -1)))
    gc.callbacks.append(_gc_cb)

    def _dump(*_a):
        with open(os.path.join(_OUT, "%%d.txt" %% os.getpid()), "w") as f:
            for m in _missing:
                f.write("missing\\t%%s\\n" %% m)
            for t, label, tag in list(_EV):
                f.write("ev\\t%%d\\t%%s\\t%%s\\n" %% (t, label, tag))
            for j in list(_JOBS):
                f.write("job\\t%%d\\t%%d\\t%%d\\t%%d\\t%%d\\n" %% j)
            for g in list(_GC):
                f.write("gc\\t%%d\\t%%d\\t%%d\\n" %% g)

    signal.signal(signal.SIGUSR2, _dump)
'''


def site_dir(root: Path) -> Path:
    """A directory holding the ``sitecustomize``: put it first on the sidecars'
    ``PYTHONPATH`` with ``KVSIDECAR_TAIL_STAMPS`` naming where logs go."""
    site = root / "tail-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITE % {"points": POINTS, "small": SMALL_DESC})
    return site


class Logs:
    """What one sidecar wrote: probe points by request id, worker jobs, GCs."""

    def __init__(self, path: Path) -> None:
        self.points: dict[str, list[tuple[int, str, int]]] = collections.defaultdict(list)
        self.jobs: list[tuple[int, int, int, int, int]] = []
        self.gcs: list[tuple[int, int, int]] = []
        self.missing: list[str] = []
        self.messages: list[int] = []
        for line in path.read_text().splitlines():
            kind, *f = line.split("\t")
            if kind == "missing":
                self.missing.append(f[0])
            elif kind == "ev":
                t, label, tag = int(f[0]), f[1], f[2]
                if label == "message in":
                    self.messages.append(t)
                    continue
                rids, _, n = tag.partition("|")
                for rid in rids.split(","):
                    self.points[rid].append((t, label, int(n or 1)))
            elif kind == "job":
                a, b, nbytes, ndesc, small = map(int, f)
                self.jobs.append((a, b, nbytes, ndesc, small))
            elif kind == "gc":
                a, b, gen = map(int, f)
                self.gcs.append((a, b, gen))
        self.messages.sort()


def read_logs(out: Path, pid: int) -> Logs | None:
    f = out / f"{pid}.txt"
    return Logs(f) if f.exists() else None


def timeline(d: Logs, rid: str, t0: int, t1: int, p: Logs | None) -> str:
    """One probe read's points on D (µs from the engine's call), the D worker
    jobs and the GCs of either sidecar inside its window."""
    parts = []
    for t, label, n in sorted(d.points.get(rid, [])):
        parts.append(f"{(t - t0) / 1e3:.0f} {label}" + (f" (of {n})" if n > 1 else ""))
    # the message in: the first engine message with a probe after the call
    i = _first_at(d.messages, t0)
    if i < len(d.messages) and d.messages[i] <= t1:
        parts.insert(0, f"{(d.messages[i] - t0) / 1e3:.0f} message in")
    jobs = [j for j in d.jobs if j[1] >= t0 and j[0] <= t1]
    big = sum(j[2] for j in jobs if not j[4])
    small = [j for j in jobs if j[4]]
    note = (f"; D worker: {len(jobs)} read jobs in the window, {big / 2**20:.1f} MiB "
            f"of 16-block reads, {sum(j[1] - j[0] for j in jobs) / 1e3:.0f} µs in them")
    if small:
        note += ", the small one(s) " + ", ".join(
            f"{(j[0] - t0) / 1e3:.0f}-{(j[1] - t0) / 1e3:.0f} ({j[2] // 1024} KiB in "
            f"{j[3]} desc)" for j in small)
    for who, logs in (("D", d), ("P", p)):
        if logs is None:
            continue
        gcs = [g for g in logs.gcs if g[1] >= t0 and g[0] <= t1]
        if gcs:
            note += f"; {who} GC " + ", ".join(f"gen{g[2]} {(g[1] - g[0]) / 1e3:.0f} µs"
                                             for g in gcs)
    return "; ".join(parts) + note


def _first_at(xs: list[int], t: int) -> int:
    return bisect.bisect_left(xs, t)


def offsets(d: Logs, rids: Sequence[str], marks: Sequence[tuple[int, int]]
            ) -> dict[str, list[float]]:
    """Per point, each probe's offset from its engine call (seconds)."""
    out: dict[str, list[float]] = collections.defaultdict(list)
    for rid, (t0, t1) in zip(rids, marks):
        seen: set[str] = set()
        for t, label, _ in sorted(d.points.get(rid, [])):
            if label not in seen:
                seen.add(label)
                out[label].append((t - t0) / 1e9)
        i = _first_at(d.messages, t0)
        if i < len(d.messages) and d.messages[i] <= t1:
            out["message in"].append((d.messages[i] - t0) / 1e9)
        out["engine has it"].append((t1 - t0) / 1e9)
    return out


def table(d: Logs, rids: Sequence[str], marks: Sequence[tuple[int, int]], title: str) -> str:
    """Median offset per point over ``rids``, ordered."""
    offs = offsets(d, rids, marks)
    rows = sorted(offs.items(), key=lambda kv: statistics.median(kv[1]))
    return title + ": " + "; ".join(f"{statistics.median(v) * 1e6:.0f} µs {k} ({len(v)})"
                                    for k, v in rows)


def groups_of(d: Logs, rids: Sequence[str]) -> collections.Counter[int]:
    """How many reads the task of each probe carried."""
    c: collections.Counter[int] = collections.Counter()
    for rid in rids:
        n = next((n for _, label, n in d.points.get(rid, []) if label == "task made"), 0)
        c[n] += 1
    return c


__all__ = ["POINTS", "Logs", "groups_of", "offsets", "read_logs", "site_dir", "table",
           "timeline"]
