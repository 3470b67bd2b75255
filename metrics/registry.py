"""The sidecar's Prometheus metrics: one :class:`Metrics` object per daemon.

Each daemon creates its own :class:`Metrics` (its own ``CollectorRegistry``)
and hands it to the parts that count, so two daemons in one process (tests,
embedding) never share or overwrite each other's numbers, and nothing is
module-global.

Adding a metric is one line in :meth:`Metrics.__init__`
(``self.x = self._counter(...)``) and one call where it happens.
Labels must have bounded cardinality: ``engine`` (engine ids registered on
this sidecar), ``peer`` (remote engine ids this sidecar has linked to), role,
outcome, op, error code, side, result. Never request ids.

Where vLLM's NixlConnector has the same quantity (``vllm:nixl_*``), the
metric keeps its meaning and bucket layout, so dashboards and habits carry
over; docs/metrics.md has the mapping table.
Names follow Prometheus conventions (``kvsidecar_`` prefix, base units,
``_total`` counters).
"""

from __future__ import annotations

import contextlib
import platform
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.registry import Collector

from kvsidecar import __version__
from kvsidecar.metrics.loop_counter import LoopCounter
from kvsidecar.metrics.loop_histogram import LoopHistogram

#: Engines that left whose counters and histograms are still shown (history for
#: the scrapes after they leave); older ones' series are removed.
KEEP_DEPARTED = 64

_M = TypeVar("_M", Counter, Histogram, LoopHistogram, LoopCounter)

# Bucket layouts of vLLM's NixlPromMetrics (same bounds, so quantiles compare).
#: vllm:nixl_post_time_seconds
POST_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
#: vllm:nixl_xfer_time_seconds (the post buckets without the first)
XFER_BUCKETS = POST_BUCKETS[1:]
#: vllm:nixl_bytes_transferred: 2 KiB to 8 GiB, factor 4
BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
#: vllm:nixl_num_descriptors
DESC_BUCKETS = (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000)
#: Our own latencies (request end to end, queueing, loop lag): 0.5 ms to 10 s.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                   10)

#: Items per batched message (control batches: 1..64).
ITEM_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

ENGINE = ("engine",)
ENGINE_PEER = ("engine", "peer")


class Metrics:
    """Every metric of one daemon, registered in its own ``CollectorRegistry``."""

    def __init__(self, keep_departed: int = KEEP_DEPARTED) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._series: dict[tuple[int, tuple[str, ...]], Any] = {}
        #: metrics whose first label is ``engine`` (their series of engines long
        #: gone are removed, see forget_engine)
        self._by_engine: list[Counter | Histogram | LoopHistogram | LoopCounter] = []
        #: engines that left, oldest first, whose counters are still shown
        self._departed: OrderedDict[str, None] = OrderedDict()
        self._keep_departed = keep_departed
        c, g, h = self._counter, self._gauge, self._histogram
        # Observed per read on the event loop: LoopHistogram (see its module);
        # counted per request on the event loop only: LoopCounter (likewise).
        lh, lc = self._loop_histogram, self._loop_counter

        # --- per transfer: one read request x one remote rank (D side)
        self.transfer_seconds = lh(
            "kvsidecar_transfer_seconds", "Time from posting one NIXL READ to seeing it done "
            "(vllm:nixl_xfer_time_seconds)", ENGINE_PEER, buckets=XFER_BUCKETS)
        self.transfer_post_seconds = lh(
            "kvsidecar_transfer_post_seconds", "Time spent in the NIXL post call of one "
            "transfer (vllm:nixl_post_time_seconds)", ENGINE_PEER, buckets=POST_BUCKETS)
        self.transfer_bytes = lh(
            "kvsidecar_transfer_bytes", "Bytes moved by one transfer "
            "(vllm:nixl_bytes_transferred)", ENGINE_PEER, buckets=BYTES_BUCKETS)
        self.transfer_descriptors = lh(
            "kvsidecar_transfer_descriptors", "NIXL descriptors posted by one transfer, after "
            "coalescing (vllm:nixl_num_descriptors)", ENGINE_PEER, buckets=DESC_BUCKETS)
        self.transfer_descriptors_planned = lh(
            "kvsidecar_transfer_descriptors_planned", "Descriptors the planner produced for "
            "one transfer, before coalescing", ENGINE_PEER, buckets=DESC_BUCKETS)
        self.transfer_failures = c(
            "kvsidecar_transfer_failures_total", "Transfers (one remote rank of one read) that "
            "failed (vllm:nixl_num_failed_transfers)", ENGINE_PEER)
        self.read_queue_seconds = lh(
            "kvsidecar_read_queue_seconds", "Time from the engine's read request to posting "
            "its NIXL transfers (handshake, planning, queueing)", ENGINE,
            buckets=LATENCY_BUCKETS)
        self.lease_claim_seconds = lh(
            "kvsidecar_lease_claim_seconds", "A read's lease claims, from issuing them to "
            "every P rank's grant (the peer channel's round trip), whether the read "
            "awaited them before posting or posted during them", ENGINE,
            buckets=LATENCY_BUCKETS)
        self.read_seconds = lh(
            "kvsidecar_read_seconds", "Read request time from acceptance to completion",
            ENGINE, buckets=LATENCY_BUCKETS)
        self.read_bytes = lc("kvsidecar_read_bytes_total", "Bytes read from peers", ENGINE_PEER)
        self.staged_transfers = c(
            "kvsidecar_staged_transfers_total", "Transfers read as whole remote runs into "
            "staging memory, then scattered locally (--staging)", ENGINE)
        self.scatter_seconds = lh(
            "kvsidecar_scatter_seconds", "Time from a staged read's last transfer done to "
            "its staged bytes scattered into the engine's blocks (the copy, off the event "
            "loop, including any wait for the planning thread)", ENGINE,
            buckets=XFER_BUCKETS)
        self.lane_transfers = lc(
            "kvsidecar_lane_transfers_total", "Transfers of reads spread over several P "
            "ranks or cut in parts, by the lane (NIXL agent and worker thread, --post-lanes) "
            "that posted them; their notifications go from lane 0 once all ended",
            (*ENGINE, "lane"))
        self.posted_during_claim = lc(
            "kvsidecar_reads_posted_during_claim_total", "Reads posted while their lease "
            "claim was still on its way to P (links P confirmed within the last "
            "--post-during-claim seconds); their notifications follow the grant", ENGINE)
        self.batched_reads = lc(
            "kvsidecar_reads_batched_total", "Reads carried by a batch task: reads of one "
            "engine message, or of messages queued together on one connection, to one "
            "remote engine over links already made share one task (one wait for their "
            "claims and plans, one post)", ENGINE)
        self.verified_bytes = lc(
            "kvsidecar_verified_bytes_total", "Bytes of reads whose digest matched P's "
            "(--verify-bytes, read(verify=True))", ENGINE)
        self.verify_failures = c(
            "kvsidecar_verify_failures_total", "Verified reads failed by their verification: "
            "mismatch (the bytes that landed differ from P's), refused or unanswered (P "
            "gave no digest)", (*ENGINE, "reason"))
        self.staging_fallbacks = c(
            "kvsidecar_staging_fallbacks_total", "Transfers the cost model wanted staged but "
            "that posted scattered descriptors, by reason (full: no room in the pool now; "
            "too_large: more than the whole pool (--staging-bytes); preparing: the pool is "
            "still being mapped, right after the engine rank registered; "
            "unavailable: the pool could not be mapped or registered)", (*ENGINE, "reason"))
        self.staging_bytes_in_use = g(
            "kvsidecar_staging_bytes_in_use", "Staging memory held by transfers in flight "
            "(or scattering)", ENGINE)
        self.staging_bytes_mapped = g(
            "kvsidecar_staging_bytes_mapped", "Staging memory mapped, faulted in and "
            "registered with NIXL for this engine rank (--staging-bytes once ready, mapped "
            "when the engine registers; 0 while preparing or if it could not be mapped)",
            ENGINE)
        self.staging_bytes_quarantined = g(
            "kvsidecar_staging_bytes_quarantined", "Staging memory kept out of use until the "
            "NIXL agent is reset (a transfer into it ended with an unknown outcome)", ENGINE)

        # --- outcomes
        self.completions = lc(
            "kvsidecar_completions_total", "Read and hold requests finished, by outcome: "
            "received, failed, aborted (D); sent, expired, aborted (P). expired = "
            "vllm:nixl_num_kv_expired_reqs", (*ENGINE, "outcome"))
        self.notifications_sent = c(
            "kvsidecar_notifications_sent_total", "Bare completion notifications sent to P "
            "ranks nothing was read from, by result (failed = "
            "vllm:nixl_num_failed_notifications)", (*ENGINE, "result"))
        self.notifications_received = lc(
            "kvsidecar_notifications_received_total", "Notifications received from readers, by "
            "outcome (ok, bad, unknown_engine, unclaimed, rejected, wrong_sender: not from "
            "the agent the reader declared in its handshake)", ("outcome",))
        self.notification_reads = lh(
            "kvsidecar_notification_reads", "Reads named by one NIXL notification received "
            "(P side): above 1 a reader merged them into one transfer", (),
            buckets=ITEM_BUCKETS)
        self.transfer_reads = lh(
            "kvsidecar_transfer_reads", "Reads carried by one NIXL transfer posted (D side): "
            "above 1 reads of one flush to the same P agent went as one transfer with one "
            "notification", (*ENGINE, "peer"), buckets=ITEM_BUCKETS)
        self.peer_cache_evictions = c(
            "kvsidecar_peer_cache_evictions_total", "Least recently used entries dropped from "
            "the handshake client at its bounds (handshake answers, peer connections; "
            "connection_refused: a new peer connection refused, every one waiting for an "
            "answer)",
            ("cache",))
        self.peer_links_evicted = c(
            "kvsidecar_peer_links_evicted_total", "Idle links to remote ranks dropped (their "
            "NIXL remote agent unloaded) because an engine rank reached "
            "--max-peer-links-per-engine", ENGINE)
        self.declared_readers_evicted = c(
            "kvsidecar_declared_readers_evicted_total", "Reader agents declared in handshakes "
            "forgotten because the table was full (their notifications are then rejected "
            "until they handshake again)")
        self.handshakes = c(
            "kvsidecar_handshakes_total", "Peer handshakes by side (client: links this sidecar "
            "made; server: requests it answered) and result", ("side", "result"))
        self.requests = lc(
            "kvsidecar_engine_requests_total", "Engine IPC requests handled, by op and error "
            "code (empty = ok)", ("op", "error"))
        self.late_completions = c(
            "kvsidecar_late_completions_quarantined_total", "Reads that could still have "
            "completed late (timed out, or in flight at an agent reset): their blocks were held "
            "back until the agent was destroyed, then reported failed", ENGINE)

        # --- state (sampled on the event loop, see daemon/observability.py, Sampler)
        self.reads_in_flight = g("kvsidecar_reads_in_flight", "Read requests accepted and not "
                                 "yet completed", ENGINE)
        self.holds_in_flight = g("kvsidecar_holds_in_flight", "Held requests waiting for their "
                                 "readers", ENGINE)
        self.registered_bytes = g("kvsidecar_registered_bytes", "Memory registered with NIXL",
                                  ENGINE)
        self.registered_regions = g("kvsidecar_registered_regions", "Memory regions "
                                    "registered with NIXL", ENGINE)
        self.peers = g("kvsidecar_peers", "Remote ranks linked (NIXL remote agents loaded)",
                       ENGINE)
        self.engines = g("kvsidecar_engines", "Engine ranks registered")
        self.loop_lag = g("kvsidecar_event_loop_lag_seconds", "How late the event loop's "
                          "periodic timer fired, last sample")
        self.worker_lag = g("kvsidecar_worker_poll_lag_seconds", "Time since the NIXL worker "
                            "thread last went round its poll loop", ENGINE)
        self.ready = g("kvsidecar_ready", "1 when /readyz last passed (set on each probe)")
        self.transport_bandwidth = g(
            "kvsidecar_selfcheck_bandwidth_bytes_per_second", "Loopback NIXL READ bandwidth "
            "measured by the start-up transport self-check")
        self.transport_info = g(
            "kvsidecar_selfcheck_info", "Start-up transport self-check: 1 with the path found",
            ("path", "passed"))
        self.build_info = g("kvsidecar_build_info", "Versions this daemon runs",
                            ("version", "python", "nixl"))
        self.build_info.labels(version=__version__, python=platform.python_version(),
                               nixl=_version("nixl")).set(1)
        self.lease_requests = lc(
            "kvsidecar_lease_requests_total", "Peer control requests answered (P side): claims, "
            "abandons and digests (--verify-bytes), by result (granted, refused, bad), each "
            "item of a batch counted",
            ("op", "result"))
        self.control_items = lh(
            "kvsidecar_control_items_per_message", "Claims/renewals/abandons carried by one "
            "peer control message: side=sent (D) for each message sent, side=answered (P) "
            "for each one answered; above 1 they travelled as a batch", ("side",),
            buckets=ITEM_BUCKETS)
        self.leases_lost = c(
            "kvsidecar_leases_lost_total", "Reads (D side) failed because their lease on the "
            "prefill blocks ran out or was refused", ENGINE)
        self.hold_overrun = g(
            "kvsidecar_hold_overrun_seconds", "Longest time past its deadline a hold was "
            "found alive (housekeeping lag; a paused process shows here)", ENGINE)
        self.limit_refusals = c(
            "kvsidecar_limit_refusals_total", "Requests refused (or early notifications "
            "dropped, or waiting polls answered at once) because a per-engine bound was "
            "reached", (*ENGINE, "limit"))
        self.cleanup_failures = c(
            "kvsidecar_cleanup_failures_total",
            "Failures while releasing an engine (logged, never fatal)", ("what",))
        self.agent_resets = c(
            "kvsidecar_agent_resets_total", "NIXL agents destroyed and created again because "
            "a read timed out or failed (the only way to stop its bytes)", ENGINE)
        self.agent_reset_seconds = h(
            "kvsidecar_agent_reset_seconds", "Time to destroy a NIXL agent and create it "
            "again (added to a failed read's time to its completion)", ENGINE,
            buckets=LATENCY_BUCKETS)
        self.engines_draining = g(
            "kvsidecar_engines_draining", "Engine registrations whose engine ended (exited, "
            "died, deregistered with drain) while holds were open: their memory stays "
            "registered and serves those holds until they end")
        self.drain_bytes = g(
            "kvsidecar_drain_bytes", "Memory kept registered for engines that ended, until "
            "their open holds end")
        self.drained_holds = c(
            "kvsidecar_drained_holds_total", "Holds that ended after their engine ended, by "
            "outcome (sent, aborted, expired; dropped: cut short by the sidecar's own "
            "shutdown past --drain-timeout)", ("outcome",))
        self.engines_gone = c(
            "kvsidecar_engines_gone_total", "Engines taken for dead, by signal (pid, lease)",
            ("signal",))
        self.engine_assembling_bytes = g(
            "kvsidecar_engine_assembling_bytes", "Bytes announced by the long engine "
            "messages being received right now (bounded together: past the bound a header "
            "is refused with reason assembly_limit)")
        self.refused = c(
            "kvsidecar_refused_total", "Connections and messages refused at the door, by "
            "channel (engine socket, peer handshake port, fd socket, metrics port) and "
            "reason (forbidden uid, unknown key, handshake failure, connection limit, "
            "timeout)", ("channel", "reason"))

    # One helper per metric type, so each metric is one line above and always
    # lands in this daemon's registry.
    def _counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return self._engine_keyed(Counter(name, doc, labels, registry=self.registry), labels)

    def _gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, labels: Sequence[str] = (), *,
                   buckets: Sequence[float]) -> Histogram:
        return self._engine_keyed(
            Histogram(name, doc, labels, buckets=buckets, registry=self.registry), labels)

    def series(self, metric: Counter | Histogram | LoopHistogram | LoopCounter,
               *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once per daemon: ``labels()``
        takes a lock and validates its tuple every call (2-3 us), and the hot
        paths touch several series per read. Counters and histograms only (their
        series are never removed; gauges are, see :meth:`forget_engine`); the
        labels' cardinality is bounded (module docstring), the cache with it."""
        key = (id(metric), labels)
        got = self._series.get(key)
        if got is None:
            got = self._series[key] = metric.labels(*labels)
        return got

    def _loop_histogram(self, name: str, doc: str, labels: Sequence[str] = (), *,
                        buckets: Sequence[float]) -> LoopHistogram:
        h = LoopHistogram(name, doc, labels, buckets)
        self.registry.register(h)
        return self._engine_keyed(h, labels)

    def _loop_counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> LoopCounter:
        c = LoopCounter(name, doc, labels)
        self.registry.register(c)
        return self._engine_keyed(c, labels)

    def _engine_keyed(self, metric: _M, labels: Sequence[str]) -> _M:
        if labels and labels[0] == "engine":
            self._by_engine.append(metric)
        return metric

    def counter_from(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A counter whose value a component already keeps as a plain number
        (read at scrape time, from the HTTP thread: reading an int is safe)."""
        self.registry.register(_ReadCounter(name, doc, read))

    def forget_engine(self, engine_id: str) -> None:
        """Drop the gauges of an engine that left. Its counters and histograms
        stay (history) while it is one of the last ``keep_departed`` engines to
        leave; those of older ones are removed. Why: engines come and go (a
        restarted vLLM has a new engine id), and keeping every series of every
        engine that ever registered grew the registry and each scrape without
        end (measured: ~310 bytes of /metrics per engine that came and went)."""
        for gauge in (self.reads_in_flight, self.holds_in_flight, self.registered_bytes,
                      self.registered_regions, self.peers, self.worker_lag,
                      self.staging_bytes_in_use, self.staging_bytes_quarantined,
                      self.staging_bytes_mapped):
            with contextlib.suppress(KeyError):
                gauge.remove(engine_id)
        self._departed[engine_id] = None
        self._departed.move_to_end(engine_id)
        while len(self._departed) > self._keep_departed:
            gone, _ = self._departed.popitem(last=False)
            self._drop_series(gone)

    def engine_arrived(self, engine_id: str) -> None:
        """An engine registered: its series are live again, never dropped as history."""
        self._departed.pop(engine_id, None)

    def _drop_series(self, engine_id: str) -> None:
        for metric in self._by_engine:
            if isinstance(metric, (LoopHistogram, LoopCounter)):
                metric.remove_first(engine_id)
                continue
            # prometheus_client lists no children publicly; _metrics is its dict of them.
            for key in [k for k in list(metric._metrics) if k[0] == engine_id]:
                with contextlib.suppress(KeyError):
                    metric.remove(*key)
        for cached in [k for k in self._series if k[1][:1] == (engine_id,)]:
            del self._series[cached]

    def render(self, openmetrics: bool = False) -> bytes:
        """This daemon's metrics in Prometheus text format, or OpenMetrics (which
        carries the request-id exemplars of the latency histograms)."""
        if openmetrics:
            text: bytes = openmetrics_latest(self.registry)  # type: ignore[no-untyped-call]
            return text
        return generate_latest(self.registry)


class _ReadCounter(Collector):
    def __init__(self, name: str, doc: str, read: Callable[[], float]) -> None:
        self._name, self._doc, self._read = name, doc, read

    def collect(self) -> Iterable[Metric]:
        yield CounterMetricFamily(self._name, self._doc, value=self._read())

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(self._name, self._doc)]


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"
