"""End to end: a poll that waits for its engine's next completion (``Poll.wait_s``,
protocol minor 4), so that an engine waiting for reads blocks instead of spinning."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from kvsidecar.daemon.handlers import MAX_WAITING_POLLS
from kvsidecar.ipc.client import SidecarClient
from kvsidecar.ipc.protocol import PROTOCOL_MINOR
from kvsidecar.sim.cluster import SidecarProcess, SimEngine, engines
from kvsidecar.sim.models import MakeLayout, attn
from kvsidecar.sim.oracle import Request

pytestmark = pytest.mark.e2e


class Pair:
    """One P and one D sidecar with metrics (the shared pool has none)."""

    def __init__(self, workdir: Path) -> None:
        self.p = [SidecarProcess(workdir, "wp", args=["--metrics-port", "0"])]
        self.d = [SidecarProcess(workdir, "wd", args=["--metrics-port", "0"])]
        self._ids = itertools.count()

    @property
    def all(self) -> list[SidecarProcess]:
        return self.p + self.d

    def engines(self, make: MakeLayout, p_tp: int, d_tp: int
                ) -> AbstractContextManager[tuple[SimEngine, list[SimEngine]]]:
        return engines(self.p, self.d, lambda prefix: f"{prefix}{next(self._ids)}", make,
                       p_tp, d_tp)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    pair = Pair(tmp_path_factory.mktemp("waiting-poll"))
    try:
        for s in pair.p + pair.d:
            s.start()
        yield pair
    finally:
        codes = [s.stop() for s in pair.p + pair.d]
        assert codes == [0, 0]


def _polls(sidecar: SidecarProcess) -> float:
    return sidecar.metric("kvsidecar_engine_requests_total", op="poll")


def test_a_waiting_poll_returns_the_read_it_waited_for(pool) -> None:
    """One poll, sent before the read completes, returns its ``received``."""
    with pool.engines(attn(8), 1, 1) as (P, (D,)):
        c = D.clients[0]
        assert c.ping().minor == PROTOCOL_MINOR >= 4
        assert c.poll(D.engine_id) == []  # acknowledge nothing; start clean
        sent = P.prefill("wait-read", Request(seed=3, prompt_tokens=24))
        d0 = pool.d[0]
        before = _polls(d0)
        D.start_read(sent)
        got = c.poll(D.engine_id, wait_s=30)
        assert _polls(d0) == before + 1  # one request, not a spin
        assert [(x.request_id, x.kind) for x in got] == [("wait-read", "received")]
        assert not D.verify("wait-read")


def test_a_waiting_poll_is_woken_by_a_hold_expiring(pool) -> None:
    with pool.engines(attn(8), 1, 1) as (P, _):
        c = P.clients[0]
        assert c.poll(P.engine_id) == []
        P.prefill("wait-expire", Request(seed=1, prompt_tokens=8), timeout_s=0.5)
        got = c.poll(P.engine_id, wait_s=30)
        assert [(x.request_id, x.kind) for x in got] == [("wait-expire", "expired")]


def test_an_empty_waiting_poll_outlasts_the_client_timeout(pool) -> None:
    """The client's deadline for a waiting poll is its timeout plus the wait: a
    wait longer than the timeout ends empty, not in SidecarTimeout."""
    with pool.engines(attn(8), 1, 1) as (P, _), \
            SidecarClient(pool.p[0].socket, timeout_s=0.3) as c:
        assert c.poll(P.engine_id, wait_s=0.8) == []


def test_waiting_polls_are_bounded_and_deregistration_wakes_them(pool) -> None:
    """At most MAX_WAITING_POLLS wait per engine rank; one more is answered at once
    (and counted); deregistering the engine answers the waiting ones."""
    with pool.engines(attn(8), 1, 1) as (P, _):
        p0 = pool.p[0]
        clients = [SidecarClient(p0.socket, timeout_s=10) for _ in range(MAX_WAITING_POLLS)]
        results: list[object] = []
        threads = [threading.Thread(target=lambda c=c: results.append(
            c.poll(P.engine_id, wait_s=60))) for c in clients]
        try:
            for t in threads:
                t.start()
            # Once all of them wait, one more poll is answered at once and counted
            # at the limit; until then it waits its short wait and comes back empty.
            refused = p0.metric("kvsidecar_limit_refusals_total", limit="waiting_polls")
            deadline = time.monotonic() + 60
            with SidecarClient(p0.socket, timeout_s=10) as extra:
                while p0.metric("kvsidecar_limit_refusals_total",
                                limit="waiting_polls") == refused:
                    assert time.monotonic() < deadline
                    assert extra.poll(P.engine_id, wait_s=0.2) == []
            assert all(t.is_alive() for t in threads)  # still waiting (wait_s=60)
            P.clients[0].deregister(P.engine_id)
            for t in threads:
                t.join(30)
            assert not any(t.is_alive() for t in threads)
            assert results == [[]] * MAX_WAITING_POLLS
        finally:
            for c in clients:
                c.close()
