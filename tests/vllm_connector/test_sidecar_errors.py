"""No sidecar error takes vLLM down: each becomes the outcome of the requests it
concerns, through vLLM 0.33's real scheduler and real sidecars, with every
fault caused for real (a limit refuses, SIGSTOP silences, SIGKILL and a
restart lose the registration).

vLLM takes an exception from a connector call for a fatal engine error, so
every test here also shows that no step raised (``Engine.step`` would).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("KVSIDECAR_REQUIRE_VLLM"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm==0.33.0)")

from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from kvsidecar.daemon.observability import SAMPLE_PERIOD_S
from kvsidecar.integrations.vllm import KvSidecarConnector
from kvsidecar.ipc.client import SidecarClient
from kvsidecar.sim.cluster import SidecarProcess

from .harness import Engine, failed_reads, make_engine, oracle_fill, request, write_model
from .test_connector import (
    FAST,
    WAIT_S,
    prefill,
    run_until,
    schedule_reads,
    start_all,
    verify,
)

pytestmark = pytest.mark.vllm

_ids = itertools.count()
CLIENT_TIMEOUT_S = 1.0  # the connector's per-call wait (default 10 s): SIGSTOP tests stay short


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model(tmp_path_factory.mktemp("models") / "llama", False)


def engines(model: str, p_side: SidecarProcess, d_side: SidecarProcess,
            seeds: dict[str, int]) -> tuple[Engine, Engine]:
    n = next(_ids)
    P = make_engine(f"P{n}", model, "kv_producer", 1, [p_side.socket], 32, False)
    D = make_engine(f"D{n}", model, "kv_consumer", 1, [d_side.socket], 32, False)
    P.fill = oracle_fill(lambda rid: seeds[rid])
    # Registered (a NIXL agent can take seconds to make on a loaded machine):
    # from now on each call waits CLIENT_TIMEOUT_S, as client_timeout_s sets it.
    for eng in (P, D):
        for c in eng.workers:
            assert c.worker is not None
            c.worker.client.timeout_s = CLIENT_TIMEOUT_S
    return P, D


def stats_of(eng: Engine) -> dict[str, Any]:
    total = KvSidecarConnector.build_kv_connector_stats()
    assert total is not None
    for st in eng.stats:
        total.aggregate(st)
    return {k: len(v) for k, v in total.data.items() if k.startswith("num_")}


def errors_naming(caplog: pytest.LogCaptureFixture, rid: str,
                  level: int = logging.ERROR) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= level and f"request {rid}:" in r.getMessage()]


def read_and_verify(P: Engine, D: Engine, rid: str, tokens: int, seed: int) -> None:
    params = prefill(P, rid, tokens, seed)
    D.sched.add_request(request(D, rid, tokens, params, seed=seed))
    blocks = schedule_reads(D, rid)[rid]
    run_until(D, lambda: D.sched.requests[rid].status == RequestStatus.RUNNING)
    verify(D, rid, blocks, tokens, seed)
    run_until(P, lambda: rid not in P.sched.requests)


@pytest.fixture
def pair_sidecars(tmp_path: Path, request: pytest.FixtureRequest
                  ) -> Iterator[tuple[SidecarProcess, SidecarProcess]]:
    p_args, d_args = request.param
    p = SidecarProcess(tmp_path, "p", args=[*p_args, *FAST])
    d = SidecarProcess(tmp_path, "d", args=[*d_args, *FAST])
    start_all([p, d])
    try:
        yield p, d
    finally:
        for s in (p, d):
            if s.proc is not None and s.alive():
                s.proc.send_signal(signal.SIGCONT)
            s.stop()


@pytest.mark.parametrize("pair_sidecars", [(["--max-holds-per-engine", "1"], [])],
                         indirect=True)
def test_a_refused_hold_ends_its_send_single_and_batched(
        model: str, pair_sidecars: tuple[SidecarProcess, SidecarProcess],
        caplog: pytest.LogCaptureFixture) -> None:
    """P's sidecar holds one request at a time (``--max-holds-per-engine 1``).
    Two prefills finishing in one step go in one batch: the first is held, the
    second refused; a third, alone, is refused as a single hold. Each refused
    one is reported ``finished_sending`` at once (vLLM frees its blocks), logged
    at ERROR with its id and counted as a failed transfer; the held one is
    still read, oracle-exact."""
    caplog.set_level(logging.ERROR, logger="kvsidecar.integrations.vllm")
    seeds = {"h1": 71, "h2": 72, "h3": 73}
    P, D = engines(model, *pair_sidecars, seeds)
    try:
        for rid in ("h1", "h2"):
            P.sched.add_request(request(P, rid, 40, {"do_remote_decode": True}, max_tokens=1,
                                        seed=seeds[rid]))
        params: dict[str, dict[str, Any]] = {}
        sent: set[str] = set()
        for _ in range(4):
            _, agg = P.step()
            out = agg.kv_connector_output
            sent |= set((out.finished_sending or ()) if out else ())
            for rid in ("h1", "h2"):
                outs = P.outputs.get(rid, [])
                if outs and outs[-1].finished:
                    params[rid] = dict(outs[-1].kv_transfer_params or {})
        assert sorted(params) == ["h1", "h2"]
        assert sent == {"h2"} and "h2" not in P.sched.requests and "h1" in P.sched.requests
        assert any("--max-holds-per-engine" in m for m in errors_naming(caplog, "h2"))
        params["h3"] = prefill(P, "h3", 33, seeds["h3"])
        run_until(P, lambda: "h3" not in P.sched.requests)  # refused alone, freed
        assert errors_naming(caplog, "h3") and not errors_naming(caplog, "h1")
        assert stats_of(P)["num_failed_transfers"] == 2
        D.sched.add_request(request(D, "h1", 40, params["h1"], seed=seeds["h1"]))
        blocks = schedule_reads(D, "h1")["h1"]
        run_until(D, lambda: D.sched.requests["h1"].status == RequestStatus.RUNNING)
        verify(D, "h1", blocks, 40, seeds["h1"])
        run_until(P, lambda: "h1" not in P.sched.requests)
    finally:
        P.shutdown()
        D.shutdown()


@pytest.mark.parametrize("pair_sidecars", [([], ["--max-reads-per-engine", "1"])],
                         indirect=True)
def test_a_read_the_sidecar_refuses_fails_alone_and_is_recomputed(
        model: str, pair_sidecars: tuple[SidecarProcess, SidecarProcess],
        caplog: pytest.LogCaptureFixture) -> None:
    """D's sidecar takes one read of an engine at a time
    (``--max-reads-per-engine 1``). Two requests scheduled in one D step go in
    one batch, sent without waiting for the answer (``read_many_nowait``): the
    first is read, oracle-exact; the second is refused, and the refusal comes
    with a later poll as a failed read: finished with its blocks invalid (vLLM
    recomputes it), logged at ERROR with its id and the limit, counted as a
    failed transfer; no step raised."""
    caplog.set_level(logging.ERROR, logger="kvsidecar.integrations.vllm")
    seeds = {"r1": 61, "r2": 62}
    P, D = engines(model, *pair_sidecars, seeds)
    try:
        params = {rid: prefill(P, rid, 40, seed) for rid, seed in seeds.items()}
        for rid, seed in seeds.items():
            D.sched.add_request(request(D, rid, 40, params[rid], seed=seed))
        blocks = schedule_reads(D, "r1", "r2")  # one step: one batch

        def refused() -> list[str]:
            return [rid for rid in seeds if any("--max-reads-per-engine" in m
                                                for m in errors_naming(caplog, rid))]

        def read_one_runs() -> bool:
            if len(refused()) != 1:
                return False
            (other,) = set(seeds) - set(refused())
            return D.sched.requests[other].status == RequestStatus.RUNNING

        run_until(D, read_one_runs)
        (gone,) = refused()
        (read,) = set(seeds) - {gone}
        verify(D, read, blocks[read], 40, seeds[read])
        run_until(D, lambda: gone in D.outputs and D.outputs[gone][-1].finished)
        assert D.outputs[gone][-1].finish_reason != FinishReason.ERROR  # recomputed
        assert stats_of(D)["num_failed_transfers"] == 1 and not errors_naming(caplog, read)
        run_until(P, lambda: read not in P.sched.requests)
    finally:
        P.shutdown()
        D.shutdown()


@pytest.mark.parametrize("pair_sidecars", [([], [])], indirect=True)
def test_a_stopped_sidecar_delays_requests_but_loses_none(
        model: str, pair_sidecars: tuple[SidecarProcess, SidecarProcess],
        caplog: pytest.LogCaptureFixture) -> None:
    """A sidecar that does not answer (SIGSTOP: the connector's calls time out)
    may still hold or write our blocks, so nothing is reported while it is
    silent. P's hold sent while its sidecar is stopped is placed again once it
    answers; D's reads in flight while its sidecar is stopped complete once it
    answers; both arrive oracle-exact, and no step raised."""
    caplog.set_level(logging.WARNING, logger="kvsidecar.integrations.vllm")
    p_side, d_side = pair_sidecars
    seeds = {"s1": 81, "s2": 82}
    P, D = engines(model, p_side, d_side, seeds)
    assert p_side.proc is not None and d_side.proc is not None
    try:
        params = {"s1": prefill(P, "s1", 50, seeds["s1"])}
        run_until(P, lambda: "s1" in P.workers[0].worker._holding)  # type: ignore[union-attr]
        p_side.proc.send_signal(signal.SIGSTOP)
        params["s2"] = prefill(P, "s2", 45, seeds["s2"])
        for _ in range(3):  # the hold goes out and gets no answer: nothing is reported
            _, agg = P.step()
            out = agg.kv_connector_output
            assert not (out and "s2" in (out.finished_sending or ())), out
        # The first call that went unanswered is logged at ERROR; the hold waits.
        assert "s2" in P.sched.requests and errors_naming(caplog, "s2", logging.WARNING)
        assert any("does not answer" in r.getMessage() for r in caplog.records
                   if r.levelno == logging.ERROR)
        p_side.proc.send_signal(signal.SIGCONT)
        pw = P.workers[0].worker
        assert pw is not None and "s2" in pw._uncertain
        run_until(P, lambda: "s2" not in pw._uncertain)  # placed once P's sidecar answers
        assert "s2" in pw._holding and "s2" in P.sched.requests
        for rid, tokens in (("s1", 50), ("s2", 45)):
            D.sched.add_request(request(D, rid, tokens, params[rid], seed=seeds[rid]))
        blocks = schedule_reads(D, "s1", "s2")
        d_side.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        while time.monotonic() - stopped < 3 * CLIENT_TIMEOUT_S:
            _, agg = D.step()  # polls time out: nothing finishes, nothing fails
            out = agg.kv_connector_output
            assert out is None or not (out.finished_recving or out.failed_recving), out
        d_side.proc.send_signal(signal.SIGCONT)
        run_until(D, lambda: all(D.sched.requests[r].status == RequestStatus.RUNNING
                                 for r in ("s1", "s2")))
        verify(D, "s1", blocks["s1"], 50, seeds["s1"])
        verify(D, "s2", blocks["s2"], 45, seeds["s2"])
        run_until(P, lambda: not P.sched.requests)
        assert stats_of(D)["num_failed_transfers"] == 0
    finally:
        P.shutdown()
        D.shutdown()


def _stepper(P: Engine, sent: list[str]) -> Callable[[], None]:
    """One step of P's engine, its finished sends appended to ``sent``."""
    def p_step() -> None:
        _, agg = P.step()
        out = agg.kv_connector_output
        sent.extend(out.finished_sending or () if out else ())
    return p_step


def _hold_unanswered_then_placed(P: Engine, p_side: SidecarProcess, rid: str, seed: int,
                                 p_step: Callable[[], None]) -> dict[str, Any]:
    """Prefill ``rid`` (45 tokens) while P's sidecar is stopped (SIGSTOP), so
    its hold gets no answer and P's connector marks it uncertain; then let
    the sidecar run again until it placed that first copy. The request's
    kv_transfer_params."""
    assert p_side.proc is not None
    pw = P.workers[0].worker
    p_side.proc.send_signal(signal.SIGSTOP)
    params: dict[str, Any] = prefill(P, rid, 45, seed)
    deadline = time.monotonic() + WAIT_S
    while rid not in pw._uncertain:  # the hold went out and got no answer
        assert time.monotonic() < deadline, "P's hold never went out"
        p_step()
    p_side.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + WAIT_S
    while p_side.metric("kvsidecar_holds_in_flight") < 1:  # the first copy is placed
        assert time.monotonic() < deadline, "P's sidecar never placed the first hold"
        time.sleep(0.05)
    return params


@pytest.mark.parametrize("pair_sidecars", [(["--metrics-port", "0"], [])], indirect=True)
def test_a_hold_placed_again_after_it_was_read_pins_nothing(
        model: str, pair_sidecars: tuple[SidecarProcess, SidecarProcess]) -> None:
    """P's hold gets no answer (its sidecar stopped, SIGSTOP: the call times
    out) but is placed once the sidecar runs again, and D reads it, so it ends
    ``sent``, before P's connector places it again (P does not step meanwhile).
    Placed again, it meets ``duplicate`` (its end is not polled yet), never a
    second, phantom hold pinning blocks vLLM frees once it hears of the first
    end: P reports the send finished exactly once, P's sidecar ends one hold and
    then holds nothing, and a second read of the same request by D is refused
    (those blocks are vLLM's again, and may hold another request's bytes)."""
    p_side, d_side = pair_sidecars
    seeds = {"g": 86}
    P, D = engines(model, p_side, d_side, seeds)
    assert p_side.proc is not None
    pw = P.workers[0].worker
    assert pw is not None
    sent: list[str] = []
    p_step = _stepper(P, sent)
    try:
        params = _hold_unanswered_then_placed(P, p_side, "g", seeds["g"], p_step)
        D.sched.add_request(request(D, "g", 45, dict(params), seed=seeds["g"]))
        blocks = schedule_reads(D, "g")["g"]
        run_until(D, lambda: D.sched.requests["g"].status == RequestStatus.RUNNING)
        verify(D, "g", blocks, 45, seeds["g"])
        deadline = time.monotonic() + WAIT_S
        while p_side.metric("kvsidecar_completions_total", outcome="sent") < 1:
            assert time.monotonic() < deadline, "P's hold never ended sent"
            time.sleep(0.05)
        assert "g" in pw._uncertain  # P's connector has not placed it again yet

        deadline = time.monotonic() + WAIT_S
        while "g" in P.sched.requests:  # placed again, then the first end is polled
            assert time.monotonic() < deadline, "P never finished sending g"
            p_step()
        assert sent == ["g"]
        time.sleep(2 * SAMPLE_PERIOD_S)  # the gauge is sampled
        assert p_side.metric("kvsidecar_holds_in_flight") == 0, "a phantom hold of g is open"

        # D reads the same request of P again: nothing may be read from freed blocks.
        D.sched.add_request(request(D, "g-again", 45, dict(params), seed=seeds["g"]))
        D.step()
        deadline = time.monotonic() + WAIT_S
        ended = None
        while ended is None:
            assert time.monotonic() < deadline, "D's second read never ended"
            _, agg = D.step()
            out = agg.kv_connector_output
            if out is not None and "g-again" in (out.finished_recving or ()):
                ended = out
            p_step()
        assert "g-again" in failed_reads(ended), "a read of an ended hold was served"
        for _ in range(5):
            p_step()
        assert sent == ["g"]  # finished exactly once
        assert p_side.metric("kvsidecar_completions_total", outcome="sent") == 1
    finally:
        P.shutdown()
        D.shutdown()


@pytest.mark.parametrize("pair_sidecars", [
    ([], ["--handshake-timeout", "10", "--metrics-port", "0"])], indirect=True)
@pytest.mark.parametrize("read", ["taken", "unread"])
def test_a_sidecar_restarted_under_requests_fails_them_and_serves_again(
        model: str, pair_sidecars: tuple[SidecarProcess, SidecarProcess],
        caplog: pytest.LogCaptureFixture, read: str) -> None:
    """D's sidecar is killed and restarted while D's read waits on a silent P
    (``taken``), or with the read still unread in its socket (``unread``, D's
    sidecar stopped: the client sends it again to the restarted sidecar,
    which refuses it ``unknown_engine``): either way the read fails as a
    failed request (finished + failed, its blocks invalid) for the lost
    registration, in the step that learns it is gone, and the rank registers
    again. P's sidecar is killed and restarted with that hold open: the hold
    ends (``finished_sending``, P frees the blocks) and P registers again. A
    failed notification (D aborts a request before its read while P's sidecar
    is dead) is counted apart from failed transfers. Then a new request is
    served, oracle-exact: the restarted sidecars learned the memory again."""
    caplog.set_level(logging.ERROR, logger="kvsidecar.integrations.vllm")
    p_side, d_side = pair_sidecars
    seeds = {"x": 91, "n": 92, "y": 93}
    P, D = engines(model, p_side, d_side, seeds)
    assert p_side.proc is not None
    try:
        params = prefill(P, "x", 60, seeds["x"])
        run_until(P, lambda: bool(P.workers[0].worker._holding))  # type: ignore[union-attr]
        p_side.proc.send_signal(signal.SIGSTOP)  # D's read waits in its handshake
        assert d_side.proc is not None
        if read == "unread":
            d_side.proc.send_signal(signal.SIGSTOP)
        D.sched.add_request(request(D, "x", 60, dict(params), seed=seeds["x"]))
        so, _ = D.step()
        (job,) = so.kv_connector_metadata.reads
        if read == "taken":
            deadline = time.monotonic() + WAIT_S
            while d_side.metric("kvsidecar_reads_in_flight") < 1:
                assert time.monotonic() < deadline, "D's sidecar never took the read"
                time.sleep(0.01)
        d_side.kill()
        d_side.start(600.0)
        failed = None
        deadline = time.monotonic() + WAIT_S
        while failed is None and time.monotonic() < deadline:
            _, agg = D.step()
            out = agg.kv_connector_output
            if "x" in failed_reads(out):
                failed = out
        assert failed is not None, "D never failed the read its sidecar lost"
        assert "x" in (failed.finished_recving or ())
        assert failed.invalid_block_ids == set(job.local_block_ids[0])
        assert any("lost engine" in m for m in errors_naming(caplog, "x"))
        run_until(D, lambda: D.workers[0].worker.registrations == 2)  # type: ignore[union-attr]

        p_side.kill()  # P dies with "x" held
        n_params = dict(params, remote_request_id="n")
        D.sched.add_request(request(D, "n", 60, n_params, seed=seeds["n"]))
        D.sched.finish_requests("n", RequestStatus.FINISHED_ABORTED)  # notify-only read
        run_until(D, lambda: stats_of(D)["num_failed_notifications"] == 1)
        assert any("telling the prefill side" in m for m in errors_naming(caplog, "n"))
        p_side.start(600.0)
        run_until(P, lambda: "x" not in P.sched.requests)  # its send ended with the registration
        assert any("cannot be held" in m and "lost engine" in m
                   for m in errors_naming(caplog, "x"))
        run_until(P, lambda: P.workers[0].worker.registrations == 2)  # type: ignore[union-attr]
        assert stats_of(D)["num_failed_transfers"] == 1

        read_and_verify(P, D, "y", 50, seeds["y"])
    finally:
        P.shutdown()
        D.shutdown()


@pytest.mark.parametrize("pair_sidecars", [(["--metrics-port", "0", "--drain-timeout", "60"],
                                            [])], indirect=True)
def test_a_hold_placed_again_while_its_sidecar_drains_stays_held_until_read(
        model: str, pair_sidecars: tuple[SidecarProcess, SidecarProcess]) -> None:
    """P's hold gets no answer (SIGSTOP) but is placed once the sidecar runs
    again; then the sidecar is told to stop (SIGTERM): it refuses new holds and
    drains the open ones, serving their readers. P's connector places the hold
    again: the sidecar holds it, so the copy meets ``duplicate`` (not the
    ``unavailable`` a new hold gets), and P keeps its blocks until the one
    completion ends its send. Were the copy refused, P would report the send
    finished (vLLM frees and reuses the blocks) while D may still read them."""
    p_side, d_side = pair_sidecars
    seeds = {"g": 87}
    P, D = engines(model, p_side, d_side, seeds)
    assert p_side.proc is not None
    pw = P.workers[0].worker
    assert pw is not None
    sent: list[str] = []
    p_step = _stepper(P, sent)
    try:
        params = _hold_unanswered_then_placed(P, p_side, "g", seeds["g"], p_step)
        p_side.terminate()  # drains: new holds are refused, open ones served
        deadline = time.monotonic() + WAIT_S
        with SidecarClient(p_side.socket, timeout_s=5) as c:
            while not c.status().draining:
                assert time.monotonic() < deadline, "P's sidecar never began draining"
                time.sleep(0.05)

        deadline = time.monotonic() + WAIT_S
        while "g" in pw._uncertain:  # settled: placed again
            assert time.monotonic() < deadline, "P's connector never placed the hold again"
            p_step()
        assert sent == [], "P freed g's blocks while its sidecar still holds them"
        assert "g" in pw._holding

        D.sched.add_request(request(D, "g", 45, dict(params), seed=seeds["g"]))
        blocks = schedule_reads(D, "g")["g"]
        deadline = time.monotonic() + WAIT_S
        while D.sched.requests["g"].status != RequestStatus.RUNNING:
            assert time.monotonic() < deadline, "D's read of g never ended"
            D.step()
            p_step()
        verify(D, "g", blocks, 45, seeds["g"])
        deadline = time.monotonic() + WAIT_S
        while "g" in P.sched.requests:  # its one completion ends the send
            assert time.monotonic() < deadline, "P never finished sending g"
            p_step()
        assert sent == ["g"]
    finally:
        P.shutdown()
        D.shutdown()
