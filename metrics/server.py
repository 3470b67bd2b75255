"""The daemon's HTTP endpoint: ``/metrics`` of its own registry, plus JSON
probes (``/healthz``, ``/readyz``) the daemon plugs in.

A plain ``ThreadingHTTPServer`` on a daemon thread (scrapes must work even
when the event loop is busy or wedged); one server per daemon, stopped with it.

Bounded, because anyone who reaches the port is input: the standard library
server starts one thread per connection and waits for a request without end,
so clients that connect and send nothing (or half a request line) each kept
a thread and an fd for good (measured: 600 such connections, 600 threads and
fds more in the sidecar, growing with every one). Here a connection gets
:data:`IO_TIMEOUT_S` for its whole request and reply (a deadline, not a
per-read timeout: one byte every 3 s held a slot for good), at most
:data:`MAX_CONNECTIONS` are served at once and :data:`MAX_PER_CLIENT` from one
address (the next ones are closed as they arrive), and every refusal,
timeout or broken client is counted in
``kvsidecar_refused_total{channel="metrics"}`` and logged in one line
(rate-limited), never as a traceback.

Probes stay answerable: when every slot is taken, a client still under its
per-address bound gets one of :data:`PROBE_SLOTS` more, with
:data:`PROBE_DEADLINE_S` for the whole exchange, served only the probe paths
(others get 503). Slow scrapers from a few addresses (4 x 8 connections
trickling a byte every 3 s refused every /healthz before, so a kubelet would
have restarted a healthy sidecar) can no longer keep the kubelet out; an
attacker needs more source addresses than the bounds allow, which a network
policy on the port is for.

Why this server and not an HTTP library: a request costs one short-lived
thread here either way (probes must be answered off the event loop, which
may be the thing that is stuck), and the standard library's parser with
these bounds is what we need; an asynchronous server would need its own
loop thread and a dependency (aiohttp, or uvicorn with h11) for the same
guarantees.
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_TYPE

from kvsidecar.metrics.log_rate import worth_logging
from kvsidecar.metrics.registry import Metrics

log = logging.getLogger(__name__)

#: Connections served at once; more are closed on arrival. Prometheus and the
#: kubelet's probes need a handful.
MAX_CONNECTIONS = 32
#: Connections served at once from one client address, so that one client that
#: holds its connections open cannot take every slot from the scraper and the
#: kubelet's probes (a failing liveness probe restarts the sidecar).
MAX_PER_CLIENT = 8
#: Seconds a connection may take for its whole request and reply: a scrape on
#: one host takes milliseconds.
IO_TIMEOUT_S = 5.0
#: Connections admitted past MAX_CONNECTIONS for the probes only.
PROBE_SLOTS = 4
#: Seconds a connection in a probe slot may take for its whole exchange.
PROBE_DEADLINE_S = 1.0


class _DeadlineIO(io.RawIOBase):
    """Reads from ``sock``, each read waiting at most until ``deadline``
    (monotonic): TimeoutError once it has passed, however the bytes trickle in."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        arm(self._sock, self.deadline)
        return self._sock.recv_into(b)


def arm(sock: socket.socket, deadline: float) -> None:
    """Let the next I/O on ``sock`` wait only until ``deadline``."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out (the whole-request deadline passed)")
    sock.settimeout(left)


class _BoundedServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 refused: Callable[[str, str], None], max_connections: int,
                 max_per_client: int) -> None:
        super().__init__(address, handler)
        self._max = max_connections
        self._max_per_client = max_per_client
        self._lock = threading.Lock()
        self._open = 0
        self._probing = 0
        self._by_client: dict[str, int] = {}
        #: the lane of each request being served ("main" or "probe"), by its socket
        self.lanes: dict[Any, str] = {}
        self.refused = refused

    def _take(self, client: str) -> tuple[str, str]:
        """(lane, '') for a slot taken for ``client``, else ('', the refusal's reason)."""
        with self._lock:
            if self._by_client.get(client, 0) >= self._max_per_client:
                return "", "client_connection_limit"
            if self._open < self._max:
                self._open += 1
                lane = "main"
            elif self._probing < PROBE_SLOTS:
                self._probing += 1
                lane = "probe"
            else:
                return "", "connection_limit"
            self._by_client[client] = self._by_client.get(client, 0) + 1
            return lane, ""

    def _give(self, client: str, lane: str) -> None:
        with self._lock:
            if lane == "probe":
                self._probing -= 1
            else:
                self._open -= 1
            left = self._by_client[client] - 1
            if left:
                self._by_client[client] = left
            else:
                del self._by_client[client]

    def process_request(self, request: Any, client_address: Any) -> None:
        client = str(client_address[0]) if isinstance(client_address, tuple) else ""
        lane, why = self._take(client)
        if why:
            self.refused(why, str(client_address))
            self.shutdown_request(request)
            return
        self.lanes[request] = lane
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.lanes.pop(request, None)
            self._give(client, lane)  # no thread was started to give it back
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            lane = self.lanes.pop(request, "main")
            self._give(str(client_address[0]) if isinstance(client_address, tuple) else "",
                       lane)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that vanished or stalled mid-reply: counted, one line, no traceback."""
        self.refused("broken_client", str(client_address))


class MetricsServer:
    def __init__(self, metrics: Metrics, host: str, port: int, *,
                 probes: Mapping[str, Callable[[], tuple[int, bytes]]] | None = None,
                 max_connections: int = MAX_CONNECTIONS,
                 max_per_client: int = MAX_PER_CLIENT,
                 io_timeout_s: float = IO_TIMEOUT_S) -> None:
        """``probes`` maps a path to a function returning (HTTP status, JSON body);
        it runs on the server's thread, so it must not wait for the event loop."""
        self._metrics = metrics
        self._probes = dict(probes or {})
        self._host = host
        self._port = port
        self._max_connections = max_connections
        self._max_per_client = max_per_client
        self._io_timeout_s = io_timeout_s
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._refusals: dict[str, int] = {}
        self._lock = threading.Lock()

    def _refused(self, reason: str, client: str) -> None:
        self._metrics.refused.labels("metrics", reason).inc()
        with self._lock:
            n = self._refusals[reason] = self._refusals.get(reason, 0) + 1
        if worth_logging(n):
            log.warning("metrics endpoint: dropped a connection from %s (%s; %d so far)",
                        client, reason, n)

    def start(self) -> int:
        """Bind and serve on a daemon thread; returns the bound port."""
        metrics = self._metrics
        probes = self._probes
        refused = self._refused
        io_timeout_s = self._io_timeout_s

        class Handler(BaseHTTPRequestHandler):
            timeout = io_timeout_s  # applied to the connection's socket
            deadline = 0.0
            lane = "main"

            def setup(self) -> None:
                super().setup()
                server = self.server
                assert isinstance(server, _BoundedServer)
                self.lane = server.lanes.get(self.request, "main")
                self.deadline = time.monotonic() + (
                    min(PROBE_DEADLINE_S, io_timeout_s) if self.lane == "probe"
                    else io_timeout_s)
                # One deadline for the whole request: every read waits only until it.
                self.rfile = io.BufferedReader(_DeadlineIO(self.connection, self.deadline))

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if self.lane == "probe" and path not in probes:
                    self._send(503, b"busy: every connection slot is taken; only the "
                                    b"probes are served now\n", "text/plain")
                elif path == "/metrics":
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
                arm(self.connection, self.deadline)  # sendall: the whole reply by then
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_error(self, format: str, *args: Any) -> None:
                """Called for a request that timed out or did not parse (answered 4xx)."""
                why = "timeout" if format.startswith("Request timed out") else "bad_request"
                refused(why, str(self.client_address))

            def log_message(self, format: str, *args: object) -> None:
                """Scrapes every few seconds are not news; stay quiet."""

        self._httpd = _BoundedServer((self._host, self._port), Handler, refused,
                                     self._max_connections, self._max_per_client)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvs-metrics",
                                        daemon=True)
        self._thread.start()
        return int(self._httpd.server_address[1])

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

