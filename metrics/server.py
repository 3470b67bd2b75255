"""The daemon's HTTP endpoint: ``/metrics`` of its own registry, plus JSON
probes (``/healthz``, ``/readyz``) the daemon plugs in.

A plain ``ThreadingHTTPServer`` on a daemon thread (scrapes must work even
when the event loop is busy or wedged); one server per daemon, stopped with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_TYPE

from kvsidecar.metrics.registry import Metrics


class MetricsServer:
    def __init__(self, metrics: Metrics, host: str, port: int, *,
                 probes: Mapping[str, Callable[[], tuple[int, bytes]]] | None = None) -> None:
        """``probes`` maps a path to a function returning (HTTP status, JSON body);
        it runs on the server's thread, so it must not wait for the event loop."""
        self._metrics = metrics
        self._probes = dict(probes or {})
        self._host = host
        self._port = port
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Bind and serve on a daemon thread; returns the bound port."""
        metrics = self._metrics
        probes = self._probes

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    # Prometheus asks for OpenMetrics (exemplars) in its Accept header.
                    om = "application/openmetrics-text" in self.headers.get("Accept", "")
                    self._send(200, metrics.render(om),
                               OPENMETRICS_TYPE if om else CONTENT_TYPE_LATEST)
                elif path in probes:
                    try:
                        code, body = probes[path]()
                    except Exception as e:  # a probe that breaks is a failing probe
                        code, body = 503, f'{{"status": "fail", "error": {str(e)!r}}}\n'.encode()
                    self._send(code, body, "application/json")
                else:
                    known = ", ".join(["/metrics", *probes])
                    self._send(404, f"not found; try {known}\n".encode(), "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                """Scrapes every few seconds are not news; stay quiet."""

        self._httpd = ThreadingHTTPServer((self._host, self._port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvs-metrics",
                                        daemon=True)
        self._thread.start()
        return int(self._httpd.server_address[1])

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
