"""A Prometheus counter for the series the event loop counts per request.

``prometheus_client.Counter.inc`` takes a lock (its ``MutexValue``) on every
call: about a microsecond here, and every read or hold counts several (the
engine request, its completion, the bytes read; on P the notification and the
lease claim). py-spy on a D sidecar under sustained batched reads put
``Counter.inc`` at ~3 % of the event loop's samples holding the GIL. The
series here are counted from the event loop thread only, so an increment is
one addition on a plain float; the scrape (another thread) reads them under
the GIL and hands them to ``prometheus_client`` through its public collector
interface, in the same exposition (``_total``, ``_created``) as its own
counters. Same idea as :mod:`~kvsidecar.metrics.loop_histogram`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvsidecar.metrics.loop_labels import label_key


class LoopCounterSeries:
    """One labelled series. Event loop thread only (see the module docstring)."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class LoopCounter(Collector):
    """``Counter`` with the same name and labels, for series counted from the
    event loop thread only; ``labels()`` and ``inc()`` as there."""

    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = ()) -> None:
        self._name = name[:-len("_total")] if name.endswith("_total") else name
        self._doc = doc
        self._labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], LoopCounterSeries] = {}

    def labels(self, *values: str, **named: str) -> LoopCounterSeries:
        key = label_key(self._name, self._labelnames, values, named)
        got = self._series.get(key)
        if got is None:
            got = self._series[key] = LoopCounterSeries()
        return got

    def inc(self, amount: float = 1.0) -> None:
        """For a counter without labels."""
        self.labels().inc(amount)

    def collect(self) -> Iterable[Metric]:
        fam = CounterMetricFamily(self._name, self._doc, labels=self._labelnames)
        for key, s in list(self._series.items()):
            fam.add_metric(list(key), s.value, created=s.created)
        yield fam

    def remove_first(self, value: str) -> None:
        """Drop every series whose first label is ``value`` (an engine that left).
        Event loop thread; a scrape meanwhile iterates a copy of the series."""
        for key in [k for k in self._series if k and k[0] == value]:
            del self._series[key]

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(self._name, self._doc, labels=self._labelnames)]
