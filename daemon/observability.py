"""What a sidecar reports about itself: sampled gauges, liveness, readiness,
and the start-up transport self-check.

- :class:`Sampler`: every ``SAMPLE_PERIOD_S`` on the event loop, measure its
  lag and copy the state gauges from the loop's own data (no locks, no
  scrape-time iteration from another thread); its ``loop_beat`` is what
  /healthz and the systemd watchdog look at.
- :class:`TransportChecks`: the loopback READ self-check (and, on a GPU, the
  same on the GPU's memory), run once at start, off the loop. Under
  ``--transport-check require-zero-copy`` a failed check sets ``refused``.
- :class:`Health`: the liveness and readiness checks (see
  :mod:`~kvsidecar.daemon.health`); any thread may call them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from kvsidecar.daemon.d_side.table import ReadTable
from kvsidecar.daemon.engines.table import EngineTable
from kvsidecar.daemon.health import Check, heartbeat
from kvsidecar.daemon.settings import Settings
from kvsidecar.daemon.state import DaemonState
from kvsidecar.daemon.transport.check import CheckResult, run_check
from kvsidecar.metrics.registry import Metrics

log = logging.getLogger(__name__)

#: How often the event loop samples its own lag and the state gauges.
SAMPLE_PERIOD_S = 0.5


class Sampler:
    def __init__(self, table: EngineTable, reads: ReadTable, metrics: Metrics) -> None:
        self.table = table
        self.reads = reads
        self.metrics = metrics
        #: monotonic time the event loop last ran the sampling timer
        self.loop_beat = time.monotonic()

    async def run(self, period_s: float = SAMPLE_PERIOD_S) -> None:
        """Sample every ``period_s`` until cancelled."""
        m = self.metrics
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(period_s)
            now = time.monotonic()
            self.loop_beat = now
            m.loop_lag.set(max(0.0, now - t0 - period_s))
            try:
                self._gauges(now)
            except Exception:  # sampling must outlive any single bad entry
                log.exception("metrics sampling failed; continuing")

    def _gauges(self, now: float) -> None:
        m = self.metrics
        reads = self.reads.by_engine()
        for eng in list(self.table.ranks.values()):
            e = eng.engine_id
            m.reads_in_flight.labels(e).set(reads.get(e, 0))
            m.holds_in_flight.labels(e).set(len(eng.holds))
            m.registered_regions.labels(e).set(len(eng.regions))
            m.registered_bytes.labels(e).set(len(eng.regions) * eng.layout.region_bytes)
            m.peers.labels(e).set(len(eng.peers))
            m.worker_lag.labels(e).set(max(0.0, now - min(w.heartbeat for w in eng.lanes)))
        m.engines.set(len(self.table))


class TransportChecks:
    def __init__(self, settings: Settings, metrics: Metrics, state: DaemonState) -> None:
        self.settings = settings
        self.metrics = metrics
        self.state = state
        #: the host self-check's result: None while it runs (or when off)
        self.host: CheckResult | None = None
        #: the same on the GPU's memory (GPU sidecars only): None while it runs
        self.vram: CheckResult | None = None
        #: set when the host check failed under ``--transport-check
        #: require-zero-copy``: ``kvsidecar serve`` then stops and exits 2 with
        #: :attr:`refusal` (a misconfigured host is a crash loop with its reason,
        #: not a sidecar that never becomes ready)
        self.refused = asyncio.Event()
        self.refusal = ""

    async def run(self) -> None:
        """Run the loopback self-check once, off the loop, and publish its result."""
        try:
            r = await run_check(self.settings.transport_check)
        except Exception as e:  # a check that cannot run is a failed check, not a crash
            r = CheckResult("error", (), 0.0, 0, False, f"{type(e).__name__}: {e}")
        self.host = r
        self.metrics.transport_info.labels(path=r.path, passed=str(r.passed).lower()).set(1)
        self.metrics.transport_bandwidth.set(r.bandwidth_bytes_s)
        _log_check("transport", r)
        if not r.passed and self.settings.transport_check == "require-zero-copy":
            self.refusal = (f"--transport-check require-zero-copy: the start-up loopback READ "
                            f"took the {r.path} path: {r.detail}")
            self.refused.set()
            return
        await self._run_vram()

    async def _run_vram(self) -> None:
        """The same READ between two buffers on the GPU, judged by its facts."""
        gpu = self.state.gpu
        if gpu is None:
            return
        try:
            v = await run_check(self.settings.transport_check, 256 << 20, device=gpu.ordinal)
        except Exception as e:
            v = CheckResult("error", (), 0.0, 0, False, f"{type(e).__name__}: {e}")
        self.vram = v
        gpu.vram_check_passed = v.passed  # engine-allocated CUDA attach follows it (warn)
        self.metrics.transport_info.labels(path=f"vram:{v.path}",
                                           passed=str(v.passed).lower()).set(1)
        _log_check("VRAM transport", v)


def _log_check(what: str, r: CheckResult) -> None:
    (log.info if r.passed else log.error)(
        "%s self-check %s: path %s (%s), loopback READ %.2f GB/s; %s", what,
        "passed" if r.passed else "FAILED", r.path, ",".join(r.transports) or "-",
        r.bandwidth_bytes_s / 1e9, r.detail)


class Health:
    def __init__(self, settings: Settings, metrics: Metrics, state: DaemonState,
                 table: EngineTable, sampler: Sampler, transport: TransportChecks) -> None:
        self.settings = settings
        self.metrics = metrics
        self.state = state
        self.table = table
        self.sampler = sampler
        self.transport = transport
        self._listener = ListenerProbe()

    def liveness(self) -> list[Check]:
        """Event loop and NIXL worker threads responsive (any thread may call this)."""
        now = time.monotonic()
        bound = self.settings.health_timeout_s
        checks = [heartbeat("event_loop", now - self.sampler.loop_beat, bound)]
        for engine_id, eng in list(self.table.ranks.items()):
            for k, w in enumerate(eng.lanes):
                checks.append(heartbeat(f"worker:{engine_id}" + (f":lane{k}" if k else ""),
                                        now - w.heartbeat, bound))
        return checks

    def readiness(self) -> list[Check]:
        """Liveness plus agents up, listener bound, self-check passed, not draining."""
        checks = self.liveness()
        ranks = self.table.ranks
        down = [e for e, eng in list(ranks.items())
                if any(not w.running or w.down_reason for w in eng.lanes)]
        checks.append(Check("nixl_agents", not down, f"agents down: {', '.join(down)}" if down
                            else f"{len(ranks)} engine agents running"))
        checks.append(self._listener_check())
        checks.extend(self._transport_checks())
        drain = self.table.drain
        draining = (f"; {len(drain)} ended engine(s) draining "
                    f"{sum(len(g.rank.holds) for g in drain)} hold(s)" if len(drain) else "")
        stopping = self.state.stopping
        checks.append(Check("not_draining", not stopping,
                            ("draining: shutting down" if stopping else "serving") + draining))
        self.metrics.ready.set(all(c.ok for c in checks))
        return checks

    def _transport_checks(self) -> list[Check]:
        mode = self.settings.transport_check
        r = self.transport.host
        if mode == "off":
            return [Check("transport_selfcheck", True, "disabled (--transport-check off)")]
        checks = [Check("transport_selfcheck", False, "still running") if r is None else
                  Check("transport_selfcheck", r.passed,
                        f"path {r.path}, {r.bandwidth_bytes_s / 1e9:.2f} GB/s: {r.detail}")]
        if self.state.gpu is not None:
            v = self.transport.vram
            checks.append(Check("transport_selfcheck_vram", v is not None and v.passed,
                                "still running" if v is None else
                                f"path {v.path}, {v.bandwidth_bytes_s / 1e9:.2f} GB/s: "
                                f"{v.detail}"))
        return checks

    def _listener_check(self) -> Check:
        """The handshake port's listening socket is still there.

        Read from the kernel's socket tables, never by connecting: a TCP
        connection that sends no ZMTP greeting is a failed handshake to libzmq,
        so a connect per probe made every ``/readyz`` and ``kvsidecar status``
        a refused peer (``kvsidecar_refused_total{channel="peer"}``, a WARNING
        line, and the log's budget of refusal lines spent on probes)."""
        bound = self.state.handshake_bound
        if not bound:
            return Check("handshake_listener", False, "not started")
        port = int(bound.rsplit(":", 1)[1])
        try:
            listening = self._listener.listening(port)
        except OSError as e:
            return Check("handshake_listener", False, f"{bound}: cannot read the socket "
                         f"tables ({e})")
        if not listening:
            return Check("handshake_listener", False,
                         f"{bound}: this process has no socket listening on port {port}")
        return Check("handshake_listener", True, f"listening on {bound}")


#: TCP_LISTEN in the ``st`` column of /proc/net/tcp and /proc/net/tcp6
_TCP_LISTEN = "0A"


class ListenerProbe:
    """Whether this process has a TCP socket listening on a port, from
    ``/proc/net/tcp{,6}`` (the listening sockets of its network namespace,
    with their inodes) and ``/proc/self/fd`` (which of those inodes are its
    own): another process listening on the same port does not count. The
    socket found (its fd and inode) is remembered and asked directly next
    time (still that socket, still listening on the port), so the tables,
    which grow with every TCP socket of the namespace, are read again only
    when the listening socket changed."""

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc
        self._inode: str | None = None
        self._fd: int | None = None

    def listening(self, port: int) -> bool:
        if self._fd is not None and self._still_listening(self._fd, port):
            return True
        inodes = self._listening_inodes(port)
        own = self._own_socket_inodes() if inodes else {}
        self._inode = next((i for i in sorted(inodes) if i in own), None)
        self._fd = None if self._inode is None else own[self._inode]
        return self._inode is not None

    def _still_listening(self, fd: int, port: int) -> bool:
        """Whether ``fd`` is still the socket found, listening on ``port`` (asked
        of the socket itself; only for this process's real /proc)."""
        try:
            if os.readlink(f"{self.proc}/self/fd/{fd}") != f"socket:[{self._inode}]":
                return False
        except OSError:
            return False
        if self.proc != "/proc":  # a stand-in /proc has no real socket behind it
            return False
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            return False
        try:
            here = s.getsockname()
            return (s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
                    and isinstance(here, tuple) and here[1] == port)
        except OSError:
            return False
        finally:
            s.detach()  # libzmq's fd: never closed here

    def _listening_inodes(self, port: int) -> set[str]:
        out: set[str] = set()
        for table in ("tcp", "tcp6"):
            try:
                with open(f"{self.proc}/net/{table}") as f:
                    lines = f.read().splitlines()[1:]  # after the header
            except FileNotFoundError:  # no IPv6 in this kernel
                continue
            for line in lines:
                fields = line.split()
                # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
                if (len(fields) > 9 and fields[3] == _TCP_LISTEN
                        and int(fields[1].rsplit(":", 1)[1], 16) == port):
                    out.add(fields[9])
        return out

    def _own_socket_inodes(self) -> dict[str, int]:
        """This process's sockets: inode -> fd."""
        out: dict[str, int] = {}
        fds = f"{self.proc}/self/fd"
        for fd in os.listdir(fds):
            try:
                target = os.readlink(f"{fds}/{fd}")
            except OSError:  # closed since the listing
                continue
            if target.startswith("socket:[") and fd.isdigit():
                out[target[8:-1]] = int(fd)
        return out
