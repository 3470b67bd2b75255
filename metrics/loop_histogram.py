"""A Prometheus histogram for the event loop's per-read hot path.

``prometheus_client.Histogram.observe`` takes two locks and walks the bucket
bounds in Python: 4-5 us per observation on this 2-vCPU host, and a read on
the D side made eight of them (over 30 us of a ~300 us read). The series here
are observed from the event loop thread only, so an observation is a bisect
and two additions on plain Python numbers (well under a microsecond); the
scrape (another thread) copies them under the GIL and hands them to
``prometheus_client`` through its public collector interface, in the same
exposition (``_bucket``/``_sum``/``_count``, OpenMetrics exemplars) as its own
histograms.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterable, Sequence

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from kvsidecar.metrics.loop_labels import label_key


class LoopSeries:
    """One labelled series. Event loop thread only (see the module docstring)."""

    __slots__ = ("_bounds", "counts", "exemplars", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.exemplars: list[Exemplar | None] = [None] * (len(bounds) + 1)

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        i = bisect.bisect_left(self._bounds, amount)  # le: amount <= bound
        self.counts[i] += 1
        self.sum += amount
        if exemplar:
            self.exemplars[i] = Exemplar(exemplar, amount, time.time())


class LoopHistogram(Collector):
    """``Histogram`` with the same name, labels and buckets, for series observed
    from the event loop thread only; ``labels()`` and ``observe()`` as there."""

    def __init__(self, name: str, doc: str, labelnames: Sequence[str],
                 buckets: Sequence[float]) -> None:
        bounds = tuple(float(b) for b in buckets)
        if bounds and bounds[-1] == math.inf:
            bounds = bounds[:-1]
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must be increasing")
        self._name, self._doc = name, doc
        self._labelnames = tuple(labelnames)
        self._bounds = bounds
        self._les = [floatToGoString(b) for b in bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        self._series: dict[tuple[str, ...], LoopSeries] = {}

    def labels(self, *values: str, **named: str) -> LoopSeries:
        key = label_key(self._name, self._labelnames, values, named)
        got = self._series.get(key)
        if got is None:
            got = self._series[key] = LoopSeries(self._bounds)
        return got

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        """For a histogram without labels."""
        self.labels().observe(amount, exemplar)

    def collect(self) -> Iterable[Metric]:
        fam = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        for key, s in list(self._series.items()):
            counts, total, exemplars = list(s.counts), s.sum, list(s.exemplars)
            buckets: list[tuple[str, float] | tuple[str, float, Exemplar]] = []
            cum = 0
            for le, n, ex in zip(self._les, counts, exemplars):
                cum += n
                buckets.append((le, float(cum)) if ex is None else (le, float(cum), ex))
            fam.add_metric(list(key), buckets, total)
        yield fam

    def remove_first(self, value: str) -> None:
        """Drop every series whose first label is ``value`` (an engine that left).
        Event loop thread; a scrape meanwhile iterates a copy of the series."""
        for key in [k for k in self._series if k and k[0] == value]:
            del self._series[key]

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)]
