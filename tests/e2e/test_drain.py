"""End to end: a prefill engine's holds outlive the engine (issue #29).

A P engine in its own process registers with allocated memory, fills blocks
with the oracle's bytes and holds them for one reader, then ends: it exits
without deregistering, is SIGKILLed, deregisters with ``drain`` or with
``drop``. D (real sidecars, real NIXL) reads afterwards. Drain: D receives
oracle-exact bytes from the memory the sidecar kept; drop: D's read fails.
Either way P's memory is gone afterwards (mapping, /dev/shm name or memfd,
registered bytes, draining gauges) and the dead engine takes no new work.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.ipc.client import SidecarClient, Unavailable, UnknownEngine
from kvsidecar.ipc.protocol import RemoteEngine
from kvsidecar.sim.cluster import Sent, SidecarProcess, SimEngine
from kvsidecar.sim.oracle import Request

pytestmark = pytest.mark.e2e

TOKENS = 60  # hybrid: several attention blocks and one Mamba state block per request


class Sidecars:
    """Two P and two D sidecars for this module, with metrics (the drain's gauges
    are watched from outside, as an operator's Prometheus does)."""

    def __init__(self, workdir: Path) -> None:
        args = ["--metrics-port", "0", "--hold-timeout", "60", "--allow-unsealed-shm"]
        self.p = [SidecarProcess(workdir, f"dr-p{i}", args=args) for i in range(2)]
        self.d = [SidecarProcess(workdir, f"dr-d{i}", args=args) for i in range(2)]
        self._ids = itertools.count()

    def uid(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids)}"

    @property
    def all(self) -> list[SidecarProcess]:
        return self.p + self.d


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecars]:
    sc = Sidecars(tmp_path_factory.mktemp("drain"))
    try:
        for s in sc.all:
            s.start()
        yield sc
    finally:
        codes = {s.name: s.stop() for s in sc.all}
        assert all(c == 0 for c in codes.values()), codes


def _start_p(p_sidecars: list[SidecarProcess], engine_id: str, tp: int, memory: str,
             rids: list[str], end: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """A P engine process: registers ``tp`` ranks, prefills and holds ``rids``,
    prints what D needs, then ends as ``end`` says (exit, kill: waits to be
    killed, drain, drop: deregisters so, then exits)."""
    script = textwrap.dedent(f"""
        import json, os, sys, time
        from kvsidecar.sim.cluster import SimEngine
        from kvsidecar.sim.models import hybrid
        from kvsidecar.sim.oracle import Request
        P = SimEngine({engine_id!r}, hybrid, {tp}, 96, {[s.socket for s in p_sidecars]!r},
                      memory={memory!r})
        sents = [P.prefill(rid, Request(seed=100 + i, prompt_tokens={TOKENS}))
                 for i, rid in enumerate({rids!r})]
        print(json.dumps({{
            "handshake": P.remote.handshake,
            "block_ids": [s.block_ids for s in sents],
            "tokens": [s.tokens for s in sents],
        }}), flush=True)
        end = {end!r}
        if end == "kill":
            time.sleep(600)
        if end in ("drain", "drop"):
            for c in P.clients:
                c.deregister({engine_id!r}, end)
        os._exit(0)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise AssertionError(f"P engine failed: {proc.stderr.read() if proc.stderr else ''}")
    return proc, json.loads(line)


def _sents(engine_id: str, tp: int, info: dict[str, Any], rids: list[str]) -> list[Sent]:
    remote = RemoteEngine(engine_id, tp, info["handshake"])
    return [Sent(rid, remote, ids, Request(seed=100 + i, prompt_tokens=TOKENS), tokens)
            for i, (rid, ids, tokens) in enumerate(zip(rids, info["block_ids"],
                                                        info["tokens"]))]


def _until(what: str, ok: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _mapped(side: SidecarProcess, name: str) -> bool:
    """Whether the sidecar process still maps a region of this name (shm or memfd)."""
    assert side.proc is not None
    with open(f"/proc/{side.proc.pid}/maps") as f:
        return any(name in line for line in f)


def _engines(side: SidecarProcess) -> list[str]:
    with SidecarClient(side.socket) as c:
        return c.ping().engines


@contextmanager
def _d_engine(pool: Any, tp: int, sidecars: list[SidecarProcess] | None = None
              ) -> Iterator[SimEngine]:
    from kvsidecar.sim.models import hybrid
    D = SimEngine(pool.uid("D"), hybrid, tp, 96, sidecars or pool.d[:tp])
    try:
        yield D
    finally:
        D.close()


def _released(ps: list[SidecarProcess], engine_id: str) -> None:
    """Everything of the P engine is gone from its sidecars."""
    for side in ps:
        _until(f"{side.name} still drains", lambda s=side: (  # type: ignore[misc]
            s.metric("kvsidecar_drain_bytes") == 0
            and s.metric("kvsidecar_engines_draining") == 0))
        assert side.metric("kvsidecar_registered_bytes", engine=engine_id) == 0
        assert engine_id not in _engines(side)
        _until("its memory is still mapped", lambda s=side: (  # type: ignore[misc]
            not _mapped(s, f"-{engine_id}-")))
    assert not [n for n in os.listdir("/dev/shm") if f"-{engine_id}-" in n]


CASES = [  # (how the P engine ends, P tp, D tp, memory)
    ("exit", 1, 2, "shm"),
    ("kill", 2, 1, "memfd"),
    ("drain", 2, 1, "shm"),
    ("drop", 1, 2, "memfd"),
]


@pytest.mark.parametrize(("end", "p_tp", "d_tp", "memory"), CASES,
                         ids=[f"{c[0]}-{c[1]}to{c[2]}-{c[3]}" for c in CASES])
def test_holds_outlive_their_engine(pool, end: str, p_tp: int, d_tp: int, memory: str) -> None:
    ps = pool.p[:p_tp]
    engine_id = pool.uid(f"drain-{end}-")
    rids = [f"{engine_id}-r0"]
    sent_before = sum(s.metric("kvsidecar_drained_holds_total", outcome="sent") for s in ps)
    proc, info = _start_p(ps, engine_id, p_tp, memory, rids, end)
    try:
        if end == "kill":
            proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == (-signal.SIGKILL if end == "kill" else 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (sent,) = _sents(engine_id, p_tp, info, rids)
    for side in ps:  # the engine is gone as a registration (death noticed by pid)
        _until(f"{engine_id} still registered", lambda s=side: engine_id not in _engines(s))
    if end != "drop":
        for side in ps:  # ... its memory is kept for the open hold, and counted
            _until("not draining", lambda s=side: s.metric("kvsidecar_engines_draining") == 1)
            assert side.metric("kvsidecar_drain_bytes") > 0
            assert _mapped(side, f"-{engine_id}-"), "its memory was not kept"
            status, body = _readyz(side)  # still ready: it serves, and says what drains
            assert status == 200 and "1 ended engine(s) draining 1 hold(s)" in body, body
        with SidecarClient(ps[0].socket) as c, pytest.raises(UnknownEngine):
            c.hold(engine_id, "new", [[0]] + [[] for _ in sent.block_ids[1:]])  # no new work
    with _d_engine(pool, d_tp) as D:
        D.start_read(sent)
        got = D.wait_for(rids)[rids[0]]
        if end == "drop":
            assert {c.kind for c in got.values()} == {"failed"}, got
        else:
            assert {c.kind for c in got.values()} == {"received"}, got
            assert not D.verify(rids[0])
    _released(ps, engine_id)
    served = sum(s.metric("kvsidecar_drained_holds_total", outcome="sent") for s in ps)
    assert served - sent_before == (0 if end == "drop" else p_tp)
    if end != "drop":  # one line per drained engine: why it ended, how its holds did
        why = "deregistered by the engine (drain)" if end == "drain" else "exited"
        for side in ps:
            (line,) = [ln for ln in side.read_log().splitlines()
                       if f"engine {engine_id!r} generation" in ln and "drained in" in ln]
            assert why in line and ": sent 1;" in line, line


def test_a_new_registration_of_the_id_never_frees_memory_under_a_transfer(pool) -> None:
    """The engine comes back with the same id while its old holds drain: it gets a
    new registration (new memory, new agent); the old generation's memory stays
    until its holds end. A reader linked to the old generation still reads its
    holds exactly; a reader that links now reaches the new registration and is
    refused the old holds (never given the new memory's bytes for them); a read
    of the new registration is exact."""
    side = pool.p[0]
    engine_id = pool.uid("drain-gen-")
    rids = [f"{engine_id}-r{i}" for i in range(3)]
    proc, info = _start_p([side], engine_id, 1, "shm", rids, "exit")
    assert proc.wait(30) == 0
    old = _sents(engine_id, 1, info, rids)
    _until("not draining", lambda: side.metric("kvsidecar_engines_draining") == 1)
    kept = side.metric("kvsidecar_drain_bytes")
    from kvsidecar.sim.models import hybrid
    with _d_engine(pool, 1, pool.d[:1]) as D1, _d_engine(pool, 1, pool.d[1:2]) as D2:
        D1.start_read(old[0])
        assert {c.kind for c in D1.wait_for(rids[:1])[rids[0]].values()} == {"received"}
        assert not D1.verify(rids[0])
        P2 = SimEngine(engine_id, hybrid, 1, 96, [side])  # the engine is back
        try:
            new = P2.prefill(f"{engine_id}-new", Request(seed=7, prompt_tokens=TOKENS))
            assert side.metric("kvsidecar_drain_bytes") == kept  # the old memory stays
            D1.start_read(old[1])  # over D1's link to the old generation
            assert {c.kind for c in D1.wait_for(rids[1:2])[rids[1]].values()} == {"received"}
            assert not D1.verify(rids[1])
            # A new link reaches the new registration, whose hold key did not issue
            # the old request's token: D refuses the read before posting anything.
            D2.start_read(old[2])
            (c2,) = D2.wait_for(rids[2:])[rids[2]].values()
            assert c2.kind == "failed" and "the hold token was not issued" in c2.reason, c2
            assert c2.nbytes == 0
            _until("old generation not freed",
                   lambda: side.metric("kvsidecar_engines_draining") == 0)
            assert side.metric("kvsidecar_drain_bytes") == 0
            D1.start_read(new)  # D1 re-links to the new registration: exact
            assert {c.kind for c in D1.wait_for([new.request_id])[new.request_id].values()
                    } == {"received"}
            assert not D1.verify(new.request_id)
        finally:
            P2.close()
    _released([side], engine_id)


def _readyz(side: SidecarProcess) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{side.metrics_port}/readyz",
                                    timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_sigterm_drains_open_holds_within_the_drain_timeout(pool, tmp_path) -> None:
    """SIGTERM: the sidecar refuses new work, says 'draining' on /readyz, serves the
    open holds until they end (D reads them exactly) and exits as soon as they did;
    a hold nobody reads is dropped at --drain-timeout (here from the environment)."""
    from kvsidecar.sim.models import hybrid
    side = SidecarProcess(tmp_path, "dr-term", args=["--metrics-port", "0",
                                                     "--drain-timeout", "120"]).start()
    bounded = SidecarProcess(tmp_path, "dr-bounded", args=["--metrics-port", "0"],
                             env={"KVSIDECAR_DRAIN_TIMEOUT": "1"}).start()
    try:
        P = SimEngine(pool.uid("P"), hybrid, 1, 96, [side])
        Q = SimEngine(pool.uid("Q"), hybrid, 1, 96, [bounded])
        sents = [P.prefill(f"term-{i}", Request(seed=30 + i, prompt_tokens=TOKENS))
                 for i in range(2)]
        Q.prefill("never-read", Request(seed=40, prompt_tokens=TOKENS))
        t0 = time.monotonic()
        side.terminate()
        bounded.terminate()
        _until("/readyz not draining", lambda: "draining" in _readyz(side)[1])
        assert _readyz(side)[0] == 503
        with pytest.raises(Unavailable):
            P.prefill("refused", Request(seed=1, prompt_tokens=TOKENS))
        with _d_engine(pool, 1) as D:
            for s in sents:
                D.start_read(s)
            got = D.wait_for([s.request_id for s in sents])
            for s in sents:
                assert {c.kind for c in got[s.request_id].values()} == {"received"}
                assert not D.verify(s.request_id)
        assert side.proc is not None and bounded.proc is not None
        assert side.proc.wait(60) == 0  # once its holds ended, not at --drain-timeout
        assert time.monotonic() - t0 < 60
        assert bounded.proc.wait(60) == 0
        assert "drain cut short: 1 hold(s) still open" in bounded.read_log()
        assert "drain done: 0 hold(s) still open" in side.read_log()
        for c in P.clients + Q.clients:
            c.close()
    finally:
        side.stop()
        bounded.stop()


def test_holds_cut_at_the_drain_timeout_each_end_with_one_completion(pool, tmp_path) -> None:
    """SIGTERM with holds nobody reads within --drain-timeout: the engine, still
    polling, gets exactly one ``expired`` completion for each, naming the
    shutdown, before the sidecar goes (never silence, then a dead socket)."""
    from kvsidecar.sim.models import hybrid
    side = SidecarProcess(tmp_path, "dr-cut", args=["--drain-timeout", "1"]).start()
    try:
        P = SimEngine(pool.uid("P"), hybrid, 1, 96, [side])
        rids = [f"cut-{i}" for i in range(2)]
        for i, rid in enumerate(rids):
            P.prefill(rid, Request(seed=60 + i, prompt_tokens=TOKENS))
        (client,) = P.clients
        client.timeout_s = 10.0
        side.terminate()
        got: list[Any] = []
        while {c.request_id for c in got} != set(rids):
            got += client.poll(P.engine_id, wait_s=0.5)  # raises once the socket went
        assert sorted((c.request_id, c.kind) for c in got) == [(r, "expired") for r in rids]
        assert all("--drain-timeout 1 s passed" in c.reason for c in got), got
        assert side.proc is not None and side.proc.wait(60) == 0
        assert "2 open hold(s) ended expired once their readers' leases ran out" in (
            side.read_log())
        client.close()
    finally:
        side.stop()


def test_an_engine_stopped_past_its_lease_does_not_drain(pool, tmp_path) -> None:
    """A P engine SIGSTOPped past --engine-lease with a hold open is alive: once
    continued it may reuse the held blocks (it hears its registration is gone), so
    the sidecar must not keep serving the hold from its memory. The hold ends with
    the registration (nothing drains) and D's read of it fails, never received."""
    side = SidecarProcess(tmp_path, "dr-stop", args=["--metrics-port", "0",
                                                     "--engine-lease", "2"]).start()
    engine_id = pool.uid("drain-stop-")
    rids = [f"{engine_id}-r0"]
    proc, info = _start_p([side], engine_id, 1, "memfd", rids, "kill")  # then sleeps
    try:
        proc.send_signal(signal.SIGSTOP)
        _until("the stopped engine was never released", lambda: (
            engine_id not in _engines(side) and f"engine {engine_id!r} released" in
            side.read_log()))
        assert side.metric("kvsidecar_engines_draining") == 0
        assert side.metric("kvsidecar_drain_bytes") == 0
        assert not _mapped(side, f"-{engine_id}-")
        proc.send_signal(signal.SIGCONT)
        (sent,) = _sents(engine_id, 1, info, rids)
        with _d_engine(pool, 1) as D:
            D.start_read(sent)
            (got,) = D.wait_for(rids)[rids[0]].values()
            assert got.kind == "failed", got
    finally:
        proc.kill()
        proc.wait()
        assert side.stop() == 0


def test_ended_engines_drain_at_most_max_engines_at_once(pool, tmp_path) -> None:
    """Each draining generation keeps an agent and its memory: at most --max-engines
    drain at once. Past it an ended engine's holds end at once (counted), and the
    ones already draining are still served."""
    from kvsidecar.sim.models import hybrid
    side = SidecarProcess(tmp_path, "dr-max", args=["--metrics-port", "0",
                                                    "--max-engines", "1"]).start()
    try:
        sents = []
        for name in ("A", "B"):
            E = SimEngine(pool.uid(name), hybrid, 1, 96, [side])
            sents.append(E.prefill(f"{E.engine_id}-r", Request(seed=50, prompt_tokens=TOKENS)))
            E.clients[0].deregister(E.engine_id, "drain")
            E.clients[0].close()
        assert side.metric("kvsidecar_limit_refusals_total", limit="draining") == 1
        _until("A not draining", lambda: side.metric("kvsidecar_engines_draining") == 1)
        with _d_engine(pool, 1) as D:
            for s in sents:
                D.start_read(s)
            got = D.wait_for([s.request_id for s in sents])
            assert {c.kind for c in got[sents[0].request_id].values()} == {"received"}
            assert not D.verify(sents[0].request_id)
            assert {c.kind for c in got[sents[1].request_id].values()} == {"failed"}
        _until("A never freed", lambda: side.metric("kvsidecar_engines_draining") == 0)
    finally:
        assert side.stop() == 0
