"""``kvsidecar serve``: run one sidecar until SIGTERM/SIGINT (the command line
itself is :mod:`kvsidecar.cli`, which runs :mod:`~kvsidecar.daemon.preflight`
first: what is refused here is what changed between its checks and the start)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import sys
from typing import TYPE_CHECKING

from kvsidecar import __version__
from kvsidecar.daemon import settings as settings_mod

if TYPE_CHECKING:
    from kvsidecar.daemon.app import Sidecar
    from kvsidecar.daemon.sdnotify import Notifier

log = logging.getLogger("kvsidecar")


async def _serve(s: settings_mod.Settings) -> int:
    # Importing NIXL (and the torch it loads) takes seconds; pay it before
    # announcing readiness, not inside the first engine's registration.
    import nixl._api  # noqa: F401

    from kvsidecar.daemon import logs
    from kvsidecar.daemon.sdnotify import Notifier, watchdog_interval

    logs.quiet_libraries(s.log_level)  # NIXL configured its stdout handler on import

    from kvsidecar.daemon.app import Sidecar
    from kvsidecar.daemon.conn_guard import raise_fd_limit
    from kvsidecar.daemon.engine_access import SocketInUse
    from kvsidecar.daemon.health import verdict
    from kvsidecar.daemon.transport.worker import transport_note
    from kvsidecar.ipc.cuda import CudaError
    from kvsidecar.metrics.registry import Metrics
    from kvsidecar.metrics.server import MetricsServer

    log.info("file descriptor limit: %d", raise_fd_limit())
    metrics = Metrics()
    try:
        sidecar = Sidecar(s, metrics)
    except ValueError as e:  # peer keys missing or unsafe
        print(f"kvsidecar: {e} (or --insecure-peers, for development only)", file=sys.stderr,
              flush=True)
        return 2
    if s.insecure_peers:
        log.warning("--insecure-peers: the handshake port %s:%d is NOT authenticated; anyone "
                    "who reaches it gets the metadata to read and write every registered "
                    "engine's KV memory. Development only.", s.handshake_host, s.handshake_port)
    try:
        await sidecar.start()
    except SocketInUse as e:
        print(f"kvsidecar: {e}", file=sys.stderr, flush=True)
        return 2
    except (PermissionError, NotADirectoryError, FileExistsError) as e:
        print(f"kvsidecar: cannot serve {s.socket}: {e}", file=sys.stderr, flush=True)
        return 2
    except CudaError as e:
        print(f"kvsidecar: --device {s.device}: {e}", file=sys.stderr, flush=True)
        return 2
    probes = {"/healthz": lambda: verdict(sidecar.liveness()),
              "/readyz": lambda: verdict(sidecar.readiness())}
    http = (MetricsServer(metrics, s.metrics_host, s.metrics_port, probes=probes)
            if s.metrics_port >= 0 else None)
    try:
        metrics_port = http.start() if http is not None else -1
    except OSError as e:  # taken since preflight checked it: refuse whole, nothing left running
        print(f"kvsidecar: --metrics-host {s.metrics_host} --metrics-port {s.metrics_port}: "
              f"{e.strerror or e}", file=sys.stderr, flush=True)
        await sidecar.stop()
        return 2
    log.info("transport: %s", transport_note())
    # The start-up heap (NIXL, torch, numpy, the modules) is never garbage:
    # frozen, the collector stops walking it in every full collection (they
    # were 5 % of a busy D sidecar's CPU).
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # One machine-readable line on stdout, for supervisors, tests and the demo.
    print("KVSIDECAR READY " + json.dumps({
        "version": __version__, "socket": s.socket, "handshake": sidecar.handshake_address,
        "metrics_port": metrics_port, "daemon_id": sidecar.daemon_id,
        "peer_auth": sidecar.peer_auth,
    }), flush=True)
    notifier = Notifier()
    notifier.send(ready=1, status=f"listening: engines on {s.socket}, handshakes on "
                                  f"{sidecar.handshake_address}, metrics port {metrics_port}")
    interval = watchdog_interval()
    dog = (asyncio.ensure_future(_watchdog(notifier, sidecar, interval))
           if notifier.enabled and interval else None)
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(sidecar.refused.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    rc = 0
    if stop.is_set():
        log.info("signal received: shutting down")
    else:  # the transport self-check failed: a start-up refusal, found a moment late
        rc = 2
    notifier.send(stopping=1, status="draining: refusing new work, finishing posted reads")
    await sidecar.stop()
    if dog is not None:
        dog.cancel()
    if http is not None:
        http.stop()
    notifier.close()
    if rc:
        print(f"kvsidecar: {sidecar.refusal}", file=sys.stderr, flush=True)
    return rc


async def _watchdog(notifier: Notifier, sidecar: Sidecar, interval: float) -> None:
    """``WATCHDOG=1`` from the event loop, only while the loop and every NIXL worker
    thread are live: a wedged loop (or worker) stops the pings and systemd
    restarts the unit after ``WatchdogSec``."""
    while True:
        await asyncio.sleep(interval)
        failed = [c.name for c in sidecar.liveness() if not c.ok]
        if failed:
            log.error("not live (%s): withholding the systemd watchdog ping", ", ".join(failed))
            notifier.send(status=f"not live: {', '.join(failed)}")
            continue
        engines = len(sidecar.engine_ids())
        notifier.send(watchdog=1, status=f"serving {engines} engine rank(s)")


def serve(s: settings_mod.Settings) -> int:
    from kvsidecar.daemon import cpu_policy, logs

    logs.setup(s.log_level, s.log_format)
    # Before the loop and its threads start: they inherit the policy.
    refused = cpu_policy.apply(s.cpu_policy)
    if refused is not None:
        log.warning("--cpu-policy %s: %s; those threads run under the kernel's default",
                    s.cpu_policy, refused)
    try:
        import uvloop

        return uvloop.run(_serve(s))
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(_serve(s))
