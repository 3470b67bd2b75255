"""Metrics over real HTTP from real daemons that moved real transfers.

One P sidecar and two D sidecars (P tp1 -> D tp2, hybrid attention + Mamba);
every counter and histogram is read back through ``/metrics`` with the
Prometheus text parser and compared with what the test did, and the bytes are
checked with the LAYOUT.md oracle first (metrics of a wrong transfer prove
nothing).
"""

from __future__ import annotations

import itertools
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.sim.cluster import Sent, SidecarProcess, engines
from kvsidecar.sim.models import hybrid
from kvsidecar.sim.oracle import Request

pytestmark = pytest.mark.e2e

N_READS = 3


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    """Sum of ``name`` over the label sets that contain ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """Run N_READS good reads and one read from an unreachable peer, then hand the
    sidecars (still running) to the tests."""
    work: Path = tmp_path_factory.mktemp("metrics")
    flags = ["--metrics-port", "0", "--handshake-timeout", "2"]
    p = [SidecarProcess(work, "mp0", args=flags)]
    d = [SidecarProcess(work, f"md{i}", args=flags) for i in range(2)]
    for s in p + d:
        s.start()
    ids = itertools.count()
    try:
        with engines(p, d, lambda pre: f"{pre}{next(ids)}", hybrid, 1, 2) as (P, (D,)):
            rids = [f"m{i}" for i in range(N_READS)]
            for i, rid in enumerate(rids):
                D.start_read(P.prefill(rid, Request(seed=40 + i, prompt_tokens=60 + 50 * i)))
            got = D.wait_for(rids)
            for rid in rids:
                assert {c.kind for c in got[rid].values()} == {"received"}, got[rid]
                assert not D.verify(rid)
            assert {c.kind for r in P.wait_for(rids).values() for c in r.values()} == {"sent"}
            # A peer nobody listens on: the handshake fails, the read fails.
            sent = P.prefill("gone", Request(seed=7, prompt_tokens=30), hold=False)
            dead = Sent("gone", msgspec.structs.replace(sent.remote,
                                                        handshake=["127.0.0.1:9"]),
                        sent.block_ids, sent.req)
            D.start_read(dead)
            assert {c.kind for c in D.wait_for(["gone"])["gone"].values()} == {"failed"}
            yield {"P": P, "D": D, "p": p, "d": d,
                   "scrapes": [scrape(s.metrics_port) for s in p + d]}
    finally:
        for s in p + d:
            assert s.stop() == 0, s.read_log()


def test_decode_side_transfer_metrics(moved: dict[str, object]) -> None:
    P, D = moved["P"], moved["D"]
    scrapes = moved["scrapes"]
    assert isinstance(scrapes, list)
    for m in scrapes[1:]:  # each D sidecar serves one D rank
        eng = {"engine": D.engine_id}  # type: ignore[attr-defined]
        link = {**eng, "peer": P.engine_id}  # type: ignore[attr-defined]
        assert value(m, "kvsidecar_completions_total", **eng, outcome="received") == N_READS
        assert value(m, "kvsidecar_completions_total", **eng, outcome="failed") == 1
        # One transfer per read (each D rank reads from the one P rank).
        assert value(m, "kvsidecar_transfer_seconds_count", **link) == N_READS
        assert value(m, "kvsidecar_transfer_post_seconds_count", **link) == N_READS
        nbytes = value(m, "kvsidecar_transfer_bytes_sum", **link)
        assert nbytes > 0 and value(m, "kvsidecar_read_bytes_total", **link) == nbytes
        posted = value(m, "kvsidecar_transfer_descriptors_sum", **link)
        planned = value(m, "kvsidecar_transfer_descriptors_planned_sum", **link)
        assert 0 < posted <= planned
        assert value(m, "kvsidecar_read_queue_seconds_count", **eng) == N_READS
        assert value(m, "kvsidecar_read_seconds_count", **eng) == N_READS
        assert value(m, "kvsidecar_engine_requests_total", op="read", error="") == N_READS + 1
        assert value(m, "kvsidecar_handshakes_total", side="client", result="ok") == 1
        assert value(m, "kvsidecar_handshakes_total", side="client", result="failed") == 1
        assert value(m, "kvsidecar_transfer_failures_total") == 0
        assert value(m, "kvsidecar_engines") == 1
        assert value(m, "kvsidecar_registered_bytes", **eng) > 0
        assert value(m, "kvsidecar_build_info") == 1


def test_prefill_side_metrics(moved: dict[str, object]) -> None:
    P = moved["P"]
    scrapes = moved["scrapes"]
    assert isinstance(scrapes, list)
    m = scrapes[0]
    assert value(m, "kvsidecar_completions_total", engine=P.engine_id,  # type: ignore[attr-defined]
                 outcome="sent") == N_READS
    # Two D ranks each notify the one P rank once per read.
    assert value(m, "kvsidecar_notifications_received_total", outcome="ok") == 2 * N_READS
    assert value(m, "kvsidecar_engine_requests_total", op="hold", error="") == N_READS
    assert value(m, "kvsidecar_holds_in_flight") == 0
