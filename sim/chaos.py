"""The lifecycle chaos run: real sidecars, random aborts, kills and pauses, every byte checked.

Two P and two D sidecars (real ``kvsidecar serve`` processes, real NIXL)
serve three engine pairs of different layer families (attention K=8 P tp2 ->
D tp1, hybrid attention+Mamba2 P tp1 -> D tp2, MLA P tp1 -> D tp1). Requests
go in waves; within a wave some are aborted by D (release right after read),
some released by P, some held too briefly (they expire). Between and during
waves faults are injected: a P sidecar is paused (SIGSTOP, then SIGCONT), a
D sidecar is killed (SIGKILL) and restarted with fresh engines, a D engine
process is killed (SIGKILL) while its reads run.

What is checked (the report; :func:`problems` turns it into assertions):

- every request ends exactly once, on every rank that took it: one
  completion per (engine, rank, request); reads on a killed sidecar end by
  the engine's own failure handling (the sidecar is gone), counted apart;
- 0 wrong bytes: every block reported ``received`` matches the oracle of
  ``LAYOUT.md`` section 6;
- 0 bytes written after failure: blocks reported failed/aborted get a
  sentinel at once and are only reused after the next wave; the sentinel
  must still be there;
- 0 holds alive past their lease bound: each P sidecar's longest overrun of
  a hold deadline (``kvsidecar_hold_overrun_seconds``) stays under the
  housekeeping bound, plus the pause for a paused sidecar;
- holds outlive a killed P engine (drain, issue #29): every request a P
  engine process held before it was SIGKILLed (and its sidecars noticed)
  is ``received`` by D with oracle-exact bytes (counted apart:
  ``drained_reads``); its sidecars end every such hold ``sent``
  (``kvsidecar_drained_holds_total``, ``drained_holds`` against
  ``drained_holds_placed``); afterwards its memory is released (drain
  gauges 0, its registered bytes 0, no ``/dev/shm`` name or mapping of it
  left in the sidecar) and a fresh process registers the same engine id and
  serves the next such fault (``drain_leftovers`` lists what was not so);
- back to baseline: engines, ``/dev/shm`` segments, fds and threads of every
  sidecar that was not killed return to what they were before the run.

``python -m kvsidecar.sim.chaos --requests 10000`` (``make chaos``) runs the
long form; the test suite runs 2,000.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvsidecar.daemon.engines.memory import shm_prefix_for
from kvsidecar.ipc.client import SidecarClient, SidecarError
from kvsidecar.ipc.protocol import Completion, RemoteEngine
from kvsidecar.sim.cluster import Sent, SidecarProcess, SimEngine
from kvsidecar.sim.models import MakeLayout, attn, hybrid, mla
from kvsidecar.sim.oracle import Request

SENTINEL = 0x5C
HOUSEKEEPING_BOUND_S = 1.0
"""How late (past its deadline) a hold may still be found alive on a running sidecar."""
SIDECAR_ARGS = ["--hold-lease", "2", "--hold-timeout", "8", "--engine-lease", "60",
                "--read-timeout", "10", "--handshake-timeout", "3", "--metrics-port", "0"]
BLOCKS = 192


@dataclass
class Pair:
    name: str
    make: MakeLayout
    p_tp: int
    d_tp: int
    p_sidecars: list[int]  # indexes into the P sidecars
    d_sidecars: list[int]  # indexes into the D sidecars
    P: SimEngine | None = None
    D: SimEngine | None = None
    generation: int = 0


@dataclass
class Report:
    requests: int = 0
    waves: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    hold_outcomes: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    duplicate_completions: int = 0
    missing_completions: int = 0
    ended_by_sidecar_death: int = 0
    #: D's read outcomes of requests whose P engine was killed after holding them
    drained_reads: Counter[str] = field(default_factory=Counter)
    #: holds (request x P rank) those killed P engines had placed
    drained_holds_placed: int = 0
    #: how the P sidecars ended them (their kvsidecar_drained_holds_total, by outcome)
    drained_holds: Counter[str] = field(default_factory=Counter)
    #: what a killed P engine left behind, or a replacement that could not register
    drain_leftovers: list[str] = field(default_factory=list)
    wrong_bytes_requests: list[str] = field(default_factory=list)
    sentinel_violations: list[str] = field(default_factory=list)
    hold_overrun_s: dict[str, float] = field(default_factory=dict)
    paused_s: dict[str, float] = field(default_factory=dict)
    faults: Counter[str] = field(default_factory=Counter)
    baseline: dict[str, dict[str, int]] = field(default_factory=dict)
    final: dict[str, dict[str, int]] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, Counter) else v) for k, v in self.__dict__.items()}


def problems(r: Report) -> list[str]:
    """What the run must not show; empty when every guarantee held."""
    out = []
    if r.duplicate_completions:
        out.append(f"{r.duplicate_completions} requests ended more than once")
    if r.missing_completions:
        out.append(f"{r.missing_completions} requests never ended")
    if r.wrong_bytes_requests:
        out.append(f"wrong bytes in received blocks: {r.wrong_bytes_requests[:5]}")
    if r.sentinel_violations:
        out.append(f"blocks written after failure: {r.sentinel_violations[:5]}")
    if set(r.drained_reads) - {"received"}:
        out.append(f"reads of a killed P engine's holds not received: {dict(r.drained_reads)}")
    if r.drained_holds != Counter({"sent": r.drained_holds_placed} if r.drained_holds_placed
                                  else {}):
        out.append(f"a killed P engine's {r.drained_holds_placed} holds ended "
                   f"{dict(r.drained_holds)}, not all sent")
    out.extend(r.drain_leftovers)
    for name, over in r.hold_overrun_s.items():
        allowed = HOUSEKEEPING_BOUND_S + r.paused_s.get(name, 0.0)
        if over > allowed:
            out.append(f"{name}: a hold lived {over:.2f} s past its deadline (allowed {allowed})")
    for name, base in r.baseline.items():
        now = r.final.get(name)
        if now is None:
            continue
        if now["engines"] or now["shm"]:
            out.append(f"{name}: {now['engines']} engines, {now['shm']} shm segments left")
        if now["threads"] > base["threads"]:
            out.append(f"{name}: threads {base['threads']} -> {now['threads']}")
        if now["fds"] > base["fds"]:
            out.append(f"{name}: fds {base['fds']} -> {now['fds']}")
    return out


class Endings:
    """Which requests each engine has seen end, to tell a second ending from an early one.

    A completion polled while the driver waits for *other* requests belongs either
    to a request that already ended (a second ending: counted and dropped) or to
    one that is still running in the driver's view (it simply ended first, e.g. a
    0.05 s hold that expired while the driver waited for a killed engine's holds).
    The second kind is kept for the wait that asks for it. Counting it as a
    duplicate and dropping it (as this driver once did) left that wait without
    its completion: the "hold that never ended" of seed 11 at ~1,355 requests.
    """

    def __init__(self) -> None:
        self._ended: dict[str, set[str]] = {}
        self.duplicates = 0

    def wait(self, e: SimEngine, rids: list[str], timeout_s: float = 120.0
             ) -> dict[str, dict[int, Completion]]:
        """Every rank's completion of each of ``rids``; they count as ended from now."""
        got = e.wait_for(rids, timeout_s=timeout_s)
        self._ended.setdefault(e.engine_id, set()).update(got)
        self.sweep(e)
        return got

    def sweep(self, e: SimEngine) -> int:
        """Poll ``e``; drop (and count) completions of requests that already ended, keep
        the rest for their wait. Returns the duplicates found now."""
        e.poll()
        ended = self._ended.get(e.engine_id, set())
        found = 0
        for rank, items in e.completions.items():
            keep = [c for c in items if c.request_id not in ended]
            found += len(items) - len(keep)
            e.completions[rank] = keep
        self.duplicates += found
        return found


class PEngineProcess:
    """A P engine in its own process (attention K=8, tp 2 on both P sidecars):
    it registers with sidecar-allocated memory, then on each ``prefill`` line of
    its stdin fills and holds the requests named and prints what D needs to
    read them (handshakes, block ids, hold tokens). Killed with SIGKILL by the
    ``kill_p_engine`` fault; a fresh one with the same engine id takes its place."""

    TP = 2

    def __init__(self, engine_id: str, sockets: list[str], log_path: Path) -> None:
        self.engine_id = engine_id
        script = textwrap.dedent(f"""
            import json, sys
            from kvsidecar.sim.cluster import SimEngine
            from kvsidecar.sim.models import attn
            from kvsidecar.sim.oracle import Request
            P = SimEngine({engine_id!r}, attn(8), {self.TP}, 64, {sockets!r}, timeout_s=20)
            print(json.dumps({{"handshake": P.remote.handshake}}), flush=True)
            for line in sys.stdin:
                cmd = json.loads(line)
                if cmd is None:
                    P.close()
                    break
                out = []
                for rid, seed, tokens in cmd:
                    s = P.prefill(rid, Request(seed=seed, prompt_tokens=tokens))
                    out.append({{"ids": s.block_ids, "tokens": s.tokens}})
                print(json.dumps(out), flush=True)
        """)
        with open(log_path, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True)
        self._handshake: list[str] | None = None

    def _line(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"P engine process {self.engine_id!r} ended "
                               f"(exit {self.proc.wait(30)}): see its log")
        return json.loads(line)

    def prefill(self, reqs: list[tuple[str, Request]]) -> list[Sent]:
        """Fill and hold ``reqs`` (request id, request) in the process; what D reads."""
        if self._handshake is None:  # its registration line
            self._handshake = self._line()["handshake"]
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps([[rid, r.seed, r.prompt_tokens]
                                          for rid, r in reqs]) + "\n")
        self.proc.stdin.flush()
        remote = RemoteEngine(self.engine_id, self.TP, self._handshake)
        return [Sent(rid, remote, got["ids"], r, got["tokens"])
                for (rid, r), got in zip(reqs, self._line())]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def close(self) -> int:
        """Deregister (an engine's normal exit), wait for the process; its exit code
        (not 0 if it could not register, e.g. its id was refused)."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(OSError):
                self.proc.stdin.write("null\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipes()
        return self.proc.wait()


class Chaos:
    def __init__(self, workdir: Path, *, seed: int = 7, wave: int = 24,
                 log: Any = None) -> None:
        self.workdir = workdir
        self.rng = random.Random(seed)
        self.wave_size = wave
        self.log = log or (lambda *a: None)
        self.p = [SidecarProcess(workdir, f"p{i}", args=SIDECAR_ARGS) for i in range(2)]
        self.d = [SidecarProcess(workdir, f"d{i}", args=SIDECAR_ARGS) for i in range(2)]
        self.pairs = [
            Pair("attn", attn(8), 2, 1, [0, 1], [0]),
            Pair("hybrid", hybrid, 1, 2, [1], [0, 1]),
            Pair("mla", mla, 1, 1, [0], [1]),
        ]
        self.report = Report()
        self.watch: list[tuple[SimEngine, str, list[list[int]]]] = []  # sentinel checks
        self.killed: set[int] = set()  # D sidecars killed during the current wave
        self.endings = Endings()
        self._ids = 0
        self.p_proc: PEngineProcess | None = None  # the kill_p_engine fault's P engine
        # Its own stream, in waves no other fault takes: the other faults and the
        # requests of a seed stay as they were. About one P kill every 25 waves.
        self.p_kills = random.Random(seed ^ 0x29)
        self._p_kill_due = self.p_kills.randint(5, 25)

    # ------------------------------------------------------------ set-up

    def start(self) -> None:
        for s in (*self.p, *self.d):
            s.start()

    def open_engines(self) -> None:
        for pair in self.pairs:
            self._open(pair)

    def _open(self, pair: Pair) -> None:
        pair.generation += 1
        tag = f"{pair.name}{pair.generation}"
        if pair.P is None:
            pair.P = SimEngine(f"P-{tag}", pair.make, pair.p_tp, BLOCKS,
                               [self.p[i] for i in pair.p_sidecars], timeout_s=20)
        pair.D = SimEngine(f"D-{tag}", pair.make, pair.d_tp, BLOCKS,
                           [self.d[i] for i in pair.d_sidecars], timeout_s=5)

    def close_engines(self) -> None:
        if self.p_proc is not None:
            rc = self.p_proc.close()
            if rc:
                self.report.drain_leftovers.append(
                    f"P engine process {self.p_proc.engine_id!r} exited {rc}: see its log")
            self.p_proc = None
        for pair in self.pairs:
            for e in (pair.D, pair.P):
                if e is not None:
                    e.close()
            pair.P = pair.D = None

    def stop(self) -> None:
        for s in (*self.p, *self.d):
            s.stop()

    # ------------------------------------------------------------ measurements

    def snapshot(self) -> dict[str, dict[str, int]]:
        out = {}
        for s in (*self.p, *self.d):
            if not s.alive() or s.proc is None:
                continue
            pid = s.proc.pid
            with SidecarClient(s.socket) as c:
                engines = len(c.ping().engines)
            prefix = shm_prefix_for(s.socket) + "-"
            out[s.name] = {
                "engines": engines,
                "shm": sum(1 for n in os.listdir("/dev/shm") if n.startswith(prefix)),
                "fds": len(os.listdir(f"/proc/{pid}/fd")),
                "threads": len(os.listdir(f"/proc/{pid}/task")),
            }
        return out

    def settle(self, timeout_s: float = 30.0) -> dict[str, dict[str, int]]:
        """Wait until every sidecar has released its engines' threads and memory."""
        deadline = time.monotonic() + timeout_s
        while True:
            snap = self.snapshot()
            base = self.report.baseline
            done = all(v["engines"] == 0 and v["shm"] == 0 and
                       v["threads"] <= base.get(k, v)["threads"] and
                       v["fds"] <= base.get(k, v)["fds"] for k, v in snap.items())
            if done or time.monotonic() > deadline:
                return snap
            time.sleep(0.2)

    def hold_overruns(self) -> dict[str, float]:
        out = {}
        for s in self.p:
            if not s.alive():
                continue
            with urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics",
                                        timeout=10) as r:
                text = r.read().decode()
            worst = 0.0
            for line in text.splitlines():
                if line.startswith("kvsidecar_hold_overrun_seconds{"):
                    worst = max(worst, float(line.rsplit(" ", 1)[1]))
            out[s.name] = worst
        return out

    # ------------------------------------------------------------ the run

    def run(self, requests: int) -> Report:
        t0 = time.monotonic()
        self.open_engines()
        while self.report.requests < requests:
            fault = self._pick_fault()
            self._wave(fault)
            self.report.waves += 1
            if self.report.waves % 10 == 0:
                self.log(f"{self.report.requests} requests, {dict(self.report.outcomes)}, "
                         f"faults {dict(self.report.faults)}")
        self._check_watch(final=True)
        self.report.hold_overrun_s = self.hold_overruns()
        self.close_engines()
        self.report.final = self.settle()
        self.report.seconds = time.monotonic() - t0
        return self.report

    def _pick_fault(self) -> str:
        x = self.rng.random()
        if x < 0.06:
            return "pause_p"
        if x < 0.09:
            return "kill_d_sidecar"
        if x < 0.13:
            return "kill_engine"
        if self.report.waves >= self._p_kill_due:  # the first wave free of other faults
            self._p_kill_due += self.p_kills.randint(15, 35)
            return "kill_p_engine"
        return ""

    def _rid(self) -> str:
        self._ids += 1
        return f"c{self._ids}"

    def _wave(self, fault: str) -> None:
        issued: list[tuple[Pair, str, Sent]] = []
        for pair in self.pairs:
            assert pair.P is not None and pair.D is not None
            for _ in range(self.wave_size // len(self.pairs)):
                rid = self._rid()
                req = Request(seed=self._ids, prompt_tokens=self.rng.randint(1, 48))
                short = self.rng.random() < 0.04
                try:
                    sent = pair.P.prefill(rid, req, timeout_s=0.05 if short else None)
                except RuntimeError:  # out of blocks: the wave is full enough
                    break
                issued.append((pair, rid, sent))
        self.report.requests += len(issued)
        timer = self._inject(fault)
        reads: list[tuple[Pair, str]] = []
        broken: set[str] = set()  # pairs whose D sidecar stopped answering
        for pair, rid, sent in issued:
            assert pair.D is not None and pair.P is not None
            if pair.name in broken:
                continue
            try:
                pair.D.start_read(sent)
            except RuntimeError:  # D out of blocks
                pair.D.receiving.pop(rid, None)
                pair.P.clients[0].release(pair.P.engine_id, rid)
                for r in range(1, pair.P.tp):
                    pair.P.clients[r].release(pair.P.engine_id, rid)
                continue
            except SidecarError:
                broken.add(pair.name)  # its D sidecar was killed: see _revive
                continue
            reads.append((pair, rid))
            x = self.rng.random()
            with contextlib.suppress(SidecarError):
                if x < 0.05:
                    for c in pair.D.clients:
                        c.release(pair.D.engine_id, rid)
                elif x < 0.08:
                    for c in pair.P.clients:
                        c.release(pair.P.engine_id, rid)
        if timer is not None:
            timer.join()
        self._collect(issued, reads)
        self._check_watch(final=False)

    def _inject(self, fault: str) -> threading.Thread | None:
        if not fault:
            return None
        self.report.faults[fault] += 1
        if fault == "pause_p":
            victim = self.rng.choice(self.p)
            pause = self.rng.uniform(0.5, 2.5)
            self.report.paused_s[victim.name] = max(self.report.paused_s.get(victim.name, 0),
                                                    pause)

            def pause_it() -> None:
                assert victim.proc is not None
                os.kill(victim.proc.pid, signal.SIGSTOP)
                time.sleep(pause)
                os.kill(victim.proc.pid, signal.SIGCONT)

            t = threading.Thread(target=pause_it)
            t.start()
            return t
        if fault == "kill_d_sidecar":
            i = self.rng.randrange(len(self.d))
            self.killed.add(i)

            def kill_it() -> None:
                time.sleep(self.rng.uniform(0.0, 0.3))  # while the wave's reads run
                self.d[i].kill()

            t = threading.Thread(target=kill_it)
            t.start()
            return t
        if fault == "kill_engine":
            self._kill_engine()
        if fault == "kill_p_engine":
            self._kill_p_engine()
        return None

    def _revive(self) -> None:
        """Restart the D sidecars killed in this wave on the same socket; the engines
        that used them lost their registration and start over (their reads ended
        with the sidecar: the engine learns it from its client's errors)."""
        for i in sorted(self.killed):
            victim = self.d[i]
            self.report.baseline.pop(victim.name, None)  # a fresh process: no baseline
            replacement = SidecarProcess(self.workdir, f"{victim.name}r", args=SIDECAR_ARGS)
            replacement.socket = victim.socket
            replacement.start()
            self.d[i] = replacement
            for pair in self.pairs:
                if i in pair.d_sidecars and pair.D is not None:
                    dead = pair.D
                    watched = {rid for e, rid, _ in self.watch if e is dead}
                    self.report.ended_by_sidecar_death += len(set(dead.receiving) - watched)
                    dead.receiving.clear()
                    with contextlib.suppress(Exception):
                        dead.close()
                    self._open(pair)
        self.killed.clear()

    def _kill_engine(self) -> None:
        """A D engine process reads a few requests from the attention P engine and is
        SIGKILLed while they run; P's holds must still end exactly once."""
        pair = self.pairs[0]
        assert pair.P is not None
        sents = []
        for _ in range(4):
            rid = self._rid()
            sents.append(pair.P.prefill(rid, Request(seed=self._ids, prompt_tokens=32)))
        self.report.requests += len(sents)
        spec = [{"rid": s.request_id, "engine": s.remote.engine_id, "tp": s.remote.tp_size,
                 "hs": s.remote.handshake, "ids": s.block_ids, "tokens": s.tokens} for s in sents]
        script = textwrap.dedent(f"""
            import json, os, sys
            from kvsidecar.ipc.client import SidecarClient
            from kvsidecar.ipc.protocol import RemoteEngine
            from kvsidecar.sim.models import attn
            layout = attn(8)(1, 64)
            c = SidecarClient({self.d[0].socket!r}, timeout_s=20)
            c.register("doomed-{self._ids}", 0, layout, allocate=True)
            for i, s in enumerate(json.loads(sys.argv[1])):
                local = [list(range(i * 8, i * 8 + len(s["ids"][0])))]
                c.read("doomed-{self._ids}", s["rid"], local,
                       RemoteEngine(s["engine"], s["tp"], s["hs"]), s["ids"], num_tokens=32,
                       remote_tokens=s["tokens"])
            os.kill(os.getpid(), 9)
        """)
        subprocess.run([sys.executable, "-c", script, json.dumps(spec)], timeout=120,
                       capture_output=True, check=False)
        got = self._wait(pair.P, [s.request_id for s in sents])
        for s in sents:
            for c in got[s.request_id].values():
                self.report.hold_outcomes[c.kind] += 1
            pair.P.free(s.block_ids)

    def _kill_p_engine(self) -> None:
        """A P engine process prefills and holds a few requests and is SIGKILLed
        before D reads them. Once its sidecars noticed (its id is gone from their
        engines), D reads: the holds must be served from the memory they kept,
        every one end ``sent``, and that memory be freed after; then a fresh
        process registers the same engine id (it serves the next such fault)."""
        pair = self.pairs[0]  # its D (attention K=8, tp 1) reads
        assert pair.D is not None
        engine_id = "P-killed"
        ps = [self.p[0], self.p[1]]
        if self.p_proc is None:
            self.p_proc = PEngineProcess(engine_id, [s.socket for s in ps],
                                         self.workdir / "p-engine.log")
        before = [Counter({o: s.metric("kvsidecar_drained_holds_total", outcome=o)
                           for o in ("sent", "aborted", "expired", "dropped")}) for s in ps]
        reqs = []
        for _ in range(4):
            rid = self._rid()
            reqs.append((rid, Request(seed=self._ids,
                                      prompt_tokens=self.p_kills.randint(1, 48))))
        try:
            sents = self.p_proc.prefill(reqs)
        except RuntimeError as e:  # it could not register (again) or hold
            self.report.drain_leftovers.append(str(e))
            self.p_proc.kill()
            self.p_proc = None
            return
        self.report.requests += len(sents)
        self.report.drained_holds_placed += len(sents) * PEngineProcess.TP
        self.p_proc.kill()
        self.p_proc = None
        gone = _until(lambda: all(engine_id not in _engines(s) for s in ps))
        if not gone:
            self.report.drain_leftovers.append(f"{engine_id} still registered after its kill")
        for sent in sents:
            pair.D.start_read(sent)
        got = self._wait(pair.D, [s.request_id for s in sents])
        for rid, by_rank in got.items():
            kinds = {c.kind for c in by_rank.values()}
            kind = "received" if kinds == {"received"} else sorted(kinds - {"received"})[0]
            self.report.drained_reads[kind] += 1
            if kind == "received":
                bad = pair.D.verify(rid)
                if bad:
                    self.report.wrong_bytes_requests.append(f"{rid}: {bad[0]}")
                pair.D.finish(rid)
            else:
                self._sentinel(pair.D, rid, pair.D.receiving[rid].block_ids)
        for s, base in zip(ps, before):
            done = _until(functools.partial(_drained, s))
            for o in base:
                n = int(s.metric("kvsidecar_drained_holds_total", outcome=o) - base[o])
                if n:
                    self.report.drained_holds[o] += n
            left = []
            if not done:
                left.append("still draining")
            if not _until(functools.partial(_unregistered, s, engine_id)):
                left.append("registered bytes")
            if not _until(functools.partial(_unmapped, s, f"-{engine_id}-")):
                left.append("its memory still mapped")
            if [n for n in os.listdir("/dev/shm") if f"-{engine_id}-" in n]:
                left.append("a /dev/shm name")
            if left:
                self.report.drain_leftovers.append(f"{s.name}: killed P engine left "
                                                   + ", ".join(left))
        # Its successor registers the same id meanwhile; the next fault uses it.
        self.p_proc = PEngineProcess(engine_id, [s.socket for s in ps],
                                     self.workdir / "p-engine.log")

    # ------------------------------------------------------------ outcomes

    def _collect(self, issued: list[tuple[Pair, str, Sent]],
                 reads: list[tuple[Pair, str]]) -> None:
        by_pair: dict[str, list[str]] = {}
        for pair, rid, _ in issued:
            by_pair.setdefault(pair.name, []).append(rid)
        read_ids = {(p.name, rid) for p, rid in reads}
        for pair in self.pairs:
            rids = by_pair.get(pair.name, [])
            assert pair.P is not None and pair.D is not None
            d_rids = [r for r in rids if (pair.name, r) in read_ids and r in pair.D.receiving]
            if not self.killed.intersection(pair.d_sidecars):
                self._collect_d(pair, d_rids)
        self._revive()
        for pair in self.pairs:
            rids = by_pair.get(pair.name, [])
            self._collect_p(pair, rids, {s.request_id: s for p, _, s in issued
                                         if p is pair})

    def _collect_d(self, pair: Pair, rids: list[str]) -> None:
        D = pair.D
        assert D is not None
        got = self._wait(D, rids)
        for rid, by_rank in got.items():
            kinds = {c.kind for c in by_rank.values()}
            kind = "received" if kinds == {"received"} else sorted(kinds - {"received"})[0]
            self.report.outcomes[kind] += 1
            for c in by_rank.values():
                if c.reason:
                    self.report.reasons[_reason_class(c.reason)] += 1
            if kind == "received":
                bad = D.verify(rid)
                if bad:
                    self.report.wrong_bytes_requests.append(f"{rid}: {bad[0]}")
                D.finish(rid)
            else:
                # Stays in ``receiving`` (other requests' checks skip its blocks)
                # until the sentinel check frees it.
                self._sentinel(D, rid, D.receiving[rid].block_ids)

    def _collect_p(self, pair: Pair, rids: list[str], sents: dict[str, Sent]) -> None:
        P = pair.P
        assert P is not None
        got = self._wait(P, rids)
        for rid, by_rank in got.items():
            for c in by_rank.values():
                self.report.hold_outcomes[c.kind] += 1
            P.free(sents[rid].block_ids)

    def _wait(self, e: SimEngine, rids: list[str]) -> dict[str, dict[int, Completion]]:
        before = self.endings.duplicates
        try:
            got = self.endings.wait(e, rids)
        except TimeoutError as exc:
            self.report.missing_completions += 1
            raise AssertionError(str(exc)) from None
        finally:
            self.report.duplicate_completions += self.endings.duplicates - before
        return got

    def _sentinel(self, D: SimEngine, rid: str, ids: list[list[int]]) -> None:
        page = D.layout.page_bytes
        for bufs in D.buffers:
            for buf in bufs:
                for g in ids:
                    for b in g:
                        buf[b * page:(b + 1) * page] = SENTINEL
        self.watch.append((D, rid, ids))

    def _check_watch(self, *, final: bool) -> None:
        keep = []
        for D, rid, ids in self.watch:
            page = D.layout.page_bytes
            ok = all(np.all(buf[b * page:(b + 1) * page] == SENTINEL)
                     for bufs in D.buffers for buf in bufs for g in ids for b in g)
            if not ok:
                self.report.sentinel_violations.append(f"{D.engine_id}/{rid}")
            if not final:
                D.receiving.pop(rid, None)
                D.free(ids)
                continue
            keep.append((D, rid, ids))
        self.watch = [] if not final else keep


def _until(ok: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Whether ``ok()`` came true within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _engines(side: SidecarProcess) -> list[str]:
    with SidecarClient(side.socket) as c:
        return c.ping().engines


def _drained(side: SidecarProcess) -> bool:
    """Whether ``side`` keeps nothing for ended engines (its drain gauges are 0)."""
    return (side.metric("kvsidecar_engines_draining") == 0
            and side.metric("kvsidecar_drain_bytes") == 0)


def _unregistered(side: SidecarProcess, engine_id: str) -> bool:
    return side.metric("kvsidecar_registered_bytes", engine=engine_id) == 0


def _unmapped(side: SidecarProcess, name: str) -> bool:
    """Whether the sidecar process maps no region whose name holds ``name`` (shm or memfd)."""
    assert side.proc is not None
    with open(f"/proc/{side.proc.pid}/maps") as f:
        return not any(name in line for line in f)


def _reason_class(reason: str) -> str:
    """A failure reason without its ids and numbers, to count like ones together."""
    import re

    return re.sub(r"'[^']*'|\d+(\.\d+)?", "_", reason)[:90]


def run(requests: int, workdir: Path | None = None, *, seed: int = 7,
        verbose: bool = False) -> Report:
    own = workdir is None
    path = Path(tempfile.mkdtemp(prefix="kvs-chaos-")) if own else workdir
    assert path is not None
    chaos = Chaos(path, seed=seed, log=(lambda *a: print(*a, flush=True)) if verbose else None)
    chaos.start()
    try:
        # Baseline: after one quiet wave (peer links and sockets exist), engines closed.
        chaos.open_engines()
        chaos._wave("")
        chaos.close_engines()
        chaos.report = Report()
        time.sleep(1.0)
        chaos.report.baseline = chaos.settle()
        return chaos.run(requests)
    finally:
        chaos.close_engines()
        chaos.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvsidecar-chaos", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep the sidecars' sockets and logs here (default: a fresh temp dir)")
    args = ap.parse_args(argv)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    report = run(args.requests, args.workdir, seed=args.seed, verbose=True)
    print(json.dumps(report.as_dict(), indent=1, default=str))
    bad = problems(report)
    for p in bad:
        print("FAIL:", p)
    print("OK" if not bad else f"{len(bad)} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
