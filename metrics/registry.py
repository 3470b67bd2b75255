"""The sidecar's Prometheus metrics: one :class:`Metrics` object per daemon.

Each daemon creates its own :class:`Metrics` (its own ``CollectorRegistry``)
and hands it to the parts that count, so two daemons in one process (tests,
embedding) never share or overwrite each other's numbers, and nothing is
module-global.

Adding a metric is one line in :meth:`Metrics.__init__` (``self.x = self._counter(...)``).
Labels must have bounded cardinality: engine ids of this sidecar, peer engine
ids, role, outcome, op, error code. Never request ids.
Names follow Prometheus conventions (``kvsidecar_`` prefix, base units,
``_total`` counters).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Latency buckets of the read request histogram.
READ_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    """Every metric of one daemon, registered in its own ``CollectorRegistry``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = self._counter("kvsidecar_engine_requests_total",
                                      "Engine IPC requests handled", ["op"])
        self.reads = self._counter("kvsidecar_reads_total", "Read requests finished",
                                   ["outcome"])
        self.read_bytes = self._counter("kvsidecar_read_bytes_total", "Bytes read from peers")
        self.descriptors = self._counter("kvsidecar_read_descriptors_total",
                                         "NIXL descriptors posted (after coalescing)")
        self.descriptors_planned = self._counter(
            "kvsidecar_read_descriptors_planned",
            "Descriptors the planner produced before coalescing")
        self.read_seconds = self._histogram(
            "kvsidecar_read_seconds", "Read request time from acceptance to completion",
            buckets=READ_BUCKETS)
        self.notifications = self._counter("kvsidecar_notifications_total",
                                           "Notifications received from readers", ["outcome"])
        self.engines = self._gauge("kvsidecar_engines", "Engine ranks registered")

    # One helper per metric type, so each metric is one line above and always
    # lands in this daemon's registry.
    def _counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, labels: Sequence[str] = (), *,
                   buckets: Sequence[float]) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def render(self) -> bytes:
        """The text exposition format of this daemon's metrics."""
        return generate_latest(self.registry)
