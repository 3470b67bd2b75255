"""Sidecar settings: command-line flags, each with a ``KVSIDECAR_*`` environment default.

Environment variables exist for systemd units and Kubernetes pods, where one
template serves every GPU; flags win over the environment.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    socket: str
    handshake_host: str = "127.0.0.1"
    handshake_port: int = 0
    advertise_host: str = ""
    backends: tuple[str, ...] = ("UCX",)
    device: str = "cpu"
    hold_timeout_s: float = 120.0
    notif_grace_s: float = 30.0
    handshake_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    engine_lease_s: float = 30.0
    metrics_port: int = -1
    metrics_host: str = "127.0.0.1"
    log_level: str = "INFO"
    allow_uids: tuple[int, ...] = ()
    allow_gids: tuple[int, ...] = ()
    max_message_bytes: int = 16 << 20
    max_engine_connections: int = 256
    max_peer_connections: int = 1024

    @property
    def advertised(self) -> str:
        """The host peers should dial: the bind host unless it is a wildcard."""
        if self.advertise_host:
            return self.advertise_host
        if self.handshake_host in ("0.0.0.0", "*", "::"):
            import socket

            return socket.gethostname()
        return self.handshake_host


MAX_SECONDS = 86400.0
"""Upper bound of every duration setting: a typo of extra zeros fails at start-up."""

_DEVICE = re.compile(r"^(cpu|cuda:\d+)$")


def default_socket(device: str) -> str:
    """``$RUNTIME_DIRECTORY`` (systemd's ``RuntimeDirectory=``, owned by the
    service's user), else ``$XDG_RUNTIME_DIR/kvsidecar``, else a per-uid
    directory in /tmp (a shared name there could be taken by another user first)."""
    name = f"{device.replace(':', '')}.sock"
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if runtime:
        return os.path.join(runtime, name)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "kvsidecar", name)
    return os.path.join("/tmp", f"kvsidecar-{os.geteuid()}", name)


def _ids(text: str, what: str) -> tuple[int, ...]:
    """``"1000,1001"`` -> (1000, 1001); names are resolved by the system's user/group db."""
    import grp
    import pwd

    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if item.isdigit():
            out.append(int(item))
            continue
        try:
            out.append(pwd.getpwnam(item).pw_uid if what == "uid" else grp.getgrnam(item).gr_gid)
        except KeyError:
            raise SystemExit(f"kvsidecar: --allow-{what}: no such {what} {item!r}") from None
    return tuple(out)


def _env(name: str, default: str) -> str:
    return os.environ.get(f"KVSIDECAR_{name}", default)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=_env("DEVICE", "cpu"),
                   help="cpu or cuda:N; names the default socket (env KVSIDECAR_DEVICE)")
    p.add_argument("--socket", default=_env("SOCKET", ""),
                   help="engine IPC socket path (env KVSIDECAR_SOCKET; default "
                        "$XDG_RUNTIME_DIR or /tmp, then kvsidecar/<device>.sock)")
    p.add_argument("--handshake-host", default=_env("HANDSHAKE_HOST", "127.0.0.1"),
                   help="address the handshake server binds (env KVSIDECAR_HANDSHAKE_HOST)")
    p.add_argument("--handshake-port", type=int, default=int(_env("HANDSHAKE_PORT", "0")),
                   help="handshake TCP port, 0 = ephemeral (env KVSIDECAR_HANDSHAKE_PORT)")
    p.add_argument("--advertise-host", default=_env("ADVERTISE_HOST", ""),
                   help="host peers dial, when the bind host is a wildcard "
                        "(env KVSIDECAR_ADVERTISE_HOST)")
    p.add_argument("--backends", default=_env("BACKENDS", "UCX"),
                   help="comma-separated NIXL backends (env KVSIDECAR_BACKENDS)")
    p.add_argument("--hold-timeout", type=float, default=float(_env("HOLD_TIMEOUT", "120")),
                   help="seconds an unread hold lives (env KVSIDECAR_HOLD_TIMEOUT)")
    p.add_argument("--notif-grace", type=float, default=float(_env("NOTIF_GRACE", "30")),
                   help="seconds a notification waits for its hold (env KVSIDECAR_NOTIF_GRACE)")
    p.add_argument("--handshake-timeout", type=float,
                   default=float(_env("HANDSHAKE_TIMEOUT", "5")),
                   help="seconds to wait for a peer's handshake (env KVSIDECAR_HANDSHAKE_TIMEOUT)")
    p.add_argument("--read-timeout", type=float, default=float(_env("READ_TIMEOUT", "60")),
                   help="seconds a posted read may take before it is cancelled and fails "
                        "(env KVSIDECAR_READ_TIMEOUT)")
    p.add_argument("--engine-lease", type=float, default=float(_env("ENGINE_LEASE", "30")),
                   help="an engine that sends no request (a poll is enough) for this many "
                        "seconds is taken for dead and released (env KVSIDECAR_ENGINE_LEASE)")
    p.add_argument("--metrics-port", type=int, default=int(_env("METRICS_PORT", "-1")),
                   help="Prometheus /metrics port, -1 = off, 0 = ephemeral "
                        "(env KVSIDECAR_METRICS_PORT)")
    p.add_argument("--metrics-host", default=_env("METRICS_HOST", "127.0.0.1"),
                   help="address the metrics endpoint binds (env KVSIDECAR_METRICS_HOST)")
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"),
                   help="DEBUG, INFO, WARNING, ERROR (env KVSIDECAR_LOG_LEVEL)")
    p.add_argument("--allow-uid", default=_env("ALLOW_UID", ""),
                   help="comma-separated users (names or uids) besides the sidecar's own that "
                        "may use the engine socket (env KVSIDECAR_ALLOW_UID)")
    p.add_argument("--allow-gid", default=_env("ALLOW_GID", ""),
                   help="comma-separated groups (names or gids) whose members may use the "
                        "engine socket (env KVSIDECAR_ALLOW_GID)")
    p.add_argument("--max-message-bytes", type=int,
                   default=int(_env("MAX_MESSAGE_BYTES", str(16 << 20))),
                   help="largest engine message; a larger one drops the connection "
                        "(env KVSIDECAR_MAX_MESSAGE_BYTES)")
    p.add_argument("--max-engine-connections", type=int,
                   default=int(_env("MAX_ENGINE_CONNECTIONS", "256")),
                   help="engine socket connections kept; more are shut "
                        "(env KVSIDECAR_MAX_ENGINE_CONNECTIONS)")
    p.add_argument("--max-peer-connections", type=int,
                   default=int(_env("MAX_PEER_CONNECTIONS", "1024")),
                   help="handshake port connections kept; more are shut "
                        "(env KVSIDECAR_MAX_PEER_CONNECTIONS)")


def from_args(ns: argparse.Namespace) -> Settings:
    if not _DEVICE.match(ns.device):
        raise SystemExit(f"kvsidecar: --device must be cpu or cuda:N, got {ns.device!r}")
    backends = tuple(b.strip() for b in ns.backends.split(",") if b.strip())
    if not backends:
        raise SystemExit("kvsidecar: --backends names no backend")
    for name in ("hold_timeout", "notif_grace", "handshake_timeout", "read_timeout",
                 "engine_lease"):
        value = getattr(ns, name)
        if not math.isfinite(value) or value <= 0 or value > MAX_SECONDS:
            raise SystemExit(f"kvsidecar: --{name.replace('_', '-')} must be a finite number "
                             f"of seconds in (0, {MAX_SECONDS:g}], got {value}")
    for name in ("max_message_bytes", "max_engine_connections", "max_peer_connections"):
        if getattr(ns, name) <= 0:
            raise SystemExit(f"kvsidecar: --{name.replace('_', '-')} must be > 0")
    return Settings(
        socket=ns.socket or default_socket(ns.device),
        handshake_host=ns.handshake_host,
        handshake_port=ns.handshake_port,
        advertise_host=ns.advertise_host,
        backends=backends,
        device=ns.device,
        hold_timeout_s=ns.hold_timeout,
        notif_grace_s=ns.notif_grace,
        handshake_timeout_s=ns.handshake_timeout,
        read_timeout_s=ns.read_timeout,
        engine_lease_s=ns.engine_lease,
        metrics_port=ns.metrics_port,
        metrics_host=ns.metrics_host,
        log_level=ns.log_level.upper(),
        allow_uids=_ids(ns.allow_uid, "uid"),
        allow_gids=_ids(ns.allow_gid, "gid"),
        max_message_bytes=ns.max_message_bytes,
        max_engine_connections=ns.max_engine_connections,
        max_peer_connections=ns.max_peer_connections,
    )
