"""Each daemon owns its metrics: two sidecars in one process count separately,
and the HTTP endpoint serves its own daemon's registry."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from kvsidecar.daemon.app import Sidecar
from kvsidecar.daemon.settings import Settings
from kvsidecar.ipc.protocol import Ping
from kvsidecar.metrics.registry import Metrics
from kvsidecar.metrics.server import MetricsServer


def sample(m: Metrics, name: str, **labels: str) -> float:
    v = m.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


async def test_two_sidecars_in_one_process_do_not_share_metrics(tmp_path: Path) -> None:
    a = Sidecar(Settings(socket=str(tmp_path / "a.sock"), insecure_peers=True))
    b = Sidecar(Settings(socket=str(tmp_path / "b.sock"), insecure_peers=True))
    assert a.metrics is not b.metrics
    await a.start()
    await b.start()
    try:
        for _ in range(3):
            await a.handle(Ping(id=1))
        await b.handle(Ping(id=1))
        assert sample(a.metrics, "kvsidecar_engine_requests_total", op="ping", error="") == 3
        assert sample(b.metrics, "kvsidecar_engine_requests_total", op="ping", error="") == 1
    finally:
        await a.stop(drain_s=0)
        await b.stop(drain_s=0)


def test_http_endpoint_serves_its_own_registry() -> None:
    one, two = Metrics(), Metrics()
    one.completions.labels("e1", "received").inc(5)
    two.completions.labels("e1", "received").inc(7)
    servers = [MetricsServer(m, "127.0.0.1", 0) for m in (one, two)]
    ports = [s.start() for s in servers]
    try:
        bodies = [urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=10)
                  .read().decode() for p in ports]
        assert 'kvsidecar_completions_total{engine="e1",outcome="received"} 5.0' in bodies[0]
        assert 'kvsidecar_completions_total{engine="e1",outcome="received"} 7.0' in bodies[1]
    finally:
        for s in servers:
            s.stop()


def test_counter_from_reads_the_owners_number_at_scrape_time() -> None:
    m = Metrics()
    box = {"n": 0}
    m.counter_from("kvsidecar_things", "things seen", lambda: box["n"])
    box["n"] = 4
    assert m.registry.get_sample_value("kvsidecar_things_total") == 4


def test_series_of_engines_long_gone_are_removed_recent_ones_kept() -> None:
    """Engines come and go (a restarted vLLM has a new id): the counters and
    histograms of the last ``keep_departed`` engines to leave stay as history,
    older ones' series go from every kind of metric (and the series cache), an
    engine that registers again is live, and live engines are never touched.
    Before: every series of every engine that ever registered stayed, ~310
    bytes of /metrics per engine id that came and went, without end."""
    m = Metrics(keep_departed=2)
    engines = ["live", "e0", "e1", "e2", "back", "e3"]
    for e in engines:
        m.completions.labels(e, "received").inc()
        m.series(m.read_seconds, e).observe(0.01)
        m.series(m.read_bytes, e, "peer-x").inc(4096)
        m.limit_refusals.labels(e, "reads").inc()
    for e in ["e0", "e1", "back", "e2"]:
        m.forget_engine(e)
    m.engine_arrived("back")  # registered again before its series could go
    m.forget_engine("e3")
    text = m.render().decode()
    for e in ["e0", "e1"]:
        assert f'engine="{e}"' not in text, e
    for e in ["live", "e2", "back", "e3"]:
        assert text.count(f'engine="{e}"') >= 4, e
    # A dropped engine's cached series are gone too: counting again starts afresh.
    m.series(m.read_bytes, "e0", "peer-x").inc(1)
    assert sample(m, "kvsidecar_read_bytes_total", engine="e0", peer="peer-x") == 1
    assert sample(m, "kvsidecar_read_bytes_total", engine="live", peer="peer-x") == 4096
