"""Every figure of issue #12, each next to its baseline measured in the same run.

Real parts only: ``kvsidecar serve`` processes (real ZMQ, real NIXL/UCX, real
shared memory), engines played by :class:`~kvsidecar.sim.cluster.SimEngine`
over the public client, baselines from bare NIXL agents in two processes
(:mod:`kvsidecar.sim.raw_nixl`). Every received read of the transfer figures
is checked against the oracle, so a fast wrong answer cannot pass as a win.

Each ``bench_*`` function returns :class:`Figure` rows; ``benchmarks/run.py``
runs them and writes ``benchmarks/RESULTS.md``. Sizes come from a
:class:`Scale` (``full``, ``quick``, ``smoke``): the smoke scale only checks
that the benchmarks still run (the test suite uses it) and its numbers mean
nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import re
import resource
import shutil
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvsidecar.daemon.d_side.addresses import build_posts
from kvsidecar.daemon.planner import plan_read
from kvsidecar.daemon.staging import scatter
from kvsidecar.daemon.staging_plan import plan_staging
from kvsidecar.ipc.client import AsyncSidecarClient, HoldSpec, ReadSpec, SidecarClient
from kvsidecar.ipc.layout import Layout, attention_layout, mamba2_hybrid_layout
from kvsidecar.ipc.memory import ENGINE_SHM_PREFIX, allocate_for_layout
from kvsidecar.ipc.protocol import Completion, Completions, Held, Hold, Ok, Poll, Read
from kvsidecar.sim.cluster import Sent, SidecarProcess, SimEngine
from kvsidecar.sim.models import nemotron_like
from kvsidecar.sim.oracle import Request, fill_shard
from kvsidecar.sim.raw_nixl import RawPair, RawReader, raw_latencies, raw_read_seconds

_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Scale:
    name: str
    bulk_mib: int = 256
    bulk_repeats: int = 5
    hetero_requests: int = 12
    hetero_layers: int = 4
    latency_reads: int = 400
    sustained_requests: int = 3000
    sustained_in_flight: int = 64
    cpu_calls: int = 2000
    startup_pages: int = 20_000
    idle_s: float = 10.0


SCALES = {
    "full": Scale("full", bulk_repeats=7, hetero_requests=8, latency_reads=300,
                  sustained_requests=2000, cpu_calls=1000, idle_s=5.0),
    "quick": Scale("quick", bulk_mib=64, bulk_repeats=3, hetero_requests=3, latency_reads=100,
                   sustained_requests=400, cpu_calls=200, startup_pages=5000, idle_s=2.0),
    "smoke": Scale("smoke", bulk_mib=4, bulk_repeats=1, hetero_requests=2, hetero_layers=2,
                   latency_reads=5, sustained_requests=40, sustained_in_flight=8,
                   cpu_calls=20, startup_pages=200, idle_s=0.5),
}


@dataclass
class Figure:
    """One row of RESULTS.md. ``ratio`` is ours over the baseline in the
    direction the target is stated in (see ``ratio_note``)."""

    name: str
    ours: str
    baseline: str = "—"
    ratio: str = "—"
    target: str = "—"
    met: bool | None = None
    notes: list[str] = field(default_factory=list)


# -- helpers -------------------------------------------------------------------------------------

def proc_cpu_s(pid: int) -> float:
    """CPU seconds of a process so far, every thread (ended ones included):
    its CPU clock (the id ``clock_getcpuclockid`` gives in C), one syscall
    exact to the nanosecond, where /proc/<pid>/stat counts 10 ms ticks that
    cannot resolve 0.5 % of a core in a few seconds."""
    return time.clock_gettime((~pid << 3) | 2)  # CPUCLOCK_SCHED of the whole process


#: a daemon's threads by role, from their OS names (daemon/thread_names.py); the
#: event loop is the thread whose id is the pid
_THREAD_ROLES = {"kvs-nixl": "NIXL worker", "kvs-plan": "planning"}


def _threads(pid: int, name: str) -> Iterator[tuple[str, str]]:
    """Each live thread of a sidecar: its role (event loop, NIXL worker,
    planning, other: peer ZMQ I/O, metrics, guards) and the text of its
    ``/proc/<pid>/task/<tid>/<name>`` file; a thread that ended meanwhile is skipped."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/{name}") as f:
                text = f.read()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        yield ("loop" if int(tid) == pid else _THREAD_ROLES.get(comm, "other")), text


def proc_threads_by_role(pid: int) -> dict[str, float]:
    """CPU seconds of a sidecar's threads by role (see :func:`_threads`)."""
    out = {"loop": 0.0, "NIXL worker": 0.0, "planning": 0.0, "other": 0.0}
    for role, text in _threads(pid, "schedstat"):
        out[role] += int(text.split()[0]) / 1e9
    return out


def proc_threads_run_wait(pid: int) -> dict[str, tuple[float, float]]:
    """Per role (as :func:`proc_threads_by_role`): CPU seconds run, and seconds
    spent runnable but waiting for a CPU (schedstat's second field)."""
    out: dict[str, tuple[float, float]] = {}
    for role, text in _threads(pid, "schedstat"):
        run, wait = (int(x) for x in text.split()[:2])
        r0, w0 = out.get(role, (0.0, 0.0))
        out[role] = (r0 + run / 1e9, w0 + wait / 1e9)
    return out


def proc_threads_wakeups(pid: int) -> dict[str, int]:
    """Voluntary context switches of a sidecar's threads by role (as
    :func:`proc_threads_by_role`): how often each went to sleep and was woken.
    A count, not a time, so it is a fair figure of a path's work on a noisy
    host: on this one a wake-up costs tens of microseconds of CPU."""
    out = {"loop": 0, "NIXL worker": 0, "planning": 0, "other": 0}
    for role, text in _threads(pid, "status"):
        out[role] += int(text.split("voluntary_ctxt_switches:")[1].split()[0])
    return out


def wakeups_note(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]],
                 reads: int) -> str:
    """Wake-ups per read by sidecar and thread, from two
    :func:`proc_threads_wakeups` snapshots per sidecar name."""
    parts = []
    for name, b in before.items():
        a = after[name]
        per = ", ".join(f"{role} {(a[role] - b[role]) / reads:.1f}" for role in b
                        if a[role] > b[role])
        parts.append(f"{name}: {per}")
    return ("wake-ups per read by thread (voluntary context switches; the whole window, "
            "untimed engine calls included): " + "; ".join(parts))


class CpuWindow:
    """CPU seconds of this process (every thread: a :class:`Pair`'s engines
    live here) and of the processes ``pids`` (every thread) inside timed
    windows, :meth:`start` to :meth:`stop`, summed over them in
    :attr:`total`. Each edge reads every process's CPU clock once (a
    syscall each, :func:`proc_cpu_s`), this process's last at the start and
    first at the stop, so the window holds only what ran between its edges."""

    def __init__(self, *pids: int) -> None:
        self.pids = pids
        self.total = 0.0
        self._own = self._theirs = 0.0

    def _theirs_now(self) -> float:
        return sum(proc_cpu_s(p) for p in self.pids)

    def start(self) -> None:
        """Open a window: take every process's CPU time now."""
        self._theirs = self._theirs_now()
        self._own = time.process_time()

    def stop(self) -> float:
        """Close the window opened by :meth:`start`: its CPU seconds, also
        added to :attr:`total`."""
        own = time.process_time() - self._own
        spent = own + self._theirs_now() - self._theirs
        self.total += spent
        return spent


def busy_note(cpu_s: float, wall_s: float, reads: int, cores: int) -> tuple[str, float]:
    """How busy the engines' process and the sidecars kept ``cores`` cores in
    a timed window (:class:`CpuWindow`, summed over its parts), and the most
    reads/s their CPU per read allows on those cores (returned too): a rate
    well under it means the cores sat idle part of the window. Pure."""
    cap = cores * reads / max(1e-9, cpu_s)
    return (f"in the timed window the engines' process and both sidecars ran "
            f"{us(cpu_s / max(1, reads))} of CPU a read and kept "
            f"{cpu_s / max(1e-9, wall_s) / cores:.0%} of the {cores} cores busy: even "
            f"with every core busy, at most {cap:,.0f} reads/s"), cap


def host_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole host so far, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]  # idle + iowait
    return (sum(v) - idle) / _TICK, sum(v) / _TICK


def cpu_window_note(before: dict[str, dict[str, tuple[float, float]]],
                    after: dict[str, dict[str, tuple[float, float]]],
                    host0: tuple[float, float], host1: tuple[float, float]
                    ) -> tuple[str, float]:
    """Where the CPU went in a timed window: per sidecar and thread role, what
    ran and what waited for a CPU, and how busy the whole host was (other
    processes included): on 2 shared cores the wait is what a busy host costs.
    Also returns the CPU seconds the sidecars ran in all."""
    parts, waited, ran_all = [], 0.0, 0.0
    for name, roles in after.items():
        ran = []
        for role, (run, wait) in roles.items():
            r0, w0 = before.get(name, {}).get(role, (0.0, 0.0))
            waited += wait - w0
            ran_all += run - r0
            if run - r0 >= 0.0005:
                ran.append(f"{role} {ms(run - r0)}")
        if ran:
            parts.append(f"{name}: {', '.join(ran)}")
    busy, total = host1[0] - host0[0], host1[1] - host0[1]
    note = (f"CPU in the timed window (schedstat): {'; '.join(parts)}; the sidecars' threads "
            f"waited {ms(waited)} in all for a CPU; the host was {busy / total:.0%} busy "
            "(/proc/stat, every process)" if total > 0 else "")
    return note, ran_all


def proc_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def metric(port: int, name: str) -> float:
    """Sum of one sample over all label sets on a sidecar's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def us(x: float) -> str:
    return f"{x * 1e6:,.0f} µs"


def ms(x: float) -> str:
    return f"{x * 1e3:,.1f} ms"


def plus_us(x: float) -> str:
    """``x`` as a difference: "+ 18 µs", or "− 62 µs" when the floor measured higher."""
    return f"{'+' if x >= 0 else '−'} {us(abs(x))}"


#: sidecars whose name starts with a key get these flags (A/B runs in one fleet)
_NAMED_ARGS = {"off-": ["--staging", "off"], "stg-": ["--staging", "auto"],
               "off2-": ["--staging", "off", "--post-lanes", "2"],
               "stg2-": ["--staging", "auto", "--post-lanes", "2"],
               "ln2-": ["--post-lanes", "2"],
               "pt-": ["--nixl-progress-thread-ms", "10"]}


class Fleet:
    """Real sidecar processes shared by the benchmarks of one run (each benchmark
    registers its own engines and deregisters them at the end), started on
    first use and stopped, with their files, by :meth:`close`."""

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="kvs-bench-"))
        self._procs: dict[str, SidecarProcess] = {}

    def __call__(self, names: Sequence[str]) -> list[SidecarProcess]:
        out = []
        for n in names:
            if n not in self._procs:
                # A long engine lease: an engine busy filling or checking 256 MiB on a
                # loaded machine sends nothing for a while, and liveness is not measured.
                extra = next((a for pre, a in _NAMED_ARGS.items() if n.startswith(pre)), [])
                self._procs[n] = SidecarProcess(
                    self.workdir, n,
                    args=["--metrics-port", "0", "--engine-lease", "600", *extra]).start()
            out.append(self._procs[n])
        return out

    def close(self) -> None:
        for p in self._procs.values():
            p.stop()
        self._procs.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def sidecars_of(fleet: Fleet, names: Sequence[str]) -> Iterator[list[SidecarProcess]]:
    yield fleet(names)


def small_attention(tp: int, nb: int) -> Layout:
    """One layer, 16 KiB pages (4 KV heads x 128 x 8 tokens x bf16, K and V)."""
    return attention_layout(model="bench-small", num_layers=1, total_kv_heads=4, head_dim=128,
                            block_tokens=8, tp_size=tp, num_blocks=nb)


def bulk_attention(mib: int) -> Callable[[int, int], Layout]:
    """Four layers, 64 KiB pages; ``mib`` MiB in all with consecutive blocks."""
    del mib
    return lambda tp, nb: attention_layout(model="bench-bulk", num_layers=4, total_kv_heads=8,
                                           head_dim=128, block_tokens=16, tp_size=tp,
                                           num_blocks=nb)


def wait_all(engine: SimEngine, rids: Sequence[str], timeout_s: float = 120.0, *,
             spin: bool = False, pushed: bool = False) -> dict[str, dict[int, Completion]]:
    """Poll until every rank reported every request: with waiting polls (the
    sidecar answers when a completion arrives), or ``spin``ning on empty polls
    (what an engine without protocol minor 4 does; on 2 cores the spinning
    engine takes a core from the sidecars), or on ``poll_nowait`` (``pushed``:
    a poll parked at the sidecar; an empty call sends nothing)."""
    want = set(rids)
    got: dict[str, dict[int, Completion]] = {r: {} for r in want}
    deadline = time.monotonic() + timeout_s
    wait_s = 0.0 if spin else 1.0
    while True:
        for rank, c in enumerate(engine.clients):
            if all(rank in v for v in got.values()):
                continue  # a waiting poll here would sit out wait_s while others have news
            items = (c.poll_nowait(engine.engine_id) if pushed
                     else c.poll(engine.engine_id, wait_s=wait_s))
            for item in items:
                if item.request_id in want:
                    got[item.request_id][rank] = item
        if all(len(v) == engine.tp for v in got.values()):
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"no completion for {sorted(r for r, v in got.items() if not v)}")


def check(engine: SimEngine, got: dict[str, dict[int, Completion]]) -> None:
    """Every completion ``received`` and every byte as the oracle says."""
    for rid, per in got.items():
        kinds = {c.kind for c in per.values()}
        if kinds != {"received"}:
            reasons = {c.reason for c in per.values()}
            raise RuntimeError(f"read {rid}: {kinds} ({reasons})")
        problems = engine.verify(rid)
        if problems:
            raise RuntimeError(f"read {rid}: oracle: {problems[:3]}")


# -- bulk ----------------------------------------------------------------------------------------

def bench_bulk(fleet: Fleet, s: Scale) -> list[Figure]:
    """The bulk figure with D's default --post-lanes 1, then with 2 (the read cut
    in halves, one per lane: reads.split_post), same run."""
    return [*_bulk(fleet, s, 1), *_bulk(fleet, s, 2)]


def _bulk(fleet: Fleet, s: Scale, lanes: int) -> list[Figure]:
    """256 MiB homogeneous tp1 -> tp1, consecutive blocks: engine ``read`` to ``received``,
    each read followed by one raw NIXL READ of the same size between two bare agents
    (alive through the whole loop), so every pair of figures shares its minute of a
    noisy host; the ratio is the median over the pairs."""
    nbytes = s.bulk_mib << 20
    blocks = nbytes // (4 * 65536)
    make = bulk_attention(s.bulk_mib)
    times: list[float] = []
    raws: list[float] = []
    moved = 0
    d_name = "d0" if lanes == 1 else "ln2-d0"
    with sidecars_of(fleet, ["p0", d_name]) as (p0, d0), RawPair(nbytes) as raw_pair:
        raw = RawReader(raw_pair, nbytes)
        raw.once()  # wires the bare agents up
        raw.once()  # the second READ of a fresh pair was a third slower again
        pair = Pair(p0, d0, make, blocks, "bulk" if lanes == 1 else "bulk-lanes")
        P, D = pair.P, pair.D
        inside = _InsideD(d0.metrics_port)
        try:
            # P fills its blocks once (the oracle's bytes) and holds them again for
            # every repeat; D checks the first read against the oracle and the
            # others for their completion (filling and checking 256 MiB is slow).
            first = pair.prefill(blocks * 16)
            for i in range(s.bulk_repeats + 1):  # the first one pays the handshake
                sent = first
                if i:
                    sent = Sent(f"{first.request_id}-{i}", first.remote, first.block_ids,
                                first.req)
                    sent.tokens.append(P.clients[0].hold(P.engine_id, sent.request_id,
                                                         sent.block_ids).token)
                # The raw pair's target polls every 100 µs while awake (~13 % of a
                # core): resting, it leaves the cores to the read it is compared with.
                with raw_pair.resting():
                    t0 = time.perf_counter()
                    D.start_read(sent)
                    got = wait_all(D, [sent.request_id])
                    dt = time.perf_counter() - t0
                    P.wait_for([sent.request_id], timeout_s=60)
                if i == 0:
                    check(D, got)
                elif {c.kind for c in got[sent.request_id].values()} != {"received"}:
                    raise RuntimeError(f"bulk read {i}: {got[sent.request_id]}")
                D.finish(sent.request_id)
                if i:
                    times.append(dt)
                    raws.append(raw.once())
                else:
                    inside.start()
                moved = sum(c.nbytes for c in got[sent.request_id].values())
            where = inside.stop()
        finally:
            pair.close()
    ratio = statistics.median(r / t for r, t in zip(raws, times))
    ours, base = statistics.median(times), statistics.median(raws)
    return [Figure(
        f"bulk {s.bulk_mib} MiB, homogeneous tp1→tp1, consecutive blocks, engine `read` to "
        f"`received`{', D --post-lanes 2 (cut in halves)' if lanes == 2 else ''} "
        f"({s.bulk_repeats} reads, each paired with a raw READ right after it)",
        f"{moved / ours / 1e9:.2f} GB/s (median {ms(ours)}; best {ms(min(times))})",
        f"raw NIXL one READ: {nbytes / base / 1e9:.2f} GB/s (median {ms(base)}; best "
        f"{ms(min(raws))})", f"{ratio:.2f}x (median of the pairs' ratios)",
        "≥ 0.95x", ratio >= 0.95,
        [f"inside the D sidecar (means over the timed reads, from its /metrics): {where}",
         "pairs' ratios: " + ", ".join(f"{r / t:.2f}" for r, t in zip(raws, times))])]


# -- byte verification ---------------------------------------------------------------------------

def bench_verify(fleet: Fleet, s: Scale) -> list[Figure]:
    """The bulk figure with and without byte verification, same run, same
    sidecars: each repeat reads the same held blocks twice, once plain and once
    with ``verify=True`` (the path ``--verify-bytes`` gives every read), in
    alternating order; the ratio is the median of the pairs' ratios."""
    nbytes = s.bulk_mib << 20
    blocks = nbytes // (4 * 65536)
    plain: list[float] = []
    verified: list[float] = []
    cpu: dict[bool, list[float]] = {False: [], True: []}  # both sidecars' CPU per read
    with sidecars_of(fleet, ["p0", "d0"]) as (p0, d0):
        pids = [p.proc.pid for p in (p0, d0) if p.proc is not None]
        pair = Pair(p0, d0, bulk_attention(s.bulk_mib), blocks, "verify")
        P, D = pair.P, pair.D
        try:
            first = pair.prefill(blocks * 16, hold=False)
            before = metric(d0.metrics_port, "kvsidecar_verified_bytes_total")
            for i in range(s.bulk_repeats + 1):  # the first pair pays the handshake
                times = {}
                for verify in ((False, True) if i % 2 else (True, False)):
                    sent = Sent(f"{first.request_id}-{i}-{int(verify)}", first.remote,
                                first.block_ids, first.req)
                    sent.tokens.append(P.clients[0].hold(P.engine_id, sent.request_id,
                                                         sent.block_ids).token)
                    c0 = sum(proc_cpu_s(pid) for pid in pids)
                    t0 = time.perf_counter()
                    D.start_read(sent, verify=verify)
                    got = wait_all(D, [sent.request_id])
                    times[verify] = time.perf_counter() - t0
                    P.wait_for([sent.request_id], timeout_s=60)
                    if i:
                        cpu[verify].append(sum(proc_cpu_s(pid) for pid in pids) - c0)
                    if i == 0:
                        check(D, got)
                    elif {c.kind for c in got[sent.request_id].values()} != {"received"}:
                        raise RuntimeError(f"verify bench read {i}: {got[sent.request_id]}")
                    D.finish(sent.request_id)
                if i:
                    plain.append(times[False])
                    verified.append(times[True])
            hashed = metric(d0.metrics_port, "kvsidecar_verified_bytes_total") - before
        finally:
            pair.close()
    if hashed < nbytes * (s.bulk_repeats + 1):
        raise RuntimeError(f"verified reads hashed {hashed:.0f} B, not every byte they read")
    ratio = statistics.median(v / p for v, p in zip(verified, plain))
    ours, base = statistics.median(verified), statistics.median(plain)
    return [Figure(
        f"bulk {s.bulk_mib} MiB with byte verification (`read(verify=True)`, what "
        f"`--verify-bytes` does to every read), tp1→tp1, engine `read` to `received` "
        f"({s.bulk_repeats} pairs, each read once verified and once not, alternating order)",
        f"{nbytes / ours / 1e9:.2f} GB/s (median {ms(ours)}; best {ms(min(verified))})",
        f"unverified: {nbytes / base / 1e9:.2f} GB/s (median {ms(base)}; best "
        f"{ms(min(plain))})", f"{ratio:.2f}x time (median of the pairs' ratios)",
        "< 1.15x", ratio < 1.15,
        ["pairs' ratios (verified / plain time): "
         + ", ".join(f"{v / p:.2f}" for v, p in zip(verified, plain)),
         f"CPU of both sidecars per read (median; the copy runs in D's NIXL worker, each "
         f"side hashes the {s.bulk_mib} MiB once): plain {ms(statistics.median(cpu[False]))}, "
         f"verified {ms(statistics.median(cpu[True]))}"])]


# -- hetero-TP -----------------------------------------------------------------------------------

def _hetero(fleet: Fleet, s: Scale, p_tp: int, d_tp: int, staging: str,
            lanes: int = 1) -> list[Figure]:
    """One hetero-TP run; ``staging`` is the D sidecars' --staging (off or auto),
    ``lanes`` their --post-lanes (1 or 2)."""
    make = nemotron_like(s.hetero_layers)
    rng = np.random.default_rng(p_tp * 10 + d_tp)
    prompts = [int(x) for x in rng.integers(256, 8192, s.hetero_requests)]
    nb = 3 * (len(prompts) + 1) + 4
    pre = {"off": "off", "auto": "stg"}[staging] + ("2-" if lanes == 2 else "-")
    names = [f"p{i}" for i in range(p_tp)] + [f"{pre}d{i}" for i in range(d_tp)]
    with sidecars_of(fleet, names) as procs:
        ps, ds = procs[:p_tp], procs[p_tp:]
        P = SimEngine(f"bench-h{p_tp}{d_tp}-P", make, p_tp, nb, ps)
        D = SimEngine(f"bench-h{p_tp}{d_tp}-D", make, d_tp, nb, ds)
        try:
            warm = P.prefill("warm", Request(seed=999, prompt_tokens=64))
            D.start_read(warm)
            check(D, wait_all(D, ["warm"]))
            sents: list[Sent] = [P.prefill(f"h-{i}", Request(seed=i, prompt_tokens=n))
                                 for i, n in enumerate(prompts)]
            before = sum(metric(d.metrics_port, "kvsidecar_transfer_descriptors_sum")
                         for d in ds)
            planned0 = sum(metric(d.metrics_port,
                                  "kvsidecar_transfer_descriptors_planned_sum") for d in ds)
            staged0 = sum(metric(d.metrics_port, "kvsidecar_staged_transfers_total")
                          for d in ds)
            wire0 = sum(metric(d.metrics_port, "kvsidecar_transfer_bytes_sum") for d in ds)
            inside = [_InsideD(d.metrics_port) for d in ds]
            for x in inside:
                x.start()
            cpu0 = {x.name: proc_threads_run_wait(x.proc.pid) for x in procs}
            host0 = host_busy()
            t0 = time.perf_counter()
            for sent in sents:
                D.start_read(sent)
            got = wait_all(D, [x.request_id for x in sents])
            elapsed = time.perf_counter() - t0
            cpu_note, cpu_ran = cpu_window_note(
                cpu0, {x.name: proc_threads_run_wait(x.proc.pid) for x in procs}, host0,
                host_busy())
            check(D, got)
            posted = sum(metric(d.metrics_port, "kvsidecar_transfer_descriptors_sum")
                         for d in ds) - before
            planned = sum(metric(d.metrics_port, "kvsidecar_transfer_descriptors_planned_sum")
                          for d in ds) - planned0
            nbytes = sum(c.nbytes for per in got.values() for c in per.values())
            staged = sum(metric(d.metrics_port, "kvsidecar_staged_transfers_total")
                         for d in ds) - staged0
            wire = sum(metric(d.metrics_port, "kvsidecar_transfer_bytes_sum") for d in ds) - wire0
            where = [f"D rank {j}: {x.stop()}" for j, x in enumerate(inside)]
        finally:
            D.close()
            P.close()
    raw_one = raw_read_seconds(nbytes, repeats=2)
    # The scattered descriptors the plan has (what posting without staging costs).
    raw_same = raw_read_seconds(nbytes, repeats=1, descriptors=max(1, int(planned)))
    copy = memcpy_seconds(nbytes)
    gbs = nbytes / elapsed / 1e9
    r1, r2 = raw_one / elapsed, raw_same / elapsed
    # Any hetero plan either posts the scattered descriptors or moves the bytes
    # through a copy (D-side staging and P-side packing alike): on this host it
    # takes at least min(raw_same, raw_one + copy), whatever the sidecar does.
    bound = raw_one / min(raw_same, raw_one + copy)
    # The sidecars' own CPU in the window, spread perfectly over every core, is a
    # floor for the wall time of that run (its copies, scatter, planning, loops).
    cores = os.cpu_count() or 1
    cpu_floor = cpu_ran / cores
    lane_note = ", --post-lanes 2" if lanes == 2 else ""
    label = (f"hetero-TP {p_tp}→{d_tp}, hybrid attention+Mamba2, demo shapes, staging "
             f"{staging}{lane_note} ({s.hetero_requests} requests, {nbytes / 1e6:.0f} MB, "
             f"{posted:,.0f} descriptors posted of {planned:,.0f} planned, {staged:,.0f} "
             "transfers staged)")
    return [
        Figure(label + " vs one READ", f"{gbs:.2f} GB/s ({ms(elapsed)})",
               f"raw NIXL one READ: {nbytes / raw_one / 1e9:.2f} GB/s ({ms(raw_one)})",
               f"{r1:.2f}x",
               f"≥ 0.5x (honest here: 0.3-0.5x; bounds of this run: one thread's copy "
               f"≤ {bound:.2f}x, the sidecars' CPU "
               f"{f'≤ {raw_one / cpu_floor:.2f}x' if cpu_floor > 0 else 'not measured'})",
               r1 >= 0.5,
               [f"bound: any plan posts the scattered descriptors ({ms(raw_same)}) or moves "
                f"the bytes through a copy (one READ {ms(raw_one)} + one memcpy of the "
                f"{nbytes / 1e6:.0f} MB {ms(copy)}, same run): at best {bound:.2f}x of one "
                f"READ on one thread (with --post-lanes 2 two P ranks copy on two threads "
                f"at once, so only the CPU bound below holds)",
                f"bytes on the wire {wire / 1e6:.0f} MB for {nbytes / 1e6:.0f} MB delivered "
                "(staged runs carry the neighbouring ranks' bytes too)",
                *(f"inside {w}" for w in where), cpu_note,
                f"CPU bound of this run: the sidecars ran {ms(cpu_ran)} of CPU in the window, "
                f"at least {ms(cpu_floor)} of wall time on {cores} cores even with nothing else "
                f"running: at best {raw_one / cpu_floor:.2f}x of one READ with this much "
                "work" if cpu_floor > 0 else "CPU bound: not measured"]),
        Figure(label + " vs raw NIXL posting the plan's scattered descriptors",
               f"{gbs:.2f} GB/s ({ms(elapsed)})", f"raw NIXL, {planned:,.0f} equal scattered "
               f"descriptors: {nbytes / raw_same / 1e9:.2f} GB/s ({ms(raw_same)})",
               f"{r2:.2f}x", "≥ 1.0x", r2 >= 1.0),
    ]


#: descriptors per P rank of the raw lanes baseline (about the 2→1 cells' own per scale)
_RAW_LANE_DESCS = {"full": 16_384, "quick": 4096, "smoke": 256}


def bench_hetero(fleet: Fleet, s: Scale) -> list[Figure]:
    """Each shape with staging off and auto, back to back (same run, same minute);
    2→1 also with --post-lanes 2 right after each (1→2 reads one P rank per D
    rank: lanes change nothing there), and raw NIXL posting two P ranks' scattered
    descriptors from one agent vs from two agents on two threads."""
    out = [f for p_tp, d_tp in ((1, 2), (2, 1)) for staging in ("off", "auto")
           for lanes in ((1,) if p_tp < d_tp else (1, 2))
           for f in _hetero(fleet, s, p_tp, d_tp, staging, lanes)]
    import raw_lanes

    descs = _RAW_LANE_DESCS.get(s.name, 4096)
    res = raw_lanes.measure(3, descs, bulk=s.bulk_mib << 20)
    one, two = statistics.median(res["h1"]), statistics.median(res["h2"])
    b1, b2 = statistics.median(res["b1"]), statistics.median(res["b2"])
    return [*out, Figure(
        f"raw NIXL, 2→1 shape: two P processes' transfers of {descs:,} scattered 4 KiB "
        "descriptors each (what --post-lanes parallelises)",
        f"two agents, one thread each, in parallel: {ms(two)}",
        f"one agent posting both, one after the other: {ms(one)}", f"{one / two:.2f}x",
        "table (>1: lanes can gain)", None,
        [f"rounds (alternating, ms): one agent {', '.join(ms(x) for x in res['h1'])}; two "
         f"{', '.join(ms(x) for x in res['h2'])}",
         f"one READ of {s.bulk_mib} MiB: one agent {ms(b1)}, its halves on two agents and "
         f"threads {ms(b2)} ({b1 / b2:.2f}x; --post-lanes cuts a read of 16 MiB or more from "
         "one P rank so)"])]


# -- small reads: latency, throughput, engine CPU ------------------------------------------------

class Pair:
    """A P and a D engine (tp 1) on two real sidecars; P fills its blocks with the
    oracle's bytes and holds them, D reads them and checks them."""

    def __init__(self, p0: SidecarProcess, d0: SidecarProcess,
                 make: Callable[[int, int], Layout], blocks: int, name: str) -> None:
        self.P = SimEngine(f"bench-{name}-P", make, 1, blocks, [p0])
        self.D = SimEngine(f"bench-{name}-D", make, 1, blocks, [d0])
        self.n = 0

    def prefill(self, tokens: int, *, hold: bool = True) -> Sent:
        self.n += 1
        return self.P.prefill(f"r{self.n}", Request(seed=self.n, prompt_tokens=tokens),
                              hold=hold)

    def finish(self, sents: Sequence[Sent], got: dict[str, dict[int, Completion]], *,
               verify: bool = True) -> None:
        """Check what D received, then give both sides their blocks back. P's
        engine waits for its holds to end with waiting polls, as an engine of
        protocol minor 4 does (spinning on empty polls it would keep P's loop
        busy and count as P's CPU per read)."""
        sent = wait_all(self.P, [x.request_id for x in sents], timeout_s=60)
        ended = [c for per in sent.values() for c in per.values() if c.kind != "sent"]
        if ended:
            raise RuntimeError(f"hold {ended[0].request_id}: {ended[0].kind} ({ended[0].reason})")
        if verify:
            check(self.D, got)
        else:
            bad = [c for per in got.values() for c in per.values() if c.kind != "received"]
            if bad:
                raise RuntimeError(f"read {bad[0].request_id}: {bad[0].kind} ({bad[0].reason})")
        for x in sents:
            self.D.finish(x.request_id)
            self.P.free(x.block_ids)

    def timed_read(self, *, verify: bool = True, spin: bool = False, pushed: bool = False,
                   cpu: CpuWindow | None = None) -> tuple[int, int, float]:
        """One 1-block read (8 tokens), engine ``read`` to ``received`` (waiting
        polls, or as :func:`wait_all`'s ``spin`` / ``pushed`` say), then both
        sides' blocks given back (:meth:`finish`, its bytes checked if
        ``verify``): the read's start and end on ``time.monotonic_ns()``, the
        system-wide clock the sidecars' own stamps use (hop_timeline.py), and
        the CPU seconds ``cpu`` counted in between (nan without it)."""
        sent = self.prefill(8)
        if cpu is not None:
            cpu.start()
        t0 = time.monotonic_ns()
        self.D.start_read(sent)
        got = wait_all(self.D, [sent.request_id], spin=spin, pushed=pushed)
        t1 = time.monotonic_ns()
        spent = cpu.stop() if cpu is not None else math.nan
        self.finish([sent], got, verify=verify)
        return t0, t1, spent

    def close(self) -> None:
        self.D.close()
        self.P.close()


def memcpy_seconds(nbytes: int, repeats: int = 3) -> float:
    """Best time of one numpy copy of ``nbytes`` between two faulted-in buffers:
    what moving the bytes through a local copy costs on this host."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    dst[:] = 2  # written: faulted in, as prefault leaves engine memory
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


class _InsideD:
    """Where a read's time goes inside the D sidecar, from its histograms' sums."""

    NAMES = {"accepted → posted (link, plan, lease claim)": "kvsidecar_read_queue_seconds",
             "lease claim round trip": "kvsidecar_lease_claim_seconds",
             "post call": "kvsidecar_transfer_post_seconds",
             "post → done": "kvsidecar_transfer_seconds",
             "done → scattered (staged reads)": "kvsidecar_scatter_seconds",
             "accepted → completion queued": "kvsidecar_read_seconds"}

    #: reads posted during their lease claim (their claim is no part of accepted → posted)
    DURING = "kvsidecar_reads_posted_during_claim_total"

    def __init__(self, port: int) -> None:
        self.port = port
        self._t0: dict[str, tuple[float, float]] = {}
        self._during0 = 0.0

    def _read(self) -> dict[str, tuple[float, float]]:
        return {k: (metric(self.port, f"{m}_sum"), metric(self.port, f"{m}_count"))
                for k, m in self.NAMES.items()}

    def start(self) -> None:
        self._t0 = self._read()
        self._during0 = metric(self.port, self.DURING)

    def stop(self) -> str:
        self.means = {}
        self.posted_during_claim = metric(self.port, self.DURING) - self._during0
        for k, (s1, c1) in self._read().items():
            s0, c0 = self._t0[k]
            if c1 > c0:
                self.means[self.NAMES[k]] = (s1 - s0) / (c1 - c0)
        return "; ".join(f"{k} {us(self.means[m])}" for k, m in self.NAMES.items()
                         if m in self.means)

    means: dict[str, float] = {}
    posted_during_claim = 0.0


def _cycle_cpu_note(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
                    engine_s: float, wall_s: float, reads: int) -> str:
    """CPU per read cycle (P's fill and hold, D's read, both engines' polls and
    frees) by sidecar thread and for the engine process, against the cycle's
    wall time: how much of the host's cores one read keeps busy."""
    parts, total = [], engine_s
    for name, b in before.items():
        total += sum(after[name][r] - b[r] for r in b)
        parts.append(f"{name} {_per_read(b, after[name], reads)}")
    cores = os.cpu_count() or 1
    return (f"CPU per read cycle (P's fill and hold, the read, both engines' polls and frees; "
            f"schedstat): {'; '.join(parts)}; the engine process {us(engine_s / reads)}; in "
            f"all {us(total / reads)} of CPU in a cycle of {us(wall_s / reads)} wall time: "
            f"{total / wall_s / cores:.0%} of this host's {cores} cores")


#: the idle time before each round trip of the hop table's second floors: about
#: what a read's messages find, coming after the rest of a 1-block read's cycle
IDLE_FLOOR_S = 0.002


def _hop_table(total: float, inside: dict[str, float], raw50: float, n: int,
               during: bool = False) -> list[str]:
    """One note per hop of a 1-block read: the sidecars' time there (means over
    the run's waiting-poll reads, from D's /metrics) next to that hop's floor,
    measured bare in this run (p50, :mod:`floors`). ``during``: the reads
    posted during their lease claim (sent just before the post), so the
    claim is no part of accepted → posted and runs beside post → done, which
    mostly waits for it too: P's worker answers the READ's closing flush once
    the grant woke it."""
    import floors

    def floor(xs: list[float]) -> str:
        return f"{us(pct(xs, 50))} p50 ({us(pct(xs, 99))} p99)"

    unix, zblock = floors.unix_rtts(n), floors.zmq_curve_rtts(n)
    zloop, hand = floors.zmq_curve_rtts(n, on_loop=True), floors.loop_thread_rtts(n)
    # a read's messages come after the rest of its cycle (about 2 ms here),
    # and a hop that wakes a thread idle that long costs more than back to back
    unix_idle = floors.unix_rtts(n, idle_s=IDLE_FLOOR_S)
    zloop_idle = floors.zmq_curve_rtts(n, on_loop=True, idle_s=IDLE_FLOOR_S)
    idle = f"after {IDLE_FLOOR_S * 1e3:g} ms idle"
    queued = inside.get("kvsidecar_read_queue_seconds", float("nan"))
    claim = inside.get("kvsidecar_lease_claim_seconds", float("nan"))
    done = inside.get("kvsidecar_transfer_seconds", float("nan"))
    read = inside.get("kvsidecar_read_seconds", float("nan"))
    claim_hop = (f"{us(claim)}, sent just before the post (the read posts during its "
                 f"claim) and in parallel with post → done below: the read completes once "
                 f"both are in" if during else f"{us(claim)}, awaited before the post")
    return [
        "hop table (sidecar: means of this run; floor: the same hop bare, same run): "
        f"engine channel, read in + completion out, and the read task's start (engine "
        f"total − D's read task → completion queued): {us(total - read)} | floor one "
        f"AF_UNIX SEQPACKET round trip between two processes {floor(unix)} ({idle}: "
        f"{floor(unix_idle)})",
        f"hop table: lease claim D → P → D: {claim_hop} | floor one ZMQ DEALER/ROUTER "
        f"round trip over tcp with CURVE between two event loops {floor(zloop)} "
        f"({idle}: {floor(zloop_idle)}; both sides blocking: {floor(zblock)})",
        "hop table: rest of accepted → posted (read task start, link lookup, "
        + ("the claim's send, " if during else "")
        + f"planning on the loop, post hand-off): {us(queued - (0.0 if during else claim))}"
        f" | floor: none measured",
        f"hop table: post → done (post call; P's worker answering the endpoint flush "
        f"NIXL ends a transfer with, which it does once the claim's grant woke it; D's "
        f"worker polling): {us(done)} | floor raw NIXL post + completion + notification "
        f"with both sides spinning {us(raw50)} p50",
        f"hop table: posted → completion queued less post → done (≈; hand-off to the "
        f"NIXL worker thread, descriptor lists, its hand-off back, lease check, "
        f"completion): {us(read - queued - done)} | floor one loop → thread → loop "
        f"round trip (a post's way in plus its completion's way out) {floor(hand)}",
    ]


def bench_latency(fleet: Fleet, s: Scale) -> list[Figure]:
    """One 16 KiB block, engine ``read`` to ``received``: the engine waits with
    waiting polls (the headline) and, in the same run, spinning on empty polls,
    and spinning on ``poll_nowait`` (completions pushed to a parked poll)."""
    lat: dict[str, list[float]] = {"wait": [], "spin": [], "pushed": []}
    window_cpu: list[float] = []  # CPU in each waiting read's window (all processes)
    with sidecars_of(fleet, ["p0", "d0"]) as (p0, d0):
        assert p0.proc is not None and d0.proc is not None
        pair = Pair(p0, d0, small_attention, 8, "lat")
        cpu_win = CpuWindow(d0.proc.pid, p0.proc.pid)
        inside = _InsideD(d0.metrics_port)
        wake0: dict[str, dict[str, int]] = {}
        cpu0: dict[str, dict[str, float]] = {}
        woke = busy = ""
        cycle0 = eng0 = 0.0
        try:
            for mode in lat:
                spin = mode != "wait"
                for i in range(s.latency_reads + 5):
                    t0, t1, spent = pair.timed_read(spin=spin, pushed=mode == "pushed",
                                                    cpu=None if spin else cpu_win)
                    if i == 4 and not spin:
                        inside.start()
                        wake0 = {"D": proc_threads_wakeups(d0.proc.pid),
                                 "P": proc_threads_wakeups(p0.proc.pid)}
                        cpu0 = {"D": proc_threads_by_role(d0.proc.pid),
                                "P": proc_threads_by_role(p0.proc.pid)}
                        cycle0, eng0 = time.perf_counter(), time.process_time()
                    if i >= 5:
                        lat[mode].append((t1 - t0) / 1e9)
                        if not spin:
                            window_cpu.append(spent)
                if not spin:
                    where = inside.stop()
                    woke = wakeups_note(wake0, {"D": proc_threads_wakeups(d0.proc.pid),
                                                "P": proc_threads_wakeups(p0.proc.pid)},
                                        s.latency_reads)
                    busy = _cycle_cpu_note(cpu0, {"D": proc_threads_by_role(d0.proc.pid),
                                                  "P": proc_threads_by_role(p0.proc.pid)},
                                           time.process_time() - eng0,
                                           time.perf_counter() - cycle0, s.latency_reads)
        finally:
            pair.close()
    raw = raw_latencies(16384, s.latency_reads)
    p50, p99, r50, r99 = pct(lat["wait"], 50), pct(lat["wait"], 99), pct(raw, 50), pct(raw, 99)
    s50, s99 = pct(lat["spin"], 50), pct(lat["spin"], 99)
    n50, n99 = pct(lat["pushed"], 50), pct(lat["pushed"], 99)
    hops = _hop_table(statistics.fmean(lat["wait"]), inside.means, r50, s.latency_reads,
                      during=inside.posted_during_claim >= s.latency_reads / 2)
    cores = os.cpu_count() or 1
    floor_p50 = statistics.median(window_cpu) / cores
    return [Figure(f"1-block (16 KiB) read latency p50 / p99 ({s.latency_reads} reads, "
                   "engine `read` to `received`, waiting poll)",
                   f"{us(p50)} / {us(p99)}",
                   f"raw NIXL post + completion + notification: {us(r50)} / {us(r99)}",
                   f"p50 raw + {us(p50 - r50)}",
                   f"p50 ≤ 500 µs and p99 ≤ 2 ms (bound here: a read's window ran "
                   f"{us(statistics.median(window_cpu))} of CPU, the engines' and both "
                   f"sidecars', so at least {us(floor_p50)} spread over {cores} cores; the "
                   f"hops' floors in the notes)",
                   p50 <= 500e-6 and p99 <= 2e-3,
                   [f"inside the D sidecar (means from its /metrics, waiting polls): {where}",
                    woke, busy,
                    f"the same reads with the engine spinning on empty polls instead (same "
                    f"run): p50 {us(s50)}, p99 {us(s99)}; spinning on `poll_nowait` (the "
                    f"completion pushed to a poll parked at D's sidecar; an empty call sends "
                    f"nothing): p50 {us(n50)}, p99 {us(n99)}", *hops])]


#: how the sustained rows' D engine sends its reads: one blocking ``read`` call per
#: read; one ``read_nowait`` per read (the blocking client sends each and takes
#: the answers later); one ``read`` message per read, the round's all sent before any reply is
#: awaited (the async client, as an asyncio engine issuing a step's reads at once);
#: ``read_many`` messages of 16 (and P's engine ``hold_many``), waiting for each
#: answer or not. P's engine holds with ``hold`` each, except where D's reads go
#: without waiting (``hold_nowait``, its own tokens) or in batches (``hold_many``,
#: without waiting where D's are)
_SENDING = {
    "one": "one `read` (and P's `hold`) each",
    "nowait": "one `read_nowait` each, the blocking client not waiting for the answers (and "
              "P's `hold_nowait` each)",
    "at_once": "one `read` message each, the round's sent at once through the async client "
               "(and P's `hold` each)",
    "many": "16 per `read_many` (and P's `hold_many`) message",
    "many_nowait": "16 per `read_many_nowait` (and P's `hold_many_nowait`) message, the "
                   "blocking client not waiting for the answers",
}


#: D + P sidecar CPU per read, one `read` per message, in RESULTS.md at 119a526
#: (D 635 µs, P 285 µs): issue #31 asks for it at least halved
_CPU_119A526 = 920e-6


def bench_sustained(fleet: Fleet, s: Scale) -> list[Figure]:
    """16-block reads, ``sustained_in_flight`` at a time, on one D sidecar, sent
    each way of :data:`_SENDING` in turn (same run, same sidecars)."""
    k, window, per_msg = 16, s.sustained_in_flight, 16
    rows = []
    with sidecars_of(fleet, ["p0", "d0"]) as (p0, d0):
        assert p0.proc is not None and d0.proc is not None
        pair = Pair(p0, d0, small_attention, k * window, "sus")
        loop = asyncio.new_event_loop()
        at_once = [AsyncSidecarClient(d0.socket, timeout_s=30)]
        try:
            warm = pair.prefill(8 * k)
            pair.D.start_read(warm)
            pair.finish([warm], wait_all(pair.D, [warm.request_id]))
            for sending, how in _SENDING.items():
                batched = sending.startswith("many")
                wait = sending != "many_nowait"
                done, elapsed, issuing = 0, 0.0, 0.0
                calls: list[float] = []  # each blocking `read`'s wall time ("one")
                tails = 0.0  # from a round's last call until all of it was received
                cpu_win = CpuWindow(d0.proc.pid, p0.proc.pid)
                c_d, c_p = proc_cpu_s(d0.proc.pid), proc_cpu_s(p0.proc.pid)
                r_d, r_p = proc_threads_by_role(d0.proc.pid), proc_threads_by_role(p0.proc.pid)
                wake0 = {"D": proc_threads_wakeups(d0.proc.pid),
                         "P": proc_threads_wakeups(p0.proc.pid)}
                while done < s.sustained_requests:
                    n = min(window, s.sustained_requests - done)
                    # P fills and holds the round first (not timed: that is P's engine);
                    # batched, P's engine holds them as D's reads them, 16 per message;
                    # without waiting, with its own tokens
                    own = batched or sending == "nowait"
                    sents = [pair.prefill(8 * k, hold=not own) for _ in range(n)]
                    if batched:
                        for i in range(0, n, per_msg):
                            pair.P.hold_many(sents[i:i + per_msg], wait=wait)
                    elif own:
                        pair.P.hold_nowait(sents)
                    cpu_win.start()
                    t0, e0 = time.perf_counter(), time.process_time()
                    if batched:
                        for i in range(0, n, per_msg):
                            pair.D.start_reads(sents[i:i + per_msg], wait=wait)
                    elif sending == "at_once":
                        loop.run_until_complete(pair.D.start_reads_at_once(at_once, sents))
                    elif sending == "nowait":
                        pair.D.start_reads_nowait(sents)
                    else:
                        for sent in sents:
                            c0 = time.perf_counter()
                            pair.D.start_read(sent)
                            calls.append(time.perf_counter() - c0)
                    issuing += time.process_time() - e0
                    t1 = time.perf_counter()
                    got = wait_all(pair.D, [x.request_id for x in sents])
                    elapsed += time.perf_counter() - t0
                    tails += time.perf_counter() - t1
                    cpu_win.stop()
                    pair.finish(sents, got, verify=done == 0)
                    done += n
                d_cpu = proc_cpu_s(d0.proc.pid) - c_d
                p_cpu = proc_cpu_s(p0.proc.pid) - c_p
                t_d, t_p = proc_threads_by_role(d0.proc.pid), proc_threads_by_role(p0.proc.pid)
                by_d, by_p = _per_read(r_d, t_d, done), _per_read(r_p, t_p, done)
                woke = wakeups_note(wake0, {"D": proc_threads_wakeups(d0.proc.pid),
                                            "P": proc_threads_wakeups(p0.proc.pid)}, done)
                rate = done / elapsed
                # what the daemons' CPU alone allows on this machine's cores, and
                # what the busier event loop allows on one thread (its work is serial)
                ceiling = (os.cpu_count() or 1) * done / max(1e-9, d_cpu + p_cpu)
                loops = {"D": t_d["loop"] - r_d["loop"], "P": t_p["loop"] - r_p["loop"]}
                busiest = max(loops, key=lambda who: loops[who])
                loop_cap = done / max(1e-9, loops[busiest])
                raw = _raw_read_cpu(k, per_msg if batched else 1, 64 * per_msg)
                goal = 8000 if batched else 3000
                # issue #31's other target for this row: D + P CPU per read at least
                # halved from 119a526's RESULTS.md (D 635 + P 285 µs, one per message)
                halved = (f"; D + P CPU per read at least halved: ≤ {us(_CPU_119A526 / 2)} "
                          f"(119a526: {us(_CPU_119A526)}), here {us((d_cpu + p_cpu) / done)}"
                          if sending == "one" else "")
                cpu_ok = sending != "one" or (d_cpu + p_cpu) / done <= _CPU_119A526 / 2
                busy, cap = busy_note(cpu_win.total, elapsed, done, os.cpu_count() or 1)
                waits = [_caller_note(calls, tails, done, loops["D"] / done)] if calls else []
                rows.append(Figure(
                    f"sustained 16-block (256 KiB) reads, {window} in flight, one D sidecar, "
                    f"{how} ({done} reads)",
                    f"{rate:,.0f} reads/s; daemon CPU per read: D {us(d_cpu / done)}, "
                    f"P {us(p_cpu / done)}",
                    f"bare NIXL in one process, CPU per read: {us(raw)} "
                    f"({per_msg if batched else 1} per READ)", "—",
                    f"≥ {goal:,} reads/s (bounds here: the daemons' CPU per read caps "
                    f"{os.cpu_count()} cores at {ceiling:,.0f}/s; {busiest}'s event loop, "
                    f"one thread, {us(loops[busiest] / done)} a read, at {loop_cap:,.0f}/s; "
                    f"the timed window's CPU, the engines' included, at {cap:,.0f}/s)"
                    + halved,
                    rate >= goal and cpu_ok,
                    ["rounds of the window: the engine posts a round, then waits (waiting "
                     "polls) until all of it is received; P's fills and holds are not timed; "
                     "daemon CPU covers the whole run (untimed holds included)",
                     f"daemon CPU per read by thread (schedstat): D {by_d}; P {by_p}",
                     woke,
                     busy + (" (P's holds are not in it: its engine awaited them before)"
                             if sending in ("one", "at_once", "many") else
                             " (P's holds, sent without waiting just before it, partly)"),
                     f"the engine's CPU issuing the reads (D's engine process, the calls "
                     f"alone): {us(issuing / done)} per read",
                     "baseline: one process posts the same reads' descriptors with bare NIXL "
                     "(reads of one `read_many` as one READ with one notification, as the D "
                     "sidecar merges them) and polls each to DONE: the CMA copy and NIXL's own "
                     "cost, what any design pays per read on D", *waits]))
            rows.append(_sustained_sliding(pair, d0, p0, s, k, window, per_msg))
        finally:
            for client in at_once:
                loop.run_until_complete(client.close())
            loop.close()
            pair.close()
    return rows


def _caller_note(calls: Sequence[float], tails_s: float, reads: int,
                 d_loop_s: float) -> str:
    """Where one engine thread issuing blocking ``read`` calls spends the
    window: it sends the next only once D answered the last, so its rate is
    one over the calls' mean wall time plus each round's tail (its last reads
    still moving), however idle the cores. Pure."""
    mean = statistics.mean(calls)
    tail = tails_s / max(1, reads)
    return (f"one caller, one blocking `read` at a time: each call took p50 "
            f"{us(statistics.median(calls))}, p90 {us(pct(calls, 90))}, mean {us(mean)} "
            f"(its answer waits for D's event loop, which ran {us(d_loop_s)} of CPU a read "
            f"in the run, the round's earlier reads among it), and each round's last reads "
            f"took {us(tail)} "
            f"a read more: {1 / max(1e-9, mean + tail):,.0f} reads/s from this caller "
            f"however idle the cores; `read_nowait` and the async client do not wait for "
            f"the answers (rows below)")


def _sustained_sliding(pair: Pair, d0: SidecarProcess, p0: SidecarProcess, s: Scale,
                       k: int, window: int, per_msg: int) -> Figure:
    """Batched reads with the window kept full: a message of ``per_msg`` reads
    goes (P's engine holds them, D's engine reads them, one message each) as
    soon as the previous one in its slot was received, instead of rounds that
    wait for their slowest read. What the daemons sustain, without the
    rounds' bubble. P's blocks are filled once per slot with the oracle's
    bytes and held again under each new request id (no engine fill in the
    window); D's blocks are handed back unpoisoned (the engine's own work,
    not the sidecars', once the first message of each slot was checked
    against the oracle)."""
    assert d0.proc is not None and p0.proc is not None
    P, D = pair.P, pair.D
    per = min(per_msg, window)
    slots = max(1, window // per)
    base = [[pair.prefill(8 * k, hold=False) for _ in range(per)] for _ in range(slots)]
    slot_of: dict[str, int] = {}
    left = [0] * slots
    issued = done = 0
    checked: set[int] = set()

    def issue(slot: int) -> None:
        nonlocal issued
        sents = [Sent(f"w{issued}-{i}", x.remote, x.block_ids, x.req)
                 for i, x in enumerate(base[slot])]
        issued += 1
        P.hold_many(sents)
        D.start_reads(sents)
        for x in sents:
            slot_of[x.request_id] = slot
        left[slot] = len(sents)

    for slot in range(slots):
        issue(slot)
    dc, pc = D.clients[0], P.clients[0]
    deadline = time.monotonic() + 300
    # Timed from when the first message of every slot was received and checked
    # (the oracle's check is the benchmark's work, not the sidecars').
    timed = False
    c_d = c_p = t0 = 0.0
    cpu_win = CpuWindow(d0.proc.pid, p0.proc.pid)
    r_d: dict[str, float] = {}
    r_p: dict[str, float] = {}
    while done < s.sustained_requests:
        for c in dc.poll(D.engine_id, wait_s=1.0):
            if c.kind != "received":
                raise RuntimeError(f"read {c.request_id}: {c.kind} ({c.reason})")
            slot = slot_of.pop(c.request_id)
            if not timed:  # the oracle's check wants every other block poisoned
                problems = D.verify(c.request_id)
                if problems:
                    raise RuntimeError(f"read {c.request_id}: {problems[0]}")
                D.finish(c.request_id)
            else:
                D.release_blocks(D.receiving.pop(c.request_id).block_ids)
                done += 1
            left[slot] -= 1
            if left[slot] == 0:
                checked.add(slot)
                pc.poll(P.engine_id)  # P's engine takes its holds' outcomes
                if timed:
                    if done + len(slot_of) < s.sustained_requests:
                        issue(slot)
                elif len(checked) == slots:  # every slot checked: the window starts
                    timed = True
                    c_d, c_p = proc_cpu_s(d0.proc.pid), proc_cpu_s(p0.proc.pid)
                    r_d = proc_threads_by_role(d0.proc.pid)
                    r_p = proc_threads_by_role(p0.proc.pid)
                    cpu_win.start()
                    t0 = time.perf_counter()
                    for every in range(slots):
                        issue(every)
        if time.monotonic() > deadline:
            raise TimeoutError(f"sliding window: {done} of {s.sustained_requests} received")
    elapsed = time.perf_counter() - t0
    cpu_win.stop()
    busy, cap = busy_note(cpu_win.total, elapsed, done, os.cpu_count() or 1)
    for rid in list(slot_of):  # reads past the count: let them land, untimed
        D.wait_for([rid], timeout_s=60)
        D.release_blocks(D.receiving.pop(rid).block_ids)
    d_cpu = proc_cpu_s(d0.proc.pid) - c_d
    p_cpu = proc_cpu_s(p0.proc.pid) - c_p
    by_d = _per_read(r_d, proc_threads_by_role(d0.proc.pid), done)
    by_p = _per_read(r_p, proc_threads_by_role(p0.proc.pid), done)
    for sents in base:
        for x in sents:
            P.free(x.block_ids)
    ceiling = (os.cpu_count() or 1) * done / max(1e-9, d_cpu + p_cpu)
    rate = done / elapsed
    return Figure(
        f"sustained 16-block (256 KiB) reads, {window} in flight kept full, one D sidecar, "
        f"{per} per `read_many` (and P's `hold_many`) message ({done} reads)",
        f"{rate:,.0f} reads/s; daemon CPU per read: D {us(d_cpu / done)}, P {us(p_cpu / done)}",
        "— (the rounds above, same run)", "—",
        f"≥ 8,000 reads/s (bound here: the daemons' CPU per read caps "
        f"{os.cpu_count()} cores at {ceiling:,.0f}/s; the timed window's CPU, the engines' "
        f"and P's holds included, at {cap:,.0f}/s)", rate >= 8000,
        ["a new message of reads leaves as soon as the previous one in its slot was "
         "received (no rounds); P's holds and D's reads are both in the timed window; "
         "P's blocks were filled once, D's are handed back without poisoning once "
         "the first message of every slot was checked against the oracle",
         f"daemon CPU per read by thread (schedstat): D {by_d}; P {by_p}", busy])


def _per_read(before: dict[str, float], after: dict[str, float], reads: int) -> str:
    return ", ".join(f"{role} {us((after[role] - before[role]) / reads)}" for role in before
                     if after[role] - before[role] > 0)


def _raw_read_cpu(blocks: int, per_transfer: int, reads: int) -> float:
    """CPU seconds per read of bare NIXL reading ``blocks`` scattered 16 KiB
    pages per read, ``per_transfer`` reads as one READ with one notification,
    in this process (the CMA copy is this process's time); polled to DONE every
    50 µs as the sidecar's worker does, not spinning (the end of a transfer
    waits for the peer's progress: a spin would count that wait as CPU)."""
    page, slots = 16384, 1024
    rng = np.random.default_rng(0)
    with RawPair(page * slots) as pair:
        n = blocks * per_transfer
        tables = [(pair.table(pair.region.address, rng.permutation(slots)[:n], page),
                   pair.table(pair.remote_addr, rng.permutation(slots)[:n], page))
                  for _ in range(4)]
        transfers = max(1, reads // per_transfer)
        cpu0 = time.process_time()
        for i in range(transfers):
            loc, far = tables[i % len(tables)]
            h = pair.agent.initialize_xfer("READ", pair.agent.get_xfer_descs(loc, "DRAM"),
                                           pair.agent.get_xfer_descs(far, "DRAM"), pair.peer,
                                           b"n" * 40 * per_transfer)
            state = pair.agent.transfer(h)
            while state not in ("DONE", "ERR"):
                time.sleep(50e-6)
                state = pair.agent.check_xfer_state(h)
            pair.agent.release_xfer_handle(h)
            if state == "ERR":
                raise RuntimeError("raw NIXL transfer failed")
        return (time.process_time() - cpu0) / (transfers * per_transfer)


def _inprocess_read_cpu(calls: int) -> float:
    """CPU seconds per call an in-process engine spends planning and posting one
    16-block read and polling it to completion (bare NIXL, same layout)."""
    L = small_attention(1, 64)
    with RawPair(L.region_bytes) as pair:
        ids = np.arange(16, dtype=np.int64)
        cpu0 = time.process_time()
        for i in range(calls):
            plan = plan_read(L, 0, L, [(ids * 3 + i) % 64], [(ids * 5 + i) % 64], check=False)
            rr = plan.reads[0]
            loc = np.stack([pair.region.address + rr.local_offset, rr.length,
                            np.zeros_like(rr.length)], 1)
            far = np.stack([pair.remote_addr + rr.remote_offset, rr.length,
                            np.zeros_like(rr.length)], 1)
            h = pair.agent.initialize_xfer("READ", pair.agent.get_xfer_descs(loc, "DRAM"),
                                           pair.agent.get_xfer_descs(far, "DRAM"), pair.peer,
                                           b"n")
            pair.finish(h)
        return (time.process_time() - cpu0) / calls


def bench_engine_cpu(fleet: Fleet, s: Scale) -> list[Figure]:
    """Engine CPU per ``read`` / ``hold`` / ``poll`` call of the public (sync) client,
    as CLOCK_PROCESS_CPUTIME_ID of this process (all its threads; the client has
    no I/O thread of its own)."""
    import floors

    k, slots, batch = 16, 4, 16
    with sidecars_of(fleet, ["p0", "d0"]) as (p0, d0):
        pair = Pair(p0, d0, small_attention, k * batch, "cpu")
        P, D = pair.P, pair.D
        pc, dc = P.clients[0], D.clients[0]
        try:
            warm = pair.prefill(8 * k)
            D.start_read(warm)
            pair.finish([warm], wait_all(D, [warm.request_id]))
            #: each request's hold token, from its hold to its read
            tokens: dict[str, str] = {}
            #: per single_calls tag: wall seconds of its polls that returned completions
            poll_walls: dict[str, float] = {}
            hold_walls: dict[str, float] = {}  # each tag's `hold` calls' wall time

            def p_hold(rid: str, ids: list[int]) -> None:
                tokens[rid] = pc.hold(P.engine_id, rid, [ids], readers=1).token

            def d_read(rid: str, ids: list[int]) -> None:
                dc.read(D.engine_id, rid, [ids], P.remote, [ids], remote_request_id=rid,
                        remote_tokens=[tokens.pop(rid)])

            def single_calls(tag: str, rounds: int, hold: Callable[[str, list[int]], object],
                             read: Callable[[str, list[int]], object],
                             poll: Callable[[], list[Completion]], fill: bool = True
                             ) -> tuple[float, float, float, float, int, int]:
                """Rounds of `slots` holds (each right after its blocks' fill), as many
                reads, a 3 ms sleep and polls until all is read: the CPU of each
                call. Returns hold, read and poll-with-completions CPU in all, the
                reads' wall time, and how many polls returned how many items."""
                hold_cpu = read_cpu = poll_full = read_wall = 0.0
                n_full = n_items = 0
                for r in range(rounds):
                    rids = [f"{tag}{r}-{j}" for j in range(slots)]
                    for j, rid in enumerate(rids):
                        ids = list(range(j * k, (j + 1) * k))
                        if fill:
                            fill_shard(P.buffers[0], P.layout, 0, [ids],
                                       Request(seed=j, prompt_tokens=8 * k))
                        c0, w0 = time.process_time(), time.perf_counter()
                        hold(rid, ids)
                        hold_cpu += time.process_time() - c0
                        hold_walls[tag] = hold_walls.get(tag, 0.0) + time.perf_counter() - w0
                    for j, rid in enumerate(rids):
                        ids = list(range(j * k, (j + 1) * k))
                        c0, w0 = time.process_time(), time.perf_counter()
                        read(rid, ids)
                        read_cpu += time.process_time() - c0
                        read_wall += time.perf_counter() - w0
                    time.sleep(0.003)  # let the round finish, so one poll returns all of it
                    want = set(rids)
                    while want:
                        c0, w0 = time.process_time(), time.perf_counter()
                        items = poll()
                        dt = time.process_time() - c0
                        if items:
                            poll_walls[tag] = (poll_walls.get(tag, 0.0)
                                               + time.perf_counter() - w0)
                            poll_full += dt
                            n_full += 1
                            n_items += len(items)
                        for c in items:
                            if c.kind != "received":
                                raise RuntimeError(f"read {c.request_id}: {c.kind} ({c.reason})")
                            want.discard(c.request_id)
                    P.wait_for(rids, timeout_s=60)
                return hold_cpu, read_cpu, poll_full, read_wall, n_full, n_items

            rounds = max(1, s.cpu_calls // slots)
            hold_cpu, read_cpu, poll_full, read_wall, n_full, n_items = single_calls(
                "c", rounds, p_hold, d_read, lambda: dc.poll(D.engine_id))
            # What bounds the client (same run, same conditions): the same calls made
            # by floors.MinimalCaller (no client: build, encode, send, receive, decode),
            # and the client's holds without the fill before each.
            rounds_x = min(rounds, 100)
            with floors.MinimalCaller(p0.socket) as mp_, floors.MinimalCaller(d0.socket) as md:
                mids = itertools.count(1 << 40)
                acks: list[tuple[str, int | None]] = [("", None)]

                def min_hold(rid: str, ids: list[int]) -> object:
                    held = floors.expect(mp_(Hold(P.engine_id, rid, [ids], 1, None,
                                                  id=next(mids))), Held)
                    tokens[rid] = held.token
                    return held

                def min_read(rid: str, ids: list[int]) -> object:
                    return floors.expect(md(Read(D.engine_id, rid, [ids], P.remote, [ids], rid,
                                                 None, None, remote_tokens=[tokens.pop(rid)],
                                                 id=next(mids))),
                                         Ok)

                def min_poll() -> list[Completion]:
                    epoch, ack = acks[0]
                    got = floors.expect(md(Poll(D.engine_id, ack, epoch, 0.0, id=next(mids))),
                                        Completions)
                    acks[0] = (got.epoch, got.last)
                    return got.items

                min_poll()  # whatever D's client left unacknowledged
                m_hold, m_read, m_poll, _, m_full, _ = single_calls(
                    "m", rounds_x, min_hold, min_read, min_poll)
                min_poll()  # acknowledge the last, so D's client finds nothing of these
            nf_hold, *_ = single_calls(
                "n", rounds_x, p_hold, d_read, lambda: dc.poll(D.engine_id), fill=False)

            def p_hold_nowait(rid: str, ids: list[int]) -> None:
                # the engine issues the token (its registration's hold key), then holds
                tokens[rid] = P.issue_tokens(rid, [ids])[0]
                pc.hold_nowait(P.engine_id, rid, [ids], readers=1)

            def d_read_nowait(rid: str, ids: list[int]) -> None:
                dc.read_nowait(D.engine_id, rid, [ids], P.remote, [ids], remote_request_id=rid,
                               remote_tokens=[tokens.pop(rid)])

            # the same holds and reads, each sent without waiting for its answer (the
            # polls after the round take the answers: their CPU is the polls')
            hold_nowait_cpu, nowait_cpu, *_ = single_calls(
                "w", rounds, p_hold_nowait, d_read_nowait, lambda: dc.poll(D.engine_id))
            nf_hold_nowait, *_ = single_calls("v", rounds_x, p_hold_nowait, d_read_nowait,
                                              lambda: dc.poll(D.engine_id), fill=False)
            n_x = rounds_x * slots
            c0 = time.process_time()
            for _ in range(s.cpu_calls):
                dc.poll(D.engine_id)
            poll_empty = (time.process_time() - c0) / s.cpu_calls
            # The same reads and holds, `batch` per message (read_many / hold_many).
            hold_b = read_b = 0.0
            rounds_b = max(1, s.cpu_calls // batch)
            for r in range(rounds_b):
                rids = [f"b{r}-{j}" for j in range(batch)]
                blocks = [[list(range(j * k, (j + 1) * k))] for j in range(batch)]
                for j in range(batch):
                    fill_shard(P.buffers[0], P.layout, 0, blocks[j],
                               Request(seed=j, prompt_tokens=8 * k))
                c0 = time.process_time()
                held = pc.hold_many(P.engine_id, [HoldSpec(rid, ids)
                                                  for rid, ids in zip(rids, blocks)])
                hold_b += time.process_time() - c0
                c0 = time.process_time()
                refused = dc.read_many(D.engine_id, [
                    ReadSpec(rid, ids, P.remote, ids, remote_request_id=rid,
                             remote_tokens=[h.token if not isinstance(h, Exception) else ""])
                    for rid, ids, h in zip(rids, blocks, held)])
                read_b += time.process_time() - c0
                if any(isinstance(h, Exception) for h in held) or any(refused):
                    raise RuntimeError(f"batch refused: {held} {refused}")
                got = wait_all(D, rids)
                bad = [c for per in got.values() for c in per.values() if c.kind != "received"]
                if bad:
                    raise RuntimeError(f"batched read: {bad[0]}")
                P.wait_for(rids, timeout_s=60)
            # Polls without waiting (poll_nowait): a poll stays parked at D's sidecar,
            # which answers it when a completion arrives; an empty call reads the
            # socket only. Last here: D's client keeps a poll parked from now on.
            *_, pushed_full, _, pn_full, pn_items = single_calls(
                "x", rounds_x, p_hold, d_read, lambda: dc.poll_nowait(D.engine_id))
            dc.poll_nowait(D.engine_id)
            c0 = time.process_time()
            for _ in range(s.cpu_calls):
                dc.poll_nowait(D.engine_id)
            pushed_empty = (time.process_time() - c0) / s.cpu_calls
            # Each `hold` above came right after its blocks' fill and each poll
            # with completions after a 3 ms sleep: caches cold, as in an engine
            # that ran its model in between. The floors repeat that work before
            # each bare round trip, so the call and its floor start alike.
            ids16 = [list(range(k))]
            n_floor = min(s.cpu_calls, 500)
            def fill16() -> None:
                fill_shard(P.buffers[0], P.layout, 0, ids16, Request(seed=0, prompt_tokens=8 * k))

            floor_fill, fill_wall = floors.unix_cpu(n_floor, between=fill16)
            # ... and answered as late as P answered those holds (the thread sleeps
            # in recv and is woken, as in the real `hold`)
            hold_wall = hold_walls.get("c", 0.0) / max(1, rounds * slots)
            floor_fill_late, _ = floors.unix_cpu(n_floor, max(0.0, hold_wall - fill_wall),
                                                 between=fill16)
            floor_slept, slept_wall = floors.unix_cpu(n_floor,
                                                      between=lambda: time.sleep(0.003))
            # ... and answered as late as D answered those polls: the engine's thread
            # then sleeps in recv and is woken, as in the real poll
            poll_wall = poll_walls.get("c", 0.0) / max(1, n_full)
            floor_slept_late, _ = floors.unix_cpu(
                n_floor, max(0.0, poll_wall - slept_wall), between=lambda: time.sleep(0.003))
        finally:
            pair.close()
    nb = rounds_b * batch
    n = rounds * slots
    base = _inprocess_read_cpu(min(s.cpu_calls, 500))

    floor, floor_wall = floors.unix_cpu(s.cpu_calls)
    hold, read = hold_cpu / n, read_cpu / n
    # The same bare round trip, answered as late as the daemon answered `read` here.
    floor_late, _ = floors.unix_cpu(s.cpu_calls, max(0.0, read_wall / n - floor_wall))
    bound = (f"floor: a bare AF_UNIX SEQPACKET round trip to another process costs this "
             f"client {us(floor)} of CPU, {us(floor_late)} when answered after the "
             f"{us(read_wall / n)} a `read` call took (same run)")
    hold_bound = (f"floor: the same bare round trip costs this client {us(floor_fill)} of CPU "
                  f"when made, like each `hold` here, right after filling 16 blocks (cold "
                  f"caches), {us(floor_fill_late)} when also answered as late as P answered "
                  f"these holds ({us(hold_wall)}); {us(floor)} back to back, same run")
    poll_full_us = poll_full / max(1, n_full)
    minimal = ("the same call made by a minimal caller in this run (`floors.MinimalCaller`: "
               "the request built, encoded, sent, the reply received and decoded; no client: "
               "no checks, timeouts or reconnection) costs {}: the rest of the figure is the "
               "client's own")
    return [
        Figure("engine CPU per `read` call (16 blocks)", us(read),
               f"the same planning + posting + completion in-process (bare NIXL): {us(base)}",
               f"{read / base:.2f}x", f"≤ 20 µs (a bare round trip answered as late: "
               f"{us(floor_late)}; batches meet it)", read <= 20e-6,
               [bound, minimal.format(us(m_read / n_x))]),
        Figure("engine CPU per `read_nowait` call (16 blocks; the answer taken by the "
               "next poll)", us(nowait_cpu / n),
               f"one `read` call per read (above): {us(read)}",
               f"{nowait_cpu / n / read:.2f}x", "≤ 20 µs", nowait_cpu / n <= 20e-6,
               ["the same rounds as `read`'s: 4 reads, then polls until all is read; the "
                "poll after them takes the answers (its CPU is counted there, not here)"]),
        Figure("engine CPU per `hold` call (16 blocks)", us(hold), hold_bound,
               f"floor {plus_us(hold - floor_fill_late)}",
               f"≤ 20 µs (a bare round trip after the same fill, answered as late: "
               f"{us(floor_fill_late)}; batches meet it)", hold <= 20e-6,
               [minimal.format(us(m_hold / n_x)),
                f"the same `hold` without the fill before it (same run): {us(nf_hold / n_x)}: "
                "the fill, the engine's own work, is what makes a `hold` cost more than a "
                "`read`"]),
        Figure("engine CPU per `hold_nowait` call (16 blocks; the engine issues the token; "
               "the answer taken by a later poll)", us(hold_nowait_cpu / n),
               f"one `hold` call per hold (above): {us(hold)}",
               f"{hold_nowait_cpu / n / hold:.2f}x", "≤ 20 µs", hold_nowait_cpu / n <= 20e-6,
               ["each right after filling its 16 blocks, as each `hold` above; the token "
                "issued with the registration's hold key is counted here",
                f"without the fill before each (same run): {us(nf_hold_nowait / n_x)}, "
                f"`hold` so {us(nf_hold / n_x)}; each call here also issues its token in "
                "Python (blake2b over the block ids), work `hold` leaves to the sidecar"]),
        Figure(f"engine CPU per read, {batch} reads of 16 blocks per `read_many` message",
               us(read_b / nb), f"one `read` call per read (above): {us(read)}",
               f"{read_b / nb / read:.2f}x", "≤ 20 µs", read_b / nb <= 20e-6),
        Figure(f"engine CPU per hold, {batch} holds of 16 blocks per `hold_many` message",
               us(hold_b / nb), f"one `hold` call per hold (above): {us(hold)}",
               f"{hold_b / nb / hold:.2f}x", "≤ 20 µs", hold_b / nb <= 20e-6),
        Figure("engine CPU per `poll` call",
               f"empty {us(poll_empty)} (back to back); returning "
               f"{n_items / max(1, n_full):.1f} completions {us(poll_full_us)} (after a 3 ms "
               "sleep)",
               f"floor: a bare round trip {us(floor)} back to back, {us(floor_slept)} after "
               f"the same 3 ms sleep, {us(floor_slept_late)} after it when also answered as "
               f"late as D answered these polls ({us(poll_wall)}; same run)",
               f"floor {plus_us(poll_empty - floor)}; "
               f"{plus_us(poll_full_us - floor_slept_late)}",
               f"≤ 20 µs (a bare round trip after the same sleep, answered as late: "
               f"{us(floor_slept_late)})", max(poll_empty, poll_full_us) <= 20e-6,
               [minimal.format(f"{us(m_poll / max(1, m_full))} returning completions")]),
        Figure("engine CPU per `poll_nowait` call (a poll parked at the sidecar, answered "
               "when a completion arrives)",
               f"empty {us(pushed_empty)} (back to back); returning "
               f"{pn_items / max(1, pn_full):.1f} completions "
               f"{us(pushed_full / max(1, pn_full))} (after a 3 ms sleep)",
               f"`poll` (above): empty {us(poll_empty)}, returning {us(poll_full_us)}",
               f"{pushed_empty / poll_empty:.2f}x; "
               f"{pushed_full / max(1, pn_full) / poll_full_us:.2f}x",
               "≤ 20 µs", max(pushed_empty, pushed_full / max(1, pn_full)) <= 20e-6,
               ["an empty call sends nothing (the sidecar's answer to the parked poll "
                "is not in): it reads the socket without waiting; one returning "
                "completions takes the pushed answer and parks the next poll"]),
    ]


# -- start-up, idle ------------------------------------------------------------------------------

def startup_layout(tp: int, nb: int) -> Layout:
    """64 layers of a small hybrid (attention + Mamba2 views per region)."""
    return mamba2_hybrid_layout(
        model="bench-startup", num_layers=64, total_kv_heads=1, head_dim=16, block_tokens=8,
        intermediate_size=32, n_groups=1, d_state=16, conv_kernel=4, mamba_heads=4,
        mamba_head_dim=8, tp_size=tp, num_blocks=nb)


def bench_startup(fleet: Fleet, s: Scale) -> list[Figure]:
    """Process start to READY, then registering 64 regions x N pages (engine-allocated
    shared memory, attach mode), and the daemon's RSS afterwards. Its own sidecar:
    start-up is the figure."""
    del fleet
    layout = startup_layout(1, s.startup_pages)
    regions = allocate_for_layout(layout, f"{ENGINE_SHM_PREFIX}bench-start-", reserve=False)
    try:
        workdir = Path(tempfile.mkdtemp(prefix="kvs-bench-"))
        # Attach mode maps POSIX shm, which a sidecar serves only when told.
        sc = SidecarProcess(workdir, "s0", args=["--metrics-port", "0", "--allow-unsealed-shm"])
        try:
            t0 = time.perf_counter()
            sc.start()
            t_ready = time.perf_counter() - t0
            assert sc.proc is not None
            rss0 = proc_rss_mib(sc.proc.pid)
            with SidecarClient(sc.socket, timeout_s=120) as c:
                t1 = time.perf_counter()
                c.register("bench-start", 0, layout, regions=regions)
                t_reg = time.perf_counter() - t1
                rss1 = proc_rss_mib(sc.proc.pid)
                c.deregister("bench-start")
        finally:
            sc.stop()
            shutil.rmtree(workdir, ignore_errors=True)
    finally:
        for r in regions:
            r.close()
            r.unlink()
    total_gb = layout.region_bytes * layout.num_regions / 1e9
    return [Figure(f"start-up: 64 regions x {s.startup_pages:,} pages hybrid "
                   f"({total_gb:.1f} GB registered)",
                   f"register → ready {ms(t_reg)} (process start → READY {ms(t_ready)}); "
                   f"RSS {rss0:.0f} → {rss1:.0f} MiB", "—", "—", "register ≤ 1 s",
                   t_reg <= 1.0)]


def bench_idle(fleet: Fleet, s: Scale) -> list[Figure]:
    """Sidecar CPU with engines registered and nothing in flight, then with one hold."""
    with sidecars_of(fleet, ["p0", "d0"]) as (p0, d0):
        pair = Pair(p0, d0, small_attention, 8, "idle")
        try:
            warm = pair.prefill(8)
            pair.D.start_read(warm)
            pair.finish([warm], wait_all(pair.D, [warm.request_id]))
            time.sleep(0.5)
            pids = [p.proc.pid for p in (p0, d0) if p.proc]

            def cpu_pct() -> list[float]:
                c0 = [proc_cpu_s(p) for p in pids]
                t0 = time.perf_counter()
                time.sleep(s.idle_s)
                wall = time.perf_counter() - t0
                return [100 * (proc_cpu_s(p) - c) / wall for p, c in zip(pids, c0)]

            idle = cpu_pct()
            pair.prefill(8)  # one hold pending, nobody reading it
            held = cpu_pct()
        finally:
            pair.close()
    worst = max(idle)
    return [Figure(f"idle sidecar, whole process ({s.idle_s:.0f} s, engines registered, "
                   "after one read)",
                   f"P {idle[0]:.2f} %, D {idle[1]:.2f} % of a core; with one hold pending: "
                   f"P {held[0]:.2f} %, D {held[1]:.2f} %", "—", "—", "< 0.5 % of a core",
                   worst < 0.5, ["all threads, from /proc/<pid>/task/*/schedstat (ns)"])]


# -- descriptors ---------------------------------------------------------------------------------

def bench_descriptors(fleet: Fleet, s: Scale) -> list[Figure]:
    """Descriptors per request: ours (after coalescing) vs one per block per segment per
    region (vLLM's plan); pure planner arithmetic, no I/O."""
    del fleet, s
    rows = []
    rng = np.random.default_rng(0)
    hyb = nemotron_like(4)
    cases: list[tuple[str, Callable[[int, int], Layout], int, int, bool]] = [
        ("attention tp1→tp1, consecutive blocks", bulk_attention(0), 1, 1, True),
        ("attention tp1→tp1, scattered blocks", bulk_attention(0), 1, 1, False),
        ("hybrid (demo) tp1→tp2, scattered", hyb, 1, 2, False),
        ("hybrid (demo) tp2→tp1, scattered", hyb, 2, 1, False),
    ]
    for label, make, p_tp, d_tp, consecutive in cases:
        nb = 256
        P, D = make(p_tp, nb), make(d_tp, nb)
        ours = vllm = staged = 0
        ids_p = [np.arange(32) if consecutive else rng.permutation(nb)[:32] for _ in P.groups]
        ids_d = [np.arange(32) if consecutive else rng.permutation(nb)[:32] for _ in D.groups]
        if len(P.groups) > 1:  # one Mamba page per request
            ids_p[1], ids_d[1] = ids_p[1][:1], ids_d[1][:1]
        # distinct, far-apart region bases, as real registrations have
        local = np.arange(D.num_regions, dtype=np.int64) * (1 << 34) + (1 << 40)
        remote = {p: np.arange(P.num_regions, dtype=np.int64) * (1 << 34) + (1 << 44)
                  for p in range(p_tp)}
        for rank in range(d_tp):
            plan = plan_read(D, rank, P, ids_d, ids_p)
            ours += plan.descriptors
            vllm += plan.descriptors_before_coalescing
            for post in build_posts(plan, local, remote):
                sp = plan_staging(post.local, post.remote, post.length) if post.length.size \
                    else None
                staged += int(post.length.size) if sp is None else int(sp.length.size)
        rows.append(Figure(f"descriptors per request: {label} (32 blocks)",
                           f"{ours:,}; with `--staging auto`: {staged:,}",
                           f"vLLM-style (one per block per segment): {vllm:,}",
                           f"{ours / vllm:.3f}x; staged {staged / vllm:.3f}x", "table", None))
    return rows


# -- descriptor economy: staging crossover -------------------------------------------------------

def _scatter_seconds(nbytes: int, piece: int, repeats: int = 3) -> float:
    """The daemon's own scatter (:func:`kvsidecar.daemon.staging.scatter`) of
    ``nbytes`` in ``piece``-byte pieces from a staging buffer that holds every
    other piece (what a contiguous READ of the covering run brings) into random
    slots of a faulted-in destination (best of ``repeats``)."""
    k = nbytes // piece
    area = np.ones(2 * nbytes, np.uint8)
    dst = np.ones(2 * nbytes, np.uint8)  # written: faulted in, as prefault leaves engine memory
    base = int(dst.ctypes.data)
    src = np.arange(k, dtype=np.int64) * 2 * piece
    to = base + np.random.default_rng(0).permutation(2 * k)[:k].astype(np.int64) * piece
    size = np.full(k, piece, np.int64)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        scatter(area, src, to, size, np.array([base], np.int64), [dst])
        best = min(best, time.perf_counter() - t0)
    return best


def bench_staging(fleet: Fleet, s: Scale) -> list[Figure]:
    """When does reading the contiguous remote run (2x the bytes, one descriptor)
    into staging memory plus a local scatter beat posting the scattered
    descriptors? Bare NIXL between two processes, same run; no daemon involved
    (these are the measurements behind daemon/staging_plan.CostModel)."""
    del fleet
    nbytes = (16 << 20) if s.name != "smoke" else (1 << 20)
    rows = []
    with RawPair(2 * nbytes) as pair:
        def timed(size: int, slots: np.ndarray) -> float:
            loc = pair.agent.get_xfer_descs(pair.table(pair.region.address, slots, size), "DRAM")
            far = pair.agent.get_xfer_descs(pair.table(pair.remote_addr, slots, size), "DRAM")
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                pair.finish(pair.agent.initialize_xfer("READ", loc, far, pair.peer, b""))
                best = min(best, time.perf_counter() - t0)
            return best

        run = timed(2 * nbytes, np.zeros(1, np.int64))
        for piece in (2048, 8192, 32768, 131072):
            k = nbytes // piece
            scattered = timed(piece, np.arange(k, dtype=np.int64) * 2)
            copy = _scatter_seconds(nbytes, piece)
            staged = run + copy
            rows.append(Figure(
                f"descriptor economy: {nbytes >> 20} MiB in {piece // 1024} KiB pieces "
                f"({k:,} descriptors), every other piece of a run",
                f"staged: one READ of the {2 * nbytes >> 20} MiB run {ms(run)} + the "
                f"daemon's scatter {ms(copy)} = {ms(staged)}",
                f"scattered descriptors: {ms(scattered)}", f"{scattered / staged:.2f}x",
                "table (>1: staging wins)", None))
    return rows


def bench_progress_thread(fleet: Fleet, s: Scale) -> list[Figure]:
    """benchmarks/progress_thread.py (imported late: it imports this module)."""
    import progress_thread

    return progress_thread.bench(fleet, s)


def bench_hops(fleet: Fleet, s: Scale) -> list[Figure]:
    """benchmarks/hop_timeline.py (imported late: it imports this module)."""
    import hop_timeline

    return hop_timeline.bench(fleet, s)


BENCHES: dict[str, Callable[[Fleet, Scale], list[Figure]]] = {
    "bulk": bench_bulk,
    "verify": bench_verify,
    "hetero": bench_hetero,
    "latency": bench_latency,
    "hops": bench_hops,
    "sustained": bench_sustained,
    "engine_cpu": bench_engine_cpu,
    "startup": bench_startup,
    "idle": bench_idle,
    "descriptors": bench_descriptors,
    "staging": bench_staging,
    "progress_thread": bench_progress_thread,
}


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cores": os.cpu_count(), "load": os.getloadavg(),
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
