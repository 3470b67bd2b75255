"""Per-request traces through OpenTelemetry: optional, and nothing at all when off.

With ``--otlp-endpoint`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) and the
``otel`` extra installed, each sidecar exports spans over OTLP/HTTP:

- D side: ``kvsidecar.read`` (accepted to completion) with children
  ``kvsidecar.handshake`` (linking the P ranks), ``kvsidecar.planning`` and one
  ``kvsidecar.transfer`` per remote rank (post + wire, from NIXL's timings);
- P side: ``kvsidecar.hold`` (hold to sent/expired) and one
  ``kvsidecar.notification`` per reader notification received.

P and D are different processes on different hosts with no trace context
between them, so the trace id is *derived* from the prefill request id
(the id both sides know): every span of one request lands in one trace,
without any propagation on the wire. Without configuration no
OpenTelemetry module is imported and every call is a no-op.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


def trace_id_for(request_id: str) -> int:
    """The 128-bit trace id of a request (same on P and D)."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:16], "big") or 1


class Tracing:
    def __init__(self, endpoint: str = "", *, exporter: Any = None,
                 service: str = "kvsidecar") -> None:
        """``exporter`` (an OpenTelemetry SpanExporter) is for tests: spans go
        there synchronously instead of to an OTLP endpoint."""
        self._tracer: Any = None
        self._provider: Any = None
        endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
        if not endpoint and exporter is None:
            return
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError:
            log.warning("tracing requested but OpenTelemetry is not installed: "
                        "pip install 'kvsidecar[otel]'; continuing without traces")
            return
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        if exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
            log.info("exporting traces over OTLP/HTTP to %s", endpoint)
        self._provider = provider
        self._tracer = provider.get_tracer("kvsidecar")

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def _root(self, request_id: str) -> Any:
        from opentelemetry import trace
        from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

        ctx = SpanContext(trace_id=trace_id_for(request_id),
                          span_id=int.from_bytes(os.urandom(8), "big") or 1, is_remote=True,
                          trace_flags=TraceFlags(TraceFlags.SAMPLED))
        return trace.set_span_in_context(NonRecordingSpan(ctx))

    def start(self, name: str, request_id: str, parent: Any = None, **attrs: Any) -> Any:
        """A started span (or None when off); end it with :meth:`end`."""
        if self._tracer is None:
            return None
        from opentelemetry import trace

        ctx = trace.set_span_in_context(parent) if parent is not None else self._root(request_id)
        span = self._tracer.start_span(name, context=ctx, attributes={
            "kvsidecar.request_id": request_id, **{f"kvsidecar.{k}": v for k, v in attrs.items()
                                                  if v is not None}})
        return span

    @staticmethod
    def end(span: Any, **attrs: Any) -> None:
        if span is None:
            return
        for k, v in attrs.items():
            span.set_attribute(f"kvsidecar.{k}", v)
        span.end()

    @contextlib.contextmanager
    def child(self, name: str, request_id: str, parent: Any, **attrs: Any) -> Iterator[Any]:
        span = self.start(name, request_id, parent, **attrs) if parent is not None else None
        try:
            yield span
        finally:
            self.end(span)

    def interval(self, name: str, request_id: str, parent: Any, seconds: float,
                 **attrs: Any) -> None:
        """A span that ended now and lasted ``seconds`` (NIXL's own timings)."""
        if self._tracer is None or parent is None:
            return
        from opentelemetry import trace

        end = time.time_ns()
        span = self._tracer.start_span(
            name, context=trace.set_span_in_context(parent),
            start_time=end - int(seconds * 1e9),
            attributes={"kvsidecar.request_id": request_id,
                        **{f"kvsidecar.{k}": v for k, v in attrs.items()}})
        span.end(end_time=end)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
