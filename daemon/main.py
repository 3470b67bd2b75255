"""``kvsidecar serve``: run one sidecar until SIGTERM/SIGINT (the command line
itself is :mod:`kvsidecar.cli`)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys

from kvsidecar.daemon import settings as settings_mod

log = logging.getLogger("kvsidecar")


async def _serve(s: settings_mod.Settings) -> int:
    # Importing NIXL (and the torch it loads) takes seconds; pay it before
    # announcing readiness, not inside the first engine's registration.
    import nixl._api  # noqa: F401

    from kvsidecar.daemon.conn_guard import raise_fd_limit
    from kvsidecar.daemon.engine_access import SocketInUse
    from kvsidecar.daemon.health import verdict
    from kvsidecar.daemon.nixl_worker import transport_note
    from kvsidecar.daemon.service import Sidecar
    from kvsidecar.metrics.registry import Metrics
    from kvsidecar.metrics.server import MetricsServer

    log.info("file descriptor limit: %d", raise_fd_limit())
    metrics = Metrics()
    sidecar = Sidecar(s, metrics)
    try:
        await sidecar.start()
    except SocketInUse as e:
        print(f"kvsidecar: {e}", file=sys.stderr, flush=True)
        return 2
    except (PermissionError, NotADirectoryError, FileExistsError) as e:
        print(f"kvsidecar: cannot serve {s.socket}: {e}", file=sys.stderr, flush=True)
        return 2
    probes = {"/healthz": lambda: verdict(sidecar.liveness()),
              "/readyz": lambda: verdict(sidecar.readiness())}
    http = (MetricsServer(metrics, s.metrics_host, s.metrics_port, probes=probes)
            if s.metrics_port >= 0 else None)
    metrics_port = http.start() if http is not None else -1
    log.info("transport: %s", transport_note())
    if s.device != "cpu":
        log.warning("device %s: GPU memory (CUDA IPC) is not supported yet; engines register "
                    "host shared-memory regions, and the device only names the socket", s.device)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # One machine-readable line on stdout, for supervisors, tests and the demo.
    print("KVSIDECAR READY " + json.dumps({
        "socket": s.socket, "handshake": sidecar.handshake_address,
        "metrics_port": metrics_port, "daemon_id": sidecar.daemon_id,
    }), flush=True)
    await stop.wait()
    log.info("signal received: shutting down")
    await sidecar.stop()
    if http is not None:
        http.stop()
    return 0


def serve(s: settings_mod.Settings) -> int:
    logging.basicConfig(level=getattr(logging, s.log_level, logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop

        return uvloop.run(_serve(s))
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(_serve(s))
