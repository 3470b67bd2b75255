"""Sidecar settings: command-line flags, each with a ``KVSIDECAR_*`` environment default.

Environment variables exist for systemd units and Kubernetes pods, where one
template serves every GPU; flags win over the environment.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from kvsidecar.daemon.addresses import WILDCARDS, bracket, routable_address


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
    hold_lease_s: float = 10.0
    hold_max_life_s: float = 600.0
    #: on SIGTERM, how long the sidecar lets open holds (of live and of ended
    #: engines) end before it drops them and exits (0: drop at once)
    drain_timeout_s: float = 30.0
    max_reads_per_engine: int = 4096
    max_holds_per_engine: int = 65536
    max_completions_per_engine: int = 65536
    max_early_notifications: int = 4096
    max_peer_links_per_engine: int = 1024
    #: engines registered (or being registered) at once: each costs a NIXL agent
    #: (a thread, ~16 fds, ~5 MB) and its memory
    max_engines: int = 64
    metrics_port: int = -1
    metrics_host: str = "127.0.0.1"
    log_level: str = "INFO"
    allow_uids: tuple[int, ...] = ()
    allow_gids: tuple[int, ...] = ()
    max_message_bytes: int = 16 << 20
    max_engine_connections: int = 256
    max_peer_connections: int = 1024
    #: long engine messages under way may announce this much together (0: 8x --max-message-bytes)
    max_assembling_bytes: int = 0
    #: a long engine message must arrive whole this long after its header
    long_message_timeout_s: float = 30.0
    #: an engine connection that never registered and sends nothing this long is closed
    engine_idle_timeout_s: float = 60.0
    #: start-up loopback READ: require-zero-copy, allow-tcp or off (see transport/check.py)
    transport_check: str = "require-zero-copy"
    #: /healthz fails when the event loop or a worker thread is silent this long
    health_timeout_s: float = 10.0
    log_format: str = "text"
    #: OTLP/HTTP traces endpoint (needs the otel extra); empty = no tracing at all
    otlp_endpoint: str = ""
    peer_keys: str = ""
    insecure_peers: bool = False
    #: map POSIX shm (attach mode, and allocate/reserve with memory='shm'): it cannot be
    #: sealed, so an engine that truncates it kills this sidecar with SIGBUS on a read
    allow_unsealed_shm: bool = False
    #: engine-allocated GPU memory (attach mode): serve, warn (serve loudly unless the
    #: VRAM transport check failed) or refuse; see ipc/cuda_handles.decide_attach
    cuda_attach: str = "warn"
    #: descriptor economy (daemon/staging_plan.py): off, auto (cost model, and runs
    #: with at most MAX_WIRE_OVERHEAD foreign bytes) or always
    staging: str = "off"
    #: sidecar-owned host staging memory per engine rank (bytes), mapped on first use
    staging_bytes: int = 256 << 20
    #: D side: post a read while its lease claim is on the way when P granted a
    #: claim over the same links this recently (seconds; 0: always claim first)
    post_during_claim_s: float = 2.0
    #: P side: the most reads a reader may name in one batched notification, which
    #: lets it post the reads of one flush as one NIXL transfer (0: one per read)
    notif_batch_reads: int = 64
    #: D side: NIXL agents (each on its own worker thread) per engine rank that
    #: post reads; a hetero read's P ranks are posted on lanes in parallel
    post_lanes: int = 1
    #: digest what each read moved on both sides and fail a read whose bytes differ
    verify_bytes: bool = False

    @property
    def bind_host(self) -> str:
        """The handshake bind host as ZMQ wants it (IPv6 in brackets)."""
        return "*" if self.handshake_host in ("*", "") else bracket(self.handshake_host)

    @property
    def advertised(self) -> str:
        """The host peers should dial: ``--advertise-host``, else the bind host,
        else (a wildcard bind) this host's routable address; IPv6 bracketed.
        Raises SystemExit when a wildcard is bound and no address is found."""
        if self.advertise_host:
            return bracket(self.advertise_host)
        if self.handshake_host not in WILDCARDS:
            return bracket(self.handshake_host)
        found = routable_address(ipv6=":" in self.handshake_host)
        if found is None:
            raise SystemExit(f"kvsidecar: --handshake-host {self.handshake_host} is a wildcard "
                             "and this host has no routable address; pass --advertise-host")
        return found


MAX_SECONDS = 86400.0
"""Upper bound of every duration setting: a typo of extra zeros fails at start-up."""
MAX_POST_LANES = 8
"""Each lane is a NIXL agent, a thread and a registration of the engine's memory."""

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: Same values as kvsidecar.daemon.transport.check.MODES (settings import nothing heavy).
_CHECK_MODES = ("require-zero-copy", "allow-tcp", "off")
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
            raise ConfigError(f"--allow-{what} (env KVSIDECAR_ALLOW_{what.upper()}): no such "
                              f"{what} {item!r}") from None
    return tuple(out)


def _env(name: str, default: str) -> str:
    return os.environ.get(f"KVSIDECAR_{name}", default)


class ConfigError(ValueError):
    """A bad flag or KVSIDECAR_* value; the CLI prints it as one line and exits 2."""


def _number(kind: type[int] | type[float], env: str) -> Callable[[str], int | float]:
    """An argparse ``type`` that names the flag's environment variable when the
    value (typed on the command line or taken from the environment) is bad."""
    def parse(text: str) -> int | float:
        try:
            return kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(
                f"must be {what} (flag or env KVSIDECAR_{env}), got {text!r}") from None
    parse.__name__ = kind.__name__
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=_env("DEVICE", "cpu"),
                   help="cpu or cuda:N; names the default socket (env KVSIDECAR_DEVICE)")
    p.add_argument("--socket", default=_env("SOCKET", ""),
                   help="engine IPC socket path (env KVSIDECAR_SOCKET; default "
                        "$XDG_RUNTIME_DIR or /tmp, then kvsidecar/<device>.sock)")
    p.add_argument("--handshake-host", default=_env("HANDSHAKE_HOST", "127.0.0.1"),
                   help="address the handshake server binds (env KVSIDECAR_HANDSHAKE_HOST)")
    p.add_argument("--handshake-port", type=_number(int, "HANDSHAKE_PORT"),
                   default=_env("HANDSHAKE_PORT", "0"),
                   help="handshake TCP port, 0 = ephemeral (env KVSIDECAR_HANDSHAKE_PORT)")
    p.add_argument("--advertise-host", default=_env("ADVERTISE_HOST", ""),
                   help="host peers dial, when the bind host is a wildcard "
                        "(env KVSIDECAR_ADVERTISE_HOST)")
    p.add_argument("--backends", default=_env("BACKENDS", "UCX"),
                   help="comma-separated NIXL backends (env KVSIDECAR_BACKENDS)")
    p.add_argument("--hold-timeout", type=_number(float, "HOLD_TIMEOUT"),
                   default=_env("HOLD_TIMEOUT", "120"),
                   help="seconds an unread hold lives (env KVSIDECAR_HOLD_TIMEOUT)")
    p.add_argument("--notif-grace", type=_number(float, "NOTIF_GRACE"),
                   default=_env("NOTIF_GRACE", "30"),
                   help="seconds a notification waits for its hold (env KVSIDECAR_NOTIF_GRACE)")
    p.add_argument("--handshake-timeout", type=_number(float, "HANDSHAKE_TIMEOUT"),
                   default=_env("HANDSHAKE_TIMEOUT", "5"),
                   help="seconds to wait for a peer's handshake (env KVSIDECAR_HANDSHAKE_TIMEOUT)")
    p.add_argument("--read-timeout", type=_number(float, "READ_TIMEOUT"),
                   default=_env("READ_TIMEOUT", "60"),
                   help="seconds a posted read may take before it is cancelled and fails "
                        "(env KVSIDECAR_READ_TIMEOUT)")
    p.add_argument("--engine-lease", type=_number(float, "ENGINE_LEASE"),
                   default=_env("ENGINE_LEASE", "30"),
                   help="an engine that sends no request (a poll is enough) for this many "
                        "seconds is taken for dead and released (env KVSIDECAR_ENGINE_LEASE)")
    p.add_argument("--hold-lease", type=_number(float, "HOLD_LEASE"),
                   default=_env("HOLD_LEASE", "10"),
                   help="seconds each claim or renewal by a reader keeps a hold alive; readers "
                        "renew every third of it while they read (env KVSIDECAR_HOLD_LEASE)")
    p.add_argument("--hold-max-life", type=_number(float, "HOLD_MAX_LIFE"),
                   default=_env("HOLD_MAX_LIFE", "600"),
                   help="seconds after which no renewal keeps a hold alive any more, whatever "
                        "its readers do (a hold with a longer timeout_s keeps that) "
                        "(env KVSIDECAR_HOLD_MAX_LIFE)")
    p.add_argument("--drain-timeout", type=_number(float, "DRAIN_TIMEOUT"),
                   default=_env("DRAIN_TIMEOUT", "30"),
                   help="on SIGTERM, seconds open holds may still be read before the sidecar "
                        "drops them and exits; 0 = at once (env KVSIDECAR_DRAIN_TIMEOUT)")
    p.add_argument("--max-reads-per-engine", type=_number(int, "MAX_READS_PER_ENGINE"),
                   default=_env("MAX_READS_PER_ENGINE", "4096"),
                   help="reads one engine rank may have in flight (env "
                        "KVSIDECAR_MAX_READS_PER_ENGINE)")
    p.add_argument("--max-holds-per-engine", type=_number(int, "MAX_HOLDS_PER_ENGINE"),
                   default=_env("MAX_HOLDS_PER_ENGINE", "65536"),
                   help="holds one engine rank may have open (env KVSIDECAR_MAX_HOLDS_PER_ENGINE)")
    p.add_argument("--max-completions-per-engine", type=_number(int, "MAX_COMPLETIONS_PER_ENGINE"),
                   default=_env("MAX_COMPLETIONS_PER_ENGINE", "65536"),
                   help="reads + holds + unpolled completions of one engine rank (env "
                        "KVSIDECAR_MAX_COMPLETIONS_PER_ENGINE)")
    p.add_argument("--max-early-notifications", type=_number(int, "MAX_EARLY_NOTIFICATIONS"),
                   default=_env("MAX_EARLY_NOTIFICATIONS", "4096"),
                   help="requests of one engine rank with notifications waiting for their "
                        "hold (env KVSIDECAR_MAX_EARLY_NOTIFICATIONS)")
    p.add_argument("--max-peer-links-per-engine",
                   type=_number(int, "MAX_PEER_LINKS_PER_ENGINE"),
                   default=_env("MAX_PEER_LINKS_PER_ENGINE", "1024"),
                   help="remote ranks one engine rank keeps linked (NIXL remote agents); "
                        "idle ones are evicted first (env KVSIDECAR_MAX_PEER_LINKS_PER_ENGINE)")
    p.add_argument("--max-engines", type=_number(int, "MAX_ENGINES"),
                   default=_env("MAX_ENGINES", "64"),
                   help="engines registered here at once, each with its own NIXL agent "
                        "(env KVSIDECAR_MAX_ENGINES)")
    p.add_argument("--metrics-port", type=_number(int, "METRICS_PORT"),
                   default=_env("METRICS_PORT", "-1"),
                   help="Prometheus /metrics port, -1 = off, 0 = ephemeral "
                        "(env KVSIDECAR_METRICS_PORT)")
    p.add_argument("--metrics-host", default=_env("METRICS_HOST", "127.0.0.1"),
                   help="address the metrics endpoint binds (env KVSIDECAR_METRICS_HOST)")
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"),
                   help="DEBUG, INFO, WARNING, ERROR (env KVSIDECAR_LOG_LEVEL)")
    p.add_argument("--log-format", default=_env("LOG_FORMAT", "text"),
                   help="text, or json: one object per line with request_id/engine/peer/rank "
                        "fields (env KVSIDECAR_LOG_FORMAT)")
    p.add_argument("--otlp-endpoint", default=_env("OTLP_ENDPOINT", ""),
                   help="send OpenTelemetry traces over OTLP/HTTP to this URL, e.g. "
                        "http://collector:4318/v1/traces (needs kvsidecar[otel]; "
                        "env KVSIDECAR_OTLP_ENDPOINT)")
    p.add_argument("--transport-check", default=_env("TRANSPORT_CHECK", "require-zero-copy"),
                   help="start-up loopback READ that proves the data path: "
                        "require-zero-copy (tcp stops the sidecar, exit 2), allow-tcp, off "
                        "(env KVSIDECAR_TRANSPORT_CHECK)")
    p.add_argument("--cuda-attach", default=_env("CUDA_ATTACH", "warn"),
                   help="engine-allocated GPU memory (attach mode with CUDA IPC handles): "
                        "warn (served with a warning unless the VRAM transport check failed), "
                        "serve, refuse (env KVSIDECAR_CUDA_ATTACH)")
    p.add_argument("--health-timeout", type=_number(float, "HEALTH_TIMEOUT"),
                   default=_env("HEALTH_TIMEOUT", "10"),
                   help="seconds the event loop or a NIXL worker thread may be silent before "
                        "/healthz fails (env KVSIDECAR_HEALTH_TIMEOUT)")
    p.add_argument("--allow-uid", default=_env("ALLOW_UID", ""),
                   help="comma-separated users (names or uids) besides the sidecar's own that "
                        "may use the engine socket (env KVSIDECAR_ALLOW_UID)")
    p.add_argument("--allow-gid", default=_env("ALLOW_GID", ""),
                   help="comma-separated groups (names or gids) whose members may use the "
                        "engine socket (env KVSIDECAR_ALLOW_GID)")
    p.add_argument("--max-message-bytes", type=_number(int, "MAX_MESSAGE_BYTES"),
                   default=_env("MAX_MESSAGE_BYTES", str(16 << 20)),
                   help="largest engine message; a larger one gets a bad_message reply "
                        "and is counted, one over twice this drops the connection "
                        "(env KVSIDECAR_MAX_MESSAGE_BYTES)")
    p.add_argument("--max-engine-connections", type=_number(int, "MAX_ENGINE_CONNECTIONS"),
                   default=_env("MAX_ENGINE_CONNECTIONS", "256"),
                   help="engine socket connections kept; more are shut "
                        "(env KVSIDECAR_MAX_ENGINE_CONNECTIONS)")
    p.add_argument("--max-assembling-bytes", type=_number(int, "MAX_ASSEMBLING_BYTES"),
                   default=_env("MAX_ASSEMBLING_BYTES", "0"),
                   help="bytes the long engine messages being received may announce "
                        "together; past it a header gets `unavailable` and its connection "
                        "is closed (0, the default: 8x --max-message-bytes; at least 2x "
                        "--max-message-bytes) (env KVSIDECAR_MAX_ASSEMBLING_BYTES)")
    p.add_argument("--long-message-timeout", type=_number(float, "LONG_MESSAGE_TIMEOUT"),
                   default=_env("LONG_MESSAGE_TIMEOUT", "30"),
                   help="seconds a long engine message may take to arrive whole after its "
                        "header; then one bad_message reply and the connection is closed "
                        "(env KVSIDECAR_LONG_MESSAGE_TIMEOUT)")
    p.add_argument("--engine-idle-timeout", type=_number(float, "ENGINE_IDLE_TIMEOUT"),
                   default=_env("ENGINE_IDLE_TIMEOUT", "60"),
                   help="seconds an engine socket connection that never registered may stay "
                        "silent before it is closed (clients reconnect on their next call); "
                        "at --max-engine-connections one idle over 1 s is closed for a new "
                        "one (env KVSIDECAR_ENGINE_IDLE_TIMEOUT)")
    p.add_argument("--peer-keys", default=_env("PEER_KEYS", os.environ.get(
                       "CREDENTIALS_DIRECTORY", "")),
                   help="directory with the fleet's CURVE key (sidecar.key_secret, from "
                        "`kvsidecar keys DIR`) and optional authorized/*.key (env "
                        "KVSIDECAR_PEER_KEYS; default $CREDENTIALS_DIRECTORY, systemd's "
                        "LoadCredential=)")
    p.add_argument("--insecure-peers", action="store_true",
                   default=_env("INSECURE_PEERS", "") not in ("", "0", "false"),
                   help="DEVELOPMENT ONLY: no authentication on the handshake port; anyone who "
                        "reaches it can read and write registered KV memory "
                        "(env KVSIDECAR_INSECURE_PEERS=1)")
    p.add_argument("--allow-unsealed-shm", action="store_true",
                   default=_env("ALLOW_UNSEALED_SHM", "") not in ("", "0", "false"),
                   help="serve POSIX shared memory regions (attach mode, memory=shm); they "
                        "cannot be sealed, so an engine that truncates one kills this "
                        "sidecar (SIGBUS) when a peer reads it: trusted engines only. Off: "
                        "such registrations are refused; memfd is sealed and always "
                        "served (env KVSIDECAR_ALLOW_UNSEALED_SHM=1)")
    p.add_argument("--staging", default=_env("STAGING", "off"),
                   help="D side, host memory only: read whole remote runs into staging memory "
                        "and scatter locally when the cost model says it beats posting "
                        "scattered descriptors and the runs carry at most 25%% more bytes "
                        "than the read wants: off (default: auto maps --staging-bytes per host "
                        "engine rank at registration), auto (faster on the hetero demo "
                        "shapes), always (env KVSIDECAR_STAGING)")
    p.add_argument("--staging-bytes", type=_number(int, "STAGING_BYTES"),
                   default=_env("STAGING_BYTES", str(256 << 20)),
                   help="staging memory per engine rank, mapped and registered in the "
                        "background when the engine rank registers; a read that finds no "
                        "room posts scattered descriptors (env KVSIDECAR_STAGING_BYTES)")
    p.add_argument("--post-during-claim", type=_number(float, "POST_DURING_CLAIM"),
                   default=_env("POST_DURING_CLAIM", "2"),
                   help="D side: post a read's transfers while its lease claim is still on its "
                        "way to P when P granted a claim over the same links within this many "
                        "seconds (default 2; the notification waits for the grant; a refusal "
                        "fails the read, or re-links and retries it, once its transfers end); "
                        "0 claims first, always (env KVSIDECAR_POST_DURING_CLAIM)")
    p.add_argument("--post-lanes", type=_number(int, "POST_LANES"),
                   default=_env("POST_LANES", "1"),
                   help="D side: NIXL agents per engine rank, each owned by its own worker "
                        "thread, the engine's memory registered in each; a read from several "
                        "P ranks posts P rank i on lane i mod N, a read of 16 MiB or more from "
                        "one P rank is cut into a part per lane, so their copies run in "
                        "parallel (1..8, default 1; env KVSIDECAR_POST_LANES)")
    p.add_argument("--notif-batch-reads", type=_number(int, "NOTIF_BATCH_READS"),
                   default=_env("NOTIF_BATCH_READS", "64"),
                   help="P side: advertise that a reader may merge up to this many reads it "
                        "posts together into one NIXL transfer carrying one notification "
                        "naming them all (a failed transfer fails each read in it); 0 asks "
                        "for one transfer and notification per read, 0..64 "
                        "(env KVSIDECAR_NOTIF_BATCH_READS)")
    p.add_argument("--verify-bytes", action="store_true",
                   default=_env("VERIFY_BYTES", "") not in ("", "0", "false"),
                   help="D side: verify every read's bytes: P's sidecar digests the pieces the "
                        "read's plan takes from it, this sidecar what landed, and a read whose "
                        "bytes differ fails (host memory only; a read may also ask alone, "
                        "read(verify=True)) (env KVSIDECAR_VERIFY_BYTES=1)")
    p.add_argument("--max-peer-connections", type=_number(int, "MAX_PEER_CONNECTIONS"),
                   default=_env("MAX_PEER_CONNECTIONS", "1024"),
                   help="handshake port connections kept; more are shut "
                        "(env KVSIDECAR_MAX_PEER_CONNECTIONS)")


def from_args(ns: argparse.Namespace) -> Settings:
    if not _DEVICE.match(ns.device):
        raise ConfigError(f"--device (env KVSIDECAR_DEVICE) must be cpu or cuda:N, "
                          f"got {ns.device!r}")
    backends = tuple(b.strip() for b in ns.backends.split(",") if b.strip())
    if not backends:
        raise ConfigError("--backends (env KVSIDECAR_BACKENDS) names no backend; e.g. UCX")
    for name in ("hold_timeout", "notif_grace", "handshake_timeout", "read_timeout",
                 "engine_lease", "health_timeout", "hold_lease", "hold_max_life",
                 "engine_idle_timeout"):
        value = getattr(ns, name)
        if not math.isfinite(value) or value <= 0 or value > MAX_SECONDS:
            raise ConfigError(f"--{name.replace('_', '-')} (env KVSIDECAR_{name.upper()}) must "
                              f"be a finite number of seconds in (0, {MAX_SECONDS:g}], "
                              f"got {value}")
    if not math.isfinite(ns.drain_timeout) or not 0 <= ns.drain_timeout <= MAX_SECONDS:
        raise ConfigError(f"--drain-timeout (env KVSIDECAR_DRAIN_TIMEOUT) must be a finite "
                          f"number of seconds in [0, {MAX_SECONDS:g}], got {ns.drain_timeout}")
    for name in ("max_message_bytes", "max_engine_connections", "max_peer_connections"):
        if getattr(ns, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} (env KVSIDECAR_{name.upper()}) must "
                              f"be > 0, got {getattr(ns, name)}")
    if ns.max_assembling_bytes and not (
            2 * ns.max_message_bytes <= ns.max_assembling_bytes):
        raise ConfigError(f"--max-assembling-bytes (env KVSIDECAR_MAX_ASSEMBLING_BYTES) must be "
                          f"0 (8x --max-message-bytes) or at least 2x --max-message-bytes "
                          f"({2 * ns.max_message_bytes}), got {ns.max_assembling_bytes}")
    if not 0 < ns.long_message_timeout <= 3600:
        raise ConfigError(f"--long-message-timeout (env KVSIDECAR_LONG_MESSAGE_TIMEOUT) must be "
                          f"0..3600 seconds (not 0), got {ns.long_message_timeout}")
    for flag, port in (("handshake-port", ns.handshake_port), ("metrics-port", ns.metrics_port)):
        if not -1 <= port <= 65535 or (flag == "handshake-port" and port < 0):
            env = "KVSIDECAR_" + flag.upper().replace("-", "_")
            raise ConfigError(f"--{flag} (env {env}) must be a port 0..65535"
                              f"{' or -1 (off)' if flag == 'metrics-port' else ''}, got {port}")
    if ns.log_level.upper() not in _LOG_LEVELS:
        raise ConfigError(f"--log-level (env KVSIDECAR_LOG_LEVEL) must be one of "
                          f"{', '.join(_LOG_LEVELS)}, got {ns.log_level!r}")
    if ns.log_format not in ("text", "json"):
        raise ConfigError(f"--log-format (env KVSIDECAR_LOG_FORMAT) must be text or json, "
                          f"got {ns.log_format!r}")
    if ns.transport_check not in _CHECK_MODES:
        raise ConfigError(f"--transport-check (env KVSIDECAR_TRANSPORT_CHECK) must be one of "
                          f"{', '.join(_CHECK_MODES)}, got {ns.transport_check!r}")
    if ns.cuda_attach not in ("serve", "warn", "refuse"):
        raise ConfigError(f"--cuda-attach (env KVSIDECAR_CUDA_ATTACH) must be one of serve, "
                          f"warn, refuse, got {ns.cuda_attach!r}")
    for name in ("max_reads_per_engine", "max_holds_per_engine", "max_completions_per_engine",
                 "max_early_notifications", "max_peer_links_per_engine", "max_engines"):
        if getattr(ns, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} (env KVSIDECAR_{name.upper()}) must "
                              f"be >= 1, got {getattr(ns, name)}")
    if ns.staging not in ("off", "auto", "always"):
        raise ConfigError(f"--staging (env KVSIDECAR_STAGING) must be one of off, auto, "
                          f"always, got {ns.staging!r}")
    if not 0 <= ns.post_during_claim <= 3600:
        raise ConfigError(f"--post-during-claim (env KVSIDECAR_POST_DURING_CLAIM) must be "
                          f"0..3600 seconds, got {ns.post_during_claim}")
    if not 0 <= ns.notif_batch_reads <= 64:
        raise ConfigError(f"--notif-batch-reads (env KVSIDECAR_NOTIF_BATCH_READS) must be "
                          f"0..64, got {ns.notif_batch_reads}")
    if not 1 <= ns.post_lanes <= MAX_POST_LANES:
        raise ConfigError(f"--post-lanes (env KVSIDECAR_POST_LANES) must be "
                          f"1..{MAX_POST_LANES}, got {ns.post_lanes}")
    if ns.verify_bytes and ns.device.startswith("cuda"):
        from kvsidecar.daemon.digest import DigestUnavailable, digester_for

        try:
            digester_for("VRAM")
        except DigestUnavailable as e:
            raise ConfigError(f"--verify-bytes with --device {ns.device}: {e}") from None
    if ns.staging_bytes < 0:
        raise ConfigError(f"--staging-bytes (env KVSIDECAR_STAGING_BYTES) must be >= 0, "
                          f"got {ns.staging_bytes}")
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
        hold_lease_s=ns.hold_lease,
        hold_max_life_s=ns.hold_max_life,
        drain_timeout_s=ns.drain_timeout,
        max_reads_per_engine=ns.max_reads_per_engine,
        max_holds_per_engine=ns.max_holds_per_engine,
        max_completions_per_engine=ns.max_completions_per_engine,
        max_early_notifications=ns.max_early_notifications,
        max_peer_links_per_engine=ns.max_peer_links_per_engine,
        max_engines=ns.max_engines,
        metrics_port=ns.metrics_port,
        metrics_host=ns.metrics_host,
        log_level=ns.log_level.upper(),
        allow_uids=_ids(ns.allow_uid, "uid"),
        allow_gids=_ids(ns.allow_gid, "gid"),
        max_message_bytes=ns.max_message_bytes,
        max_engine_connections=ns.max_engine_connections,
        max_peer_connections=ns.max_peer_connections,
        max_assembling_bytes=ns.max_assembling_bytes,
        long_message_timeout_s=ns.long_message_timeout,
        engine_idle_timeout_s=ns.engine_idle_timeout,
        transport_check=ns.transport_check,
        health_timeout_s=ns.health_timeout,
        log_format=ns.log_format,
        otlp_endpoint=ns.otlp_endpoint,
        peer_keys=ns.peer_keys,
        insecure_peers=ns.insecure_peers,
        allow_unsealed_shm=ns.allow_unsealed_shm,
        cuda_attach=ns.cuda_attach,
        staging=ns.staging,
        staging_bytes=ns.staging_bytes,
        post_during_claim_s=ns.post_during_claim,
        notif_batch_reads=ns.notif_batch_reads,
        post_lanes=ns.post_lanes,
        verify_bytes=ns.verify_bytes,
    )
