"""LoopCounter exposes what prometheus_client's Counter exposes for the same
increments (``_total`` and ``_created``, text and OpenMetrics)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from kvsidecar.metrics.loop_counter import LoopCounter
from kvsidecar.metrics.loop_histogram import LoopHistogram


def _lines(text: bytes) -> list[str]:
    return sorted(ln for ln in text.decode().splitlines()
                  if ln and "_created" not in ln and not ln.startswith("# EOF"))


def _created(text: bytes) -> list[str]:
    return sorted(ln.rsplit(" ", 1)[0] for ln in text.decode().splitlines() if "_created" in ln)


@pytest.mark.parametrize("render", [generate_latest, openmetrics_latest])
def test_same_exposition_as_prometheus_client(render) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    c = LoopCounter("x_requests_total", "doc", ("op", "error"))
    ours.register(c)
    ref = Counter("x_requests_total", "doc", ("op", "error"), registry=theirs)
    for i, amount in enumerate([1, 1, 3.5, 0, 2, 1]):
        labels = ("read", "") if i % 3 else ("hold", "busy")
        c.labels(*labels).inc(amount)
        ref.labels(*labels).inc(amount)
    c.labels(op="poll", error="")  # a series never incremented
    ref.labels(op="poll", error="")
    assert _lines(render(ours)) == _lines(render(theirs))
    assert _created(render(ours)) == _created(render(theirs))


def test_no_labels_and_negative_refused() -> None:
    reg = CollectorRegistry()
    c = LoopCounter("y_total", "doc")
    reg.register(c)
    c.inc()
    c.inc(2)
    assert "y_total 3.0" in generate_latest(reg).decode()
    with pytest.raises(ValueError):
        c.inc(-1)
    with pytest.raises(ValueError):
        c.labels("extra")


@pytest.mark.parametrize("make", [lambda: LoopCounter("z_total", "doc", ("op", "error")),
                                  lambda: LoopHistogram("z", "doc", ("op", "error"), [1.0])])
def test_wrong_label_names_refused_as_prometheus_client_does(make) -> None:  # type: ignore[no-untyped-def]
    """Named label values must be exactly the metric's labels (a missing one
    was a KeyError, an extra one was dropped silently); prometheus_client's
    Counter refuses both with a ValueError, so do the loop-owned ones."""
    m = make()
    ref = Counter("z_total", "doc", ("op", "error"), registry=CollectorRegistry())
    for bad in ({"op": "read"}, {"op": "read", "error": "", "extra": "x"},
                {"op": "read", "eror": ""}):
        with pytest.raises(ValueError):
            ref.labels(**bad)
        with pytest.raises(ValueError, match="z"):
            m.labels(**bad)
    with pytest.raises(ValueError):
        m.labels("read", error="")
    assert m.labels(error="", op="read") is m.labels("read", "")
