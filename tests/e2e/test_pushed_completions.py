"""End to end (issue #31): completions pushed to an engine that polls without
waiting (``SidecarClient.poll_nowait``). A poll stays parked at D's sidecar and
is answered when a completion arrives; the engine's empty polls then send
nothing. Real sidecars with metrics: the sidecar's own count of the polls it
answered says how many went out; bytes are checked against the oracle
(LAYOUT.md section 6)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvsidecar.ipc.client import SidecarClient, SidecarTimeout, UnknownEngine
from kvsidecar.ipc.client_core import PARK_S
from kvsidecar.ipc.protocol import Completion
from kvsidecar.ipc.seqpacket import BlockingChannel
from kvsidecar.sim.cluster import SidecarProcess, SimEngine, engine_pair
from kvsidecar.sim.models import attn
from kvsidecar.sim.oracle import Request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

POLLS = "kvsidecar_engine_requests_total"
LEASE_S = 3.0


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[tuple[SimEngine, SimEngine, SidecarProcess]]:
    # A short engine lease: the idle test shows parked polls keep the engine alive.
    with _pair(tmp_path, LEASE_S) as pair:
        yield pair


def _pair(tmp_path: Path, lease_s: float
          ) -> contextlib.AbstractContextManager[tuple[SimEngine, SimEngine, SidecarProcess]]:
    return engine_pair(tmp_path, "pc", attn(8),
                       ["--metrics-port", "0", "--engine-lease", str(lease_s)])


def _polls(d: SidecarProcess) -> float:
    return d.metric(POLLS, op="poll")


def _until(client: SidecarClient, engine_id: str, want: set[str], timeout_s: float = 60.0
           ) -> tuple[list[Completion], int, int]:
    """poll_nowait until every request of ``want`` came: everything returned,
    the calls made and how many of them returned something."""
    got: list[Completion] = []
    calls = answered = 0
    deadline = time.monotonic() + timeout_s
    while not want <= {c.request_id for c in got}:
        assert time.monotonic() < deadline, f"no completion for {want}: {got}"
        items = client.poll_nowait(engine_id)
        calls += 1
        answered += bool(items)
        got += items
        time.sleep(0.001)
    return got, calls, answered


def test_completions_are_pushed_and_empty_polls_send_nothing(engines) -> None:
    """16 reads: each completion comes exactly once, bytes oracle-exact; the
    sidecar answered at most one poll per call that returned something, plus
    one per PARK_S of waiting, plus the first: the thousands of empty calls
    between sent nothing."""
    P, D, d = engines
    c = D.clients[0]
    assert c.poll_nowait(D.engine_id) == []  # parks the first
    before, t0 = _polls(d), time.monotonic()
    for _ in range(500):  # nothing to report: no message
        assert c.poll_nowait(D.engine_id) == []
    sents = [P.prefill(f"r{i}", Request(seed=300 + i, prompt_tokens=9 + 5 * i))
             for i in range(16)]
    D.start_reads(sents)
    rids = {s.request_id for s in sents}
    got, calls, answered = _until(c, D.engine_id, rids)
    for _ in range(200):  # nothing comes twice
        got += c.poll_nowait(D.engine_id)
    elapsed = time.monotonic() - t0
    assert sorted(x.request_id for x in got) == sorted(rids), got
    assert {x.kind for x in got} == {"received"}, got
    for rid in rids:
        assert D.verify(rid) == [], rid
        D.finish(rid)
    polls = _polls(d) - before
    assert polls <= answered + elapsed / PARK_S + 1, (polls, answered, calls, elapsed)
    assert calls + 700 > 10 * polls, (polls, calls)
    # P's holds ended by D's notifications; P's engine polls the same way.
    sent, _, _ = _until(P.clients[0], P.engine_id, rids)
    assert {x.kind for x in sent} == {"sent"}, sent


def test_an_engine_that_only_polls_without_waiting_stays_registered(engines) -> None:
    """Idle for more than two engine leases, polling only with poll_nowait: each
    parked poll renews the lease as it arrives, so the engine is still
    registered and its next read lands."""
    P, D, _ = engines
    c = D.clients[0]
    end = time.monotonic() + 2.5 * LEASE_S
    while time.monotonic() < end:
        assert c.poll_nowait(D.engine_id) == []
        P.clients[0].poll_nowait(P.engine_id)
        time.sleep(0.01)
    assert D.engine_id in c.ping().engines
    sent = P.prefill("late", Request(seed=7, prompt_tokens=40))
    D.start_read(sent)
    got, _, _ = _until(c, D.engine_id, {"late"})
    assert [x.kind for x in got] == ["received"] and D.verify("late") == []


def test_refusals_and_blocking_polls_mix_with_pushed_ones(engines) -> None:
    """A read refused on sight (read_nowait) is reported by poll_nowait as a
    failed completion; a blocking poll taken between pushed ones returns what
    the parked poll did not, and nothing is reported twice."""
    P, D, _ = engines
    c = D.clients[0]
    c.poll_nowait(D.engine_id)  # parked
    good = P.prefill("g1", Request(seed=11, prompt_tokens=30))
    rec = D.start_read(good)
    far = [[D.layout.num_blocks + 5]]  # outside D's cache: refused on sight
    c.read_nowait(D.engine_id, "bad", far, good.remote, good.block_ids,
                  remote_request_id="g1", remote_tokens=good.tokens)
    seen: list[Completion] = []
    deadline = time.monotonic() + 60
    while len(seen) < 2:
        assert time.monotonic() < deadline, seen
        seen += c.poll_nowait(D.engine_id)
        seen += c.poll(D.engine_id)  # the blocking poll between
        time.sleep(0.001)
    for _ in range(100):
        seen += c.poll_nowait(D.engine_id) + c.poll(D.engine_id)
    kinds = sorted((x.request_id, x.kind) for x in seen)
    assert kinds == [("bad", "failed"), ("g1", "received")], seen
    refusal = next(x for x in seen if x.kind == "failed")
    assert "refused by the sidecar (bad_request)" in refusal.reason, refusal
    assert D.verify("g1") == [] and rec.request_id == "g1"


def test_a_deregistered_engine_is_named_by_the_next_polls(engines) -> None:
    """An engine deregistered (by its own other client) while a poll of it is
    parked: the parked poll is answered, and a poll_nowait soon after raises
    UnknownEngine, as poll does."""
    _, D, d = engines
    c = D.clients[0]
    c.poll_nowait(D.engine_id)
    with SidecarClient(d.socket) as other:
        other.deregister(D.engine_id)
    deadline = time.monotonic() + 10
    with pytest.raises(UnknownEngine):
        while time.monotonic() < deadline:
            c.poll_nowait(D.engine_id)
            time.sleep(0.01)
    with pytest.raises(UnknownEngine):
        c.poll(D.engine_id)


def test_a_stopped_sidecar_is_noticed_and_its_completions_come_after(tmp_path: Path) -> None:
    """D's sidecar stopped (SIGSTOP) with a poll parked there: poll_nowait says
    so (SidecarTimeout) once the poll has gone unanswered for PARK_S + the
    client's timeout, not before; once the sidecar runs again the next calls
    park again and a read's completion comes, once."""
    with _pair(tmp_path, 30.0) as (P, D, d):
        timeout_s = 0.5
        c = SidecarClient(d.socket, timeout_s=timeout_s)
        try:
            t0 = time.monotonic()  # before the park: the wait runs from it
            assert c.poll_nowait(D.engine_id) == []  # parked
            assert d.proc is not None
            os.kill(d.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(SidecarTimeout, match="no answer to a poll parked"):
                    while time.monotonic() - t0 < 30:
                        assert c.poll_nowait(D.engine_id) == []
                        time.sleep(0.01)
                waited = time.monotonic() - t0
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
            assert PARK_S + timeout_s <= waited < 10, waited
            sent = P.prefill("s1", Request(seed=5, prompt_tokens=24))
            D.start_read(sent)
            got, _, _ = _until(c, D.engine_id, {"s1"})
            for _ in range(100):
                got += c.poll_nowait(D.engine_id)
            assert [x.kind for x in got] == ["received"] and D.verify("s1") == []
        finally:
            c.close()


def test_what_a_parked_poll_brought_is_returned_even_if_the_sidecar_then_stalls(
        tmp_path: Path) -> None:
    """The parked poll's answer (a read's completion) is taken from the socket by
    another call (a ping that then times out: the sidecar is stopped); the next
    poll() returns it at once, without the round trip that would time out: a
    completion the client took is never lost to a later failure."""
    with _pair(tmp_path, 30.0) as (P, D, d):
        c = SidecarClient(d.socket, timeout_s=0.5)
        try:
            D.start_read(P.prefill("x", Request(seed=3, prompt_tokens=24)))
            deadline = time.monotonic() + 30
            while d.metric("kvsidecar_completions_total", outcome="received") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert c.poll_nowait(D.engine_id) == []  # parks: answered at once with x
            while d.metric(POLLS, op="poll") < 1:  # answered, so queued on c's socket
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert d.proc is not None
            os.kill(d.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(SidecarTimeout):
                    c.ping()  # takes the queued answer on its way, then times out
                got = c.poll(D.engine_id)
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
            assert [(x.request_id, x.kind) for x in got] == [("x", "received")]
            assert D.verify("x") == []
            for _ in range(50):  # and only once
                assert c.poll_nowait(D.engine_id) == [] and c.poll(D.engine_id) == []
        finally:
            c.close()


def test_a_registration_anew_makes_what_its_predecessors_parked_poll_brought_stale(
        engines) -> None:
    """The engine deregistered and registered again (a new epoch) while a poll of
    the old registration was parked, its answer read on the way: neither a
    stale unknown_engine nor the new registration's completions twice."""
    _, D, d = engines
    c = D.clients[0]
    c.poll_nowait(D.engine_id)  # parked, for the first registration
    with SidecarClient(d.socket) as other:
        other.deregister(D.engine_id)  # the parked poll is answered (old epoch)
    time.sleep(0.2)
    c.poll_nowait(D.engine_id)  # takes that, parks again: refused unknown_engine
    time.sleep(0.2)
    reg = c.register(D.engine_id, 0, D.layout, allocate=True)  # reads the refusal on its way
    try:
        c.hold(D.engine_id, "h", [[1, 2]], timeout_s=0.2)  # a completion of the new one
        time.sleep(1.0)
        got = c.poll_nowait(D.engine_id) + c.poll(D.engine_id)
        for _ in range(50):
            got += c.poll_nowait(D.engine_id)
            time.sleep(0.01)
        got += c.poll(D.engine_id)
        assert [(x.request_id, x.kind) for x in got] == [("h", "expired")], got
    finally:
        c.deregister(D.engine_id)
        for r in reg.regions:
            r.close()


def test_a_closed_connections_waiting_poll_gives_its_place_back(engines) -> None:
    """Six connections each leave a poll waiting 30 s at D's sidecar and close:
    their polls end with them, so an engine rank's 4 places for waiting polls
    are free again and the next parked poll waits (is not answered at once
    and counted at the limit)."""
    _, D, d = engines
    limit = "kvsidecar_limit_refusals_total"
    before = d.metric(limit, limit="waiting_polls")
    poll = msgspec.msgpack.encode({"op": "poll", "id": 1, "v": 1, "engine_id": D.engine_id,
                                   "wait_s": 30.0})
    for _ in range(6):
        with BlockingChannel(d.socket, timeout_s=30) as chan:
            chan.send(poll)
            assert not chan.readable(0.05)  # waiting, as asked
    time.sleep(0.3)  # the sidecar sees the closes
    answered = d.metric(POLLS, op="poll")
    c = D.clients[0]
    assert c.poll_nowait(D.engine_id) == []  # parks
    time.sleep(0.3)
    assert d.metric(limit, limit="waiting_polls") == before
    assert d.metric(POLLS, op="poll") == answered  # still waiting
