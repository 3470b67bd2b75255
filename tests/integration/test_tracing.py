"""OpenTelemetry traces: a real read between two real sidecars (in this process,
each with its own tracer and exporter, as on two hosts) produces D-side spans
(read, handshake, planning, transfer) and P-side spans (hold, notification)
in ONE trace, joined by the request id with nothing propagated on the wire.
Without configuration tracing is off and costs nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

otel = pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra is not installed")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

from kvsidecar.daemon.app import Sidecar  # noqa: E402
from kvsidecar.daemon.settings import Settings  # noqa: E402
from kvsidecar.daemon.tracing import Tracing, trace_id_for  # noqa: E402
from kvsidecar.ipc.client import AsyncSidecarClient  # noqa: E402
from kvsidecar.ipc.protocol import RemoteEngine  # noqa: E402
from kvsidecar.sim.cluster import fleet_keys  # noqa: E402
from kvsidecar.sim.models import hybrid  # noqa: E402


def test_tracing_off_without_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    t = Tracing("")
    assert not t.enabled
    assert t.start("kvsidecar.read", "r") is None


async def test_p_and_d_spans_join_in_one_trace(tmp_path: Path) -> None:
    ep, ed = InMemorySpanExporter(), InMemorySpanExporter()
    p = Sidecar(Settings(socket=str(tmp_path / "p.sock"), transport_check="off",
                         peer_keys=fleet_keys()),
                tracing=Tracing(exporter=ep, service="kvsidecar-p"))
    d = Sidecar(Settings(socket=str(tmp_path / "d.sock"), transport_check="off",
                         peer_keys=fleet_keys()),
                tracing=Tracing(exporter=ed, service="kvsidecar-d"))
    await p.start()
    await d.start()
    cp = AsyncSidecarClient(p.settings.socket, timeout_s=60)
    cd = AsyncSidecarClient(d.settings.socket, timeout_s=60)
    try:
        layout = hybrid(1, 16)
        reg_p = await cp.register("P0", 0, layout, allocate=True)
        await cd.register("D0", 0, layout, allocate=True)
        tokens = layout.groups[0].sub_blocks * layout.groups[0].block_tokens
        held = await cp.hold("P0", "req-7", [[1], [2]])
        await cd.read("D0", "dreq-7", [[3], [4]], RemoteEngine("P0", 1, [reg_p.handshake_address]),
                      [[1], [2]], remote_request_id="req-7", num_tokens=tokens,
                      remote_tokens=[held.token])
        kinds: dict[str, str] = {}
        for _ in range(6000):
            for c in await cd.poll("D0"):
                kinds["D"] = c.kind
            for c in await cp.poll("P0"):
                kinds["P"] = c.kind
            if len(kinds) == 2:
                break
            await asyncio.sleep(0.01)
        assert kinds == {"D": "received", "P": "sent"}
    finally:
        await cd.close()
        await cp.close()
        await d.stop(drain_s=0)
        await p.stop(drain_s=0)
    d_spans, p_spans = ed.get_finished_spans(), ep.get_finished_spans()
    names_d = {s.name for s in d_spans}
    names_p = {s.name for s in p_spans}
    assert {"kvsidecar.read", "kvsidecar.handshake", "kvsidecar.planning",
            "kvsidecar.transfer"} <= names_d, names_d
    assert {"kvsidecar.hold", "kvsidecar.notification"} <= names_p, names_p
    want = trace_id_for("req-7")
    assert {s.context.trace_id for s in (*d_spans, *p_spans)} == {want}
    (read,) = [s for s in d_spans if s.name == "kvsidecar.read"]
    assert read.attributes["kvsidecar.outcome"] == "received"
    assert read.attributes["kvsidecar.decode_request_id"] == "dreq-7"
    for s in d_spans:
        if s.name != "kvsidecar.read":
            assert s.parent is not None and s.parent.span_id == read.context.span_id, s.name
    (hold,) = [s for s in p_spans if s.name == "kvsidecar.hold"]
    assert hold.attributes["kvsidecar.outcome"] == "sent"
    assert all(s.attributes["kvsidecar.request_id"] == "req-7" for s in (*d_spans, *p_spans))
