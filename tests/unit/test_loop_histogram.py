"""LoopHistogram exposes what prometheus_client's Histogram exposes for the same
observations (buckets, sum, count, OpenMetrics exemplars)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from kvsidecar.metrics.loop_histogram import LoopHistogram

BUCKETS = (0.001, 0.005, 0.01, 1.0)
VALUES = [0.0005, 0.001, 0.003, 0.005, 0.0051, 0.2, 3.0, 7.5, 0.001]


def _lines(text: bytes) -> list[str]:
    return sorted(ln for ln in text.decode().splitlines()
                  if ln and "_created" not in ln and not ln.startswith("#"))


def test_same_exposition_as_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    h = LoopHistogram("x_seconds", "doc", ("engine", "peer"), BUCKETS)
    ours.register(h)
    ref = Histogram("x_seconds", "doc", ("engine", "peer"), buckets=BUCKETS, registry=theirs)
    for i, v in enumerate(VALUES):
        labels = ("e", "p") if i % 3 else ("e", "q")
        h.labels(*labels).observe(v)
        ref.labels(*labels).observe(v)
    h.labels(engine="f", peer="p")  # a series with nothing observed yet
    ref.labels(engine="f", peer="p")
    assert _lines(generate_latest(ours)) == _lines(generate_latest(theirs))


def test_no_labels_and_exemplars() -> None:
    reg = CollectorRegistry()
    h = LoopHistogram("y_seconds", "doc", (), BUCKETS)
    reg.register(h)
    h.observe(0.004, {"request_id": "r1"})
    h.observe(0.5)
    text = openmetrics_latest(reg).decode()  # type: ignore[no-untyped-call]
    bucket = [ln for ln in text.splitlines() if ln.startswith('y_seconds_bucket{le="0.005"}')]
    assert bucket and '# {request_id="r1"} 0.004' in bucket[0]
    assert "y_seconds_count 2.0" in text
    assert "request_id" not in generate_latest(reg).decode()
