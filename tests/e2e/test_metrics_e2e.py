"""Metrics over real HTTP from real daemons that moved real transfers, and the
Grafana dashboard evaluated by a real Prometheus scraping them.

One P sidecar and two D sidecars (P tp1 -> D tp2, hybrid attention + Mamba);
every counter and histogram is read back through ``/metrics`` with the
Prometheus text parser and compared with what the test did, and the bytes are
checked with the LAYOUT.md oracle first (metrics of a wrong transfer prove
nothing). When ``prometheus`` is installed (``make test`` installs it as root;
otherwise the dashboard test is skipped with the reason), it scrapes the three
sidecars every second from before the first transfer, and every PromQL
expression of dashboards/kvsidecar.json and dashboards/alerts.yml must parse
and return data through Prometheus's HTTP API.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.sim.cluster import Sent, SidecarProcess, engines
from kvsidecar.sim.models import hybrid
from kvsidecar.sim.oracle import Request

pytestmark = pytest.mark.e2e

N_READS = 3
ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
#: Grafana variables as an "All" selection and the rate window Prometheus evaluates.
VARIABLES = {"$__rate_interval": "1m", "$instance": ".*", "$engine": ".*", "$peer": ".*"}


class Prometheus:
    """A real Prometheus scraping the sidecars every second."""

    def __init__(self, work: Path, ports: list[int]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cfg = work / "prometheus.yml"
        targets = ", ".join(f'"127.0.0.1:{p}"' for p in ports)
        cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                       "scrape_configs:\n  - job_name: kvsidecar\n"
                       f"    static_configs:\n      - targets: [{targets}]\n")
        self.log = open(work / "prometheus.log", "w")  # noqa: SIM115 - closed in stop()
        assert PROMETHEUS is not None
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.targets = len(ports)

    def query(self, expr: str) -> list[dict[str, object]]:
        url = (f"http://127.0.0.1:{self.port}/api/v1/query?"
               + urllib.parse.urlencode({"query": expr}))
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            text = e.read()
            try:
                body = json.loads(text)
            except ValueError:  # e.g. 503 "Service Unavailable" while it starts
                raise AssertionError(f"{expr}: HTTP {e.code} {text[:200]!r}") from None
        assert body.get("status") == "success", f"{expr}: {body.get('error')}"
        result = body["data"]["result"]
        assert isinstance(result, list)
        return result

    def wait_scraped(self, expr: str, want: int, timeout_s: float = 180) -> None:
        """Until ``expr`` returns ``want`` series (the server and its scrapes are up)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if len(self.query(expr)) >= want:
                    return
            except (OSError, AssertionError):
                pass
            assert self.proc.poll() is None, "prometheus exited"
            assert time.monotonic() < deadline, f"prometheus never saw {expr}"
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    """Sum of ``name`` over the label sets that contain ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def wait_ready(port: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=30) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"sidecar on {port} never became ready"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """Run N_READS good reads and one read from an unreachable peer, then hand the
    sidecars (still running) to the tests."""
    work: Path = tmp_path_factory.mktemp("metrics")
    flags = ["--metrics-port", "0", "--handshake-timeout", "2",
             "--transport-check", "require-zero-copy"]
    p = [SidecarProcess(work, "mp0", args=flags)]
    d = [SidecarProcess(work, f"md{i}", args=flags) for i in range(2)]
    for s in p + d:
        s.start()
    ids = itertools.count()
    prom = Prometheus(work, [s.metrics_port for s in p + d]) if PROMETHEUS else None
    try:
        if prom is not None:  # scraping before anything moves, so rates see the change
            prom.wait_scraped('kvsidecar_build_info', 3)
        with engines(p, d, lambda pre: f"{pre}{next(ids)}", hybrid, 1, 2) as (P, (D,)):
            rids = [f"m{i}" for i in range(N_READS)]
            for i, rid in enumerate(rids):
                D.start_read(P.prefill(rid, Request(seed=40 + i, prompt_tokens=60 + 50 * i)))
            got = D.wait_for(rids)
            for rid in rids:
                assert {c.kind for c in got[rid].values()} == {"received"}, got[rid]
                assert not D.verify(rid)
            assert {c.kind for r in P.wait_for(rids).values() for c in r.values()} == {"sent"}
            # A peer nobody listens on: the handshake fails, the read fails.
            sent = P.prefill("gone", Request(seed=7, prompt_tokens=30), hold=False)
            dead = Sent("gone", msgspec.structs.replace(sent.remote,
                                                        handshake=["127.0.0.1:9"]),
                        sent.block_ids, sent.req, sent.tokens)
            D.start_read(dead)
            assert {c.kind for c in D.wait_for(["gone"])["gone"].values()} == {"failed"}
            # A hold nobody reads expires; a request for an unknown engine is refused.
            P.prefill("expire", Request(seed=8, prompt_tokens=20), timeout_s=1.0)
            assert {c.kind for c in P.wait_for(["expire"])["expire"].values()} == {"expired"}
            with pytest.raises(Exception, match="not registered"):
                D.clients[0].poll("nobody-here")
            for s in p + d:  # self-check done and passed: /readyz is green
                wait_ready(s.metrics_port)
            if prom is not None:  # two more scrapes after the last change
                prom.wait_scraped('kvsidecar_completions_total{outcome="expired"}', 1)
                time.sleep(3)
            yield {"P": P, "D": D, "p": p, "d": d, "prom": prom,
                   "scrapes": [scrape(s.metrics_port) for s in p + d]}
    finally:
        if prom is not None:
            prom.stop()
        for s in p + d:
            assert s.stop() == 0, s.read_log()


def test_decode_side_transfer_metrics(moved: dict[str, object]) -> None:
    P, D = moved["P"], moved["D"]
    scrapes = moved["scrapes"]
    assert isinstance(scrapes, list)
    for m in scrapes[1:]:  # each D sidecar serves one D rank
        eng = {"engine": D.engine_id}  # type: ignore[attr-defined]
        link = {**eng, "peer": P.engine_id}  # type: ignore[attr-defined]
        assert value(m, "kvsidecar_completions_total", **eng, outcome="received") == N_READS
        assert value(m, "kvsidecar_completions_total", **eng, outcome="failed") == 1
        # One transfer per read (each D rank reads from the one P rank).
        assert value(m, "kvsidecar_transfer_seconds_count", **link) == N_READS
        assert value(m, "kvsidecar_transfer_post_seconds_count", **link) == N_READS
        nbytes = value(m, "kvsidecar_transfer_bytes_sum", **link)
        assert nbytes > 0 and value(m, "kvsidecar_read_bytes_total", **link) == nbytes
        posted = value(m, "kvsidecar_transfer_descriptors_sum", **link)
        planned = value(m, "kvsidecar_transfer_descriptors_planned_sum", **link)
        assert 0 < posted <= planned
        assert value(m, "kvsidecar_read_queue_seconds_count", **eng) == N_READS
        assert value(m, "kvsidecar_read_seconds_count", **eng) == N_READS
        assert value(m, "kvsidecar_engine_requests_total", op="read", error="") == N_READS + 1
        assert value(m, "kvsidecar_engine_requests_total", op="poll",
                     error="unknown_engine") == (1 if m is scrapes[1] else 0)
        assert value(m, "kvsidecar_handshakes_total", side="client", result="ok") == 1
        assert value(m, "kvsidecar_handshakes_total", side="client", result="failed") == 1
        assert value(m, "kvsidecar_transfer_failures_total") == 0
        assert value(m, "kvsidecar_engines") == 1
        assert value(m, "kvsidecar_registered_bytes", **eng) > 0
        assert value(m, "kvsidecar_build_info") == 1
        assert value(m, "kvsidecar_selfcheck_info", path="cma", passed="true") == 1
        assert value(m, "kvsidecar_ready") == 1


def test_prefill_side_metrics(moved: dict[str, object]) -> None:
    P = moved["P"]
    scrapes = moved["scrapes"]
    assert isinstance(scrapes, list)
    m = scrapes[0]
    assert value(m, "kvsidecar_completions_total", engine=P.engine_id,  # type: ignore[attr-defined]
                 outcome="sent") == N_READS
    # Two D ranks each notify the one P rank once per read.
    assert value(m, "kvsidecar_notifications_received_total", outcome="ok") == 2 * N_READS
    assert value(m, "kvsidecar_engine_requests_total", op="hold", error="") == N_READS + 1
    assert value(m, "kvsidecar_completions_total", outcome="expired") == 1
    assert value(m, "kvsidecar_holds_in_flight") == 0
    # Each D rank handshook the P rank at least once (server side, read at scrape time).
    assert value(m, "kvsidecar_handshake_requests_total") >= 2


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads((ROOT / "dashboards" / "kvsidecar.json").read_text())
    out = [(f"panel {p['title']!r} {t['refId']}", t["expr"])
           for p in dash["panels"] for t in p["targets"]]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["definition"])
            assert m, v["definition"]
            out.append((f"variable {v['name']}", m.group(1)))
    return out


def substitute(expr: str) -> str:
    for k, v in VARIABLES.items():
        expr = expr.replace(k, v)
    assert "$" not in expr, expr
    return expr


def test_dashboard_is_importable_grafana_json() -> None:
    dash = json.loads((ROOT / "dashboards" / "kvsidecar.json").read_text())
    names = {v["name"]: v for v in dash["templating"]["list"]}
    assert names["datasource"]["type"] == "datasource"
    assert names["datasource"]["query"] == "prometheus"
    assert {"engine", "peer", "instance"} <= set(names)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]


def test_every_dashboard_query_returns_data_from_real_prometheus(
        moved: dict[str, object]) -> None:
    prom = moved["prom"]
    if prom is None:
        pytest.skip("prometheus is not installed (make test installs it when run as root: "
                    "scripts/system-deps.sh)")
    assert isinstance(prom, Prometheus)
    empty = []
    for where, expr in dashboard_exprs():
        if not prom.query(substitute(expr)):
            empty.append(where)
    assert not empty, f"queries without data: {empty}"


def test_alert_rules_check_and_evaluate(moved: dict[str, object]) -> None:
    prom = moved["prom"]
    promtool = shutil.which("promtool")
    if prom is None or promtool is None:
        pytest.skip("prometheus/promtool are not installed (make test installs them as root)")
    assert isinstance(prom, Prometheus)
    rules = ROOT / "dashboards" / "alerts.yml"
    out = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    # Every rule expression parses in the server; the recording rules have data.
    exprs = re.findall(r"^\s+expr: (?!\|)(.+)$", rules.read_text(), re.M)
    for expr in exprs:
        prom.query(expr)
    assert prom.query('sum by (instance, engine, peer) '
                      '(rate(kvsidecar_read_bytes_total[1m]))')


def test_latency_histograms_carry_request_id_exemplars(moved: dict[str, object]) -> None:
    """OpenMetrics (what Prometheus asks for) shows a request id on the latency
    buckets; the plain text format has none, and no request id is a label."""
    d = moved["d"]
    assert isinstance(d, list)
    url = f"http://127.0.0.1:{d[0].metrics_port}/metrics"
    req = urllib.request.Request(url, headers={"Accept": "application/openmetrics-text"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        text = r.read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("kvsidecar_transfer_seconds_bucket")
             and " # {" in ln]
    assert lines and all('request_id="m' in ln for ln in lines), lines
    plain = urllib.request.urlopen(url, timeout=30).read().decode()
    assert "request_id" not in plain
