"""The sidecar's Prometheus metrics and their HTTP endpoint.

Names follow Prometheus conventions (``kvsidecar_`` prefix, base units,
``_total`` counters) so a dashboard can be written against them now; the
metrics issue on the roadmap adds per-peer and latency breakdowns.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

REQUESTS = Counter("kvsidecar_engine_requests_total", "Engine IPC requests handled", ["op"])
READS = Counter("kvsidecar_reads_total", "Read requests finished", ["outcome"])
READ_BYTES = Counter("kvsidecar_read_bytes_total", "Bytes read from peers")
DESCRIPTORS = Counter("kvsidecar_read_descriptors_total",
                      "NIXL descriptors posted (after coalescing)")
DESCRIPTORS_PLANNED = Counter("kvsidecar_read_descriptors_planned",
                              "Descriptors the planner produced before coalescing")
READ_SECONDS = Histogram(
    "kvsidecar_read_seconds", "Read request time from acceptance to completion",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
NOTIFICATIONS = Counter("kvsidecar_notifications_total", "Notifications received from readers",
                        ["outcome"])
ENGINES = Gauge("kvsidecar_engines", "Engine ranks registered")


def serve(host: str, port: int) -> int:
    """Start the /metrics endpoint on a daemon thread; returns the bound port."""
    server, _thread = start_http_server(port, addr=host)
    return int(server.server_address[1])
