"""D side: the per-transfer metrics of reads (vLLM-compatible histograms and
counters), their labelled series looked up once per (engine, peer)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from kvsidecar.daemon.d_side.addresses import PostList
from kvsidecar.daemon.transport.worker import TransferStats
from kvsidecar.metrics.registry import Metrics


@dataclass(frozen=True)
class _TransferSeries:
    """The labelled series count_transfers touches for one (engine, peer): looked
    up once, not ``labels()`` (a lock and a label tuple each) eight times per
    transfer. Only gauges are ever removed from the registry, so these stay valid."""

    failures: Any
    seconds: Any
    post_seconds: Any
    nbytes: Any
    descriptors: Any
    planned: Any
    read_bytes: Any
    notif_failed: Any
    reads: Any


_SERIES_CACHE_MAX = 4096  # (engine, peer) pairs per daemon; cleared whole past it
_series_cache: weakref.WeakKeyDictionary[Metrics, dict[tuple[str, str], _TransferSeries]] = (
    weakref.WeakKeyDictionary())


def _transfer_series(m: Metrics, engine: str, peer: str) -> _TransferSeries:
    cache = _series_cache.setdefault(m, {})
    got = cache.get((engine, peer))
    if got is None:
        if len(cache) >= _SERIES_CACHE_MAX:
            cache.clear()
        labels = (engine, peer)
        # Failure series exist (at 0) from the first transfer on, so dashboards and
        # alerts see "no failures" rather than "no data".
        got = cache[(engine, peer)] = _TransferSeries(
            m.transfer_failures.labels(*labels), m.transfer_seconds.labels(*labels),
            m.transfer_post_seconds.labels(*labels), m.transfer_bytes.labels(*labels),
            m.transfer_descriptors.labels(*labels),
            m.transfer_descriptors_planned.labels(*labels), m.read_bytes.labels(*labels),
            m.notifications_sent.labels(engine, "failed"),
            m.transfer_reads.labels(*labels))
    return got


def count_transfers(m: Metrics, engine: str, peer: str, posts: list[PostList],
                    results: list[TransferStats | BaseException | None], *,
                    request_id: str = "") -> None:
    """Per transfer (one remote rank of one read): the vLLM-compatible histograms
    and counters. Bare notifications (nothing read from that rank) count as
    notifications, not transfers. The request id rides along as an exemplar on
    the latency histogram (OpenMetrics), never as a label."""
    series = _transfer_series(m, engine, peer)
    exemplar = {"request_id": request_id[:64]} if request_id else None
    for post, r in zip(posts, results):
        if not post.length.size:
            if isinstance(r, BaseException):
                series.notif_failed.inc()
            else:  # rare (nothing to read from that rank): not worth a cached series
                m.notifications_sent.labels(engine, "ok").inc()
        elif isinstance(r, BaseException):
            series.failures.inc()
        elif isinstance(r, TransferStats):
            series.seconds.observe(r.xfer_us / 1e6, exemplar)
            series.post_seconds.observe(r.post_us / 1e6)
            series.nbytes.observe(r.bytes)
            series.descriptors.observe(r.descriptors)
            if r.first:  # one observation per NIXL transfer, merged or not
                series.reads.observe(r.reads)
            series.planned.observe(post.descriptors_before)
            series.read_bytes.inc(r.bytes)
