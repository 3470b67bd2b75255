"""The sidecar's options, one table: each ``kvsidecar serve`` flag, its
``KVSIDECAR_*`` environment variable, its default, what it means and what it
accepts.

Everything else is generated from :data:`OPTIONS`: the argparse flags and their
``--help`` (``daemon/settings.py``), the environment variables read as each
flag's default, the :class:`~kvsidecar.daemon.settings.Settings` values (and a
unit test proves its field defaults agree with this table), and the table in
``docs/configuration.md`` (``daemon/options_doc.py``).

Pure: no I/O, nothing read from the environment here. A check takes the value
as parsed from the flag or variable and returns what is wrong with it (``None``:
nothing); ``settings.from_args`` words it as ``--flag (env NAME) <complaint>``.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

#: How the text of a flag or variable is parsed (a switch: given, or its variable
#: one of :data:`SWITCH_ON`; :data:`SWITCH_OFF` is off, anything else an error).
Kind = Literal["str", "int", "float", "switch"]
#: How a parsed value becomes its Settings value (ids: names resolved by the
#: system's user and group database, in settings.py).
Convert = Literal["as-is", "csv", "upper", "uids", "gids"]
#: The complaint about a parsed value, or None when it is fine.
Check = Callable[[Any], str | None]

MAX_SECONDS: Final = 86400.0
"""Upper bound of every duration setting: a typo of extra zeros fails at start-up."""
MAX_POST_LANES: Final = 8
"""Each lane is a NIXL agent, a thread and a registration of the engine's memory."""
MAX_PROGRESS_MS: Final = 100
"""Longest guard wake-up of NIXL's progress thread: a wake-up UCX misses stalls a
peer's read that long, and the 0.2 s drain before an agent is destroyed must see
at least one."""
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR")
#: Same values as kvsidecar.daemon.transport.check.MODES (options import nothing heavy).
CHECK_MODES: Final = ("require-zero-copy", "allow-tcp", "off")
DEVICE: Final = re.compile(r"^(cpu|cuda:\d+)$")
ENV_PREFIX: Final = "KVSIDECAR_"
#: A switch's variable, any case: these turn it on, these off, anything else is refused.
SWITCH_ON: Final = ("1", "true", "yes", "on")
SWITCH_OFF: Final = ("", "0", "false", "no", "off")


# Sections: the groups of ``--help`` and of the docs table, in this order.
ADDRESSES: Final = "Device, sockets and addresses"
SECURITY: Final = "Who may connect, and what is served"
TIMES: Final = "Timeouts and leases"
LIMITS: Final = "Limits"
DATA_PATH: Final = "Data path"
OBSERVE: Final = "Logs, metrics and traces"
SECTIONS: Final = (ADDRESSES, SECURITY, TIMES, LIMITS, DATA_PATH, OBSERVE)


@dataclass(frozen=True)
class Option:
    """One ``kvsidecar serve`` flag."""

    flag: str
    #: the Settings field it fills
    field: str
    #: the parsed default (what the flag's text parses to), before ``convert``
    default: str | int | float | bool
    help: str
    section: str
    kind: Kind = "str"
    convert: Convert = "as-is"
    check: Check | None = None
    #: the accepted values, for help and docs (``check`` enforces them)
    choices: tuple[str, ...] = ()
    #: the default in words, where the value alone would not say it
    shown: str = ""
    #: another variable read when the ``KVSIDECAR_*`` one is unset
    env_fallback: str = ""

    @property
    def env(self) -> str:
        """The variable the flag names: ``--hold-timeout`` -> ``KVSIDECAR_HOLD_TIMEOUT``."""
        return ENV_PREFIX + self.dest.upper()

    @property
    def dest(self) -> str:
        """The argparse attribute: ``--hold-timeout`` -> ``hold_timeout``."""
        return self.flag.removeprefix("--").replace("-", "_")

    def shown_default(self) -> str:
        """The default as docs show it (Markdown: values in backticks)."""
        if self.shown:
            return self.shown
        if self.kind == "switch":
            return "on" if self.default else "off"
        if self.default == "":
            return "none"
        text = f"{self.default:g}" if isinstance(self.default, float) else str(self.default)
        unit = " s" if self.field.endswith("_s") else ""
        mib = 1 << 20
        if isinstance(self.default, int) and self.default >= mib and not self.default % mib:
            unit = f" ({self.default // mib} MiB)"
        return f"`{text}`{unit}"

    def complaint(self, value: Any) -> str | None:
        """What is wrong with a parsed value of this option, if anything."""
        return None if self.check is None else self.check(value)


# -- checks -----------------------------------------------------------------------------------

def seconds(*, zero: bool = False) -> Check:
    """A finite duration in (0, MAX_SECONDS], or [0, MAX_SECONDS] with ``zero``."""
    span = f"{'[' if zero else '('}0, {MAX_SECONDS:g}]"

    def check(v: float) -> str | None:
        ok = math.isfinite(v) and (v >= 0 if zero else v > 0) and v <= MAX_SECONDS
        return None if ok else f"must be a finite number of seconds in {span}, got {v}"
    return check


def within(lo: int, hi: int, *, unit: str = "", above_lo: bool = False) -> Check:
    """``lo..hi`` (``above_lo``: not ``lo`` itself)."""
    words = f"{lo}..{hi}{' ' + unit if unit else ''}{f' (not {lo})' if above_lo else ''}"

    def check(v: float) -> str | None:
        ok = (lo < v if above_lo else lo <= v) and v <= hi
        return None if ok else f"must be {words}, got {v}"
    return check


def at_least(lo: int) -> Check:
    def check(v: int) -> str | None:
        return None if v >= lo else f"must be >= {lo}, got {v}"
    return check


def positive(v: int) -> str | None:
    return None if v > 0 else f"must be > 0, got {v}"


def port(*, off: bool = False) -> Check:
    """A TCP port 0..65535 (0: any free one), or -1 (off) with ``off``."""
    def check(v: int) -> str | None:
        ok = (-1 if off else 0) <= v <= 65535
        return None if ok else f"must be a port 0..65535{' or -1 (off)' if off else ''}, got {v}"
    return check


def one_of(choices: tuple[str, ...], *, any_case: bool = False) -> Check:
    words = " or ".join(choices) if len(choices) == 2 else "one of " + ", ".join(choices)

    def check(v: str) -> str | None:
        ok = (v.upper() if any_case else v) in choices
        return None if ok else f"must be {words}, got {v!r}"
    return check


def device(v: str) -> str | None:
    return None if DEVICE.match(v) else f"must be cpu or cuda:N, got {v!r}"


def switch(text: str) -> bool | None:
    """A switch variable's value: True for :data:`SWITCH_ON`, False for
    :data:`SWITCH_OFF` (any case, surrounding blanks ignored), None for anything
    else (``maybe`` must not turn off peer authentication, nor ``off`` turn it on)."""
    word = text.strip().lower()
    return True if word in SWITCH_ON else False if word in SWITCH_OFF else None


def switch_words() -> str:
    """The accepted values of a switch variable, for messages and docs."""
    return f"{'/'.join(SWITCH_ON)} (on) or empty/{'/'.join(SWITCH_OFF[1:])} (off), any case"


_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def host(v: str) -> str | None:
    """Empty, an IPv4/IPv6 address (IPv6 bracketed or not) or a DNS host name."""
    if not v:
        return None
    try:
        ipaddress.ip_address(v[1:-1] if v.startswith("[") and v.endswith("]") else v)
        return None
    except ValueError:
        pass
    name = v.removesuffix(".")
    if len(name) <= 253 and all(_LABEL.match(label) for label in name.split(".")):
        return None
    return f"must be a host name or an IP address, got {v!r}"


def csv(text: str) -> tuple[str, ...]:
    """``"UCX, GDS"`` -> ("UCX", "GDS"); empty items dropped."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


def some_backend(v: str) -> str | None:
    return None if csv(v) else "names no backend; e.g. UCX"


# -- the table --------------------------------------------------------------------------------

def _limit(flag: str, default: int, help: str, check: Check) -> Option:
    return Option(flag, flag.removeprefix("--").replace("-", "_"), default, help, LIMITS,
                  kind="int", check=check)


def _duration(flag: str, field: str, default: float, help: str, *, zero: bool = False) -> Option:
    return Option(flag, field, default, help, TIMES, kind="float", check=seconds(zero=zero))


OPTIONS: Final[tuple[Option, ...]] = (
    # -- addresses
    Option("--device", "device", "cpu", "cpu or cuda:N: the device whose memory this sidecar "
           "serves (one sidecar per GPU); names the default socket", ADDRESSES, check=device),
    Option("--socket", "socket", "", "engine IPC socket path; its directory must be the "
           "sidecar's own", ADDRESSES,
           shown="`$RUNTIME_DIRECTORY/<device>.sock` (systemd), else "
                 "`$XDG_RUNTIME_DIR/kvsidecar/<device>.sock`, else "
                 "`/tmp/kvsidecar-<uid>/<device>.sock` (`cuda:0` is `cuda0.sock`)"),
    Option("--handshake-host", "handshake_host", "127.0.0.1", "address the handshake server "
           "(peer sidecars dial it) binds; 0.0.0.0 for all", ADDRESSES),
    Option("--handshake-port", "handshake_port", 0, "handshake TCP port", ADDRESSES,
           kind="int", check=port(), shown="`0` (any free port)"),
    Option("--advertise-host", "advertise_host", "", "host peers dial, when the bind host is "
           "a wildcard", ADDRESSES, check=host,
           shown="the bind host; for a wildcard, this host's routable address"),
    Option("--backends", "backends", "UCX", "comma-separated NIXL backends (plugins of this "
           "NIXL installation, case-sensitive; checked at start)", ADDRESSES,
           convert="csv", check=some_backend),
    # -- security
    Option("--peer-keys", "peer_keys", "", "directory with the fleet's CURVE key "
           "(sidecar.key_secret, from `kvsidecar keys DIR`) and optional authorized/*.key",
           SECURITY, env_fallback="CREDENTIALS_DIRECTORY",
           shown="`$CREDENTIALS_DIRECTORY` (systemd's `LoadCredential=`)"),
    Option("--insecure-peers", "insecure_peers", False, "DEVELOPMENT ONLY: no authentication "
           "on the handshake port; anyone who reaches it can read and write registered KV "
           "memory", SECURITY, kind="switch"),
    Option("--allow-uid", "allow_uids", "", "comma-separated users (names or uids) besides the "
           "sidecar's own that may use the engine socket", SECURITY, convert="uids",
           shown="the sidecar's own user only"),
    Option("--allow-gid", "allow_gids", "", "comma-separated groups (names or gids) whose "
           "members may use the engine socket", SECURITY, convert="gids"),
    # memfd is sealed; POSIX shm (attach mode, and allocate/reserve with memory='shm') cannot be
    Option("--allow-unsealed-shm", "allow_unsealed_shm", False, "serve POSIX shared memory "
           "regions (attach mode, memory=shm); they cannot be sealed, so an engine that "
           "truncates one kills this sidecar (SIGBUS) when a peer reads it: trusted engines "
           "only. Off: such registrations are refused; memfd is sealed and always served",
           SECURITY, kind="switch"),
    # see ipc/cuda_handles.decide_attach
    Option("--cuda-attach", "cuda_attach", "warn", "engine-allocated GPU memory (attach mode "
           "with CUDA IPC handles): warn (served with a warning unless the VRAM transport check "
           "failed), serve, refuse", SECURITY, choices=("serve", "warn", "refuse"),
           check=one_of(("serve", "warn", "refuse"))),
    # -- timeouts and leases
    _duration("--hold-timeout", "hold_timeout_s", 120.0, "seconds an unread hold lives"),
    _duration("--notif-grace", "notif_grace_s", 30.0,
              "seconds a notification waits for its hold"),
    _duration("--handshake-timeout", "handshake_timeout_s", 5.0,
              "seconds to wait for a peer's handshake"),
    _duration("--read-timeout", "read_timeout_s", 60.0,
              "seconds a posted read may take before it is cancelled and fails"),
    _duration("--engine-lease", "engine_lease_s", 30.0, "an engine that sends no request (a "
              "poll is enough) for this many seconds is taken for dead and released"),
    _duration("--hold-lease", "hold_lease_s", 10.0, "seconds each claim or renewal by a reader "
              "keeps a hold alive; readers renew every third of it while they read"),
    _duration("--hold-max-life", "hold_max_life_s", 600.0, "seconds after which no renewal "
              "keeps a hold alive any more, whatever its readers do (a hold with a longer "
              "timeout_s keeps that)"),
    _duration("--drain-timeout", "drain_timeout_s", 30.0, "on SIGTERM, seconds open holds (of "
              "live engines and of engines that ended) may still be read; then each ends "
              "expired (its engine polls that) once its readers' leases ran out (at most "
              "--hold-lease more), and the sidecar exits; 0 = no wait before that cut", zero=True),
    _duration("--health-timeout", "health_timeout_s", 10.0, "seconds the event loop or a NIXL "
              "worker thread may be silent before /healthz fails"),
    _duration("--engine-idle-timeout", "engine_idle_timeout_s", 60.0, "seconds an engine "
              "socket connection serving no live engine (none registered or reserved over it, "
              "or all since deregistered or dropped) may stay silent before it is closed "
              "(clients reconnect on their next call); at --max-engine-connections one idle "
              "over 1 s is closed for a new one"),
    Option("--long-message-timeout", "long_message_timeout_s", 30.0, "seconds a long engine "
           "message may take to arrive whole after its header; then one bad_message reply and "
           "the connection is closed", TIMES, kind="float",
           check=within(0, 3600, unit="seconds", above_lo=True)),
    # -- limits
    _limit("--max-reads-per-engine", 4096, "reads one engine rank may have in flight",
           at_least(1)),
    _limit("--max-holds-per-engine", 65536, "holds one engine rank may have open", at_least(1)),
    _limit("--max-completions-per-engine", 65536,
           "reads + holds + unpolled completions of one engine rank", at_least(1)),
    _limit("--max-early-notifications", 4096, "requests of one engine rank with notifications "
           "waiting for their hold", at_least(1)),
    _limit("--max-peer-links-per-engine", 1024, "remote ranks one engine rank keeps linked "
           "(NIXL remote agents); idle ones are evicted first", at_least(1)),
    # each engine costs a NIXL agent (a thread, ~16 fds, ~5 MB) and its memory
    _limit("--max-engines", 64, "engines registered here at once, each with its own NIXL "
           "agent (a thread, ~16 fds, ~5 MB); the next gets `unavailable` naming the flag, "
           "counted as kvsidecar_limit_refusals_total{limit=\"engines\"}", at_least(1)),
    _limit("--max-message-bytes", 16 << 20, "largest engine message; a larger one gets a "
           "bad_message reply and is counted, one over twice this drops the connection",
           positive),
    # checked against --max-message-bytes in settings.from_args
    Option("--max-assembling-bytes", "max_assembling_bytes", 0, "bytes the long engine "
           "messages being received may announce together; past it a header gets "
           "`unavailable` and its connection is closed (at least 2x --max-message-bytes)",
           LIMITS, kind="int", shown="`0` (8x `--max-message-bytes`: 128 MiB)"),
    _limit("--max-engine-connections", 256, "engine socket connections kept (fewer when the "
           "fd limit is low); more are shut", positive),
    _limit("--max-engine-connections-per-uid", 64, "engine socket connections one uid may "
           "hold where other uids are allowed in (--allow-uid, --allow-gid; the sidecar's own "
           "uid counts too), and at most three quarters of the socket's total; past it that "
           "uid's idlest is closed or the new one gets "
           "`unavailable` naming the uid, counted as "
           "kvsidecar_refused_total{channel=\"engine\",reason=\"uid_connection_limit\"}; "
           "the fd socket's connections too (48 of its 64 at most; "
           "channel=\"fd\")",
           positive),
    _limit("--max-peer-connections", 1024, "handshake port connections kept (fewer when the "
           "fd limit is low); more are shut", positive),
    # -- data path
    # see daemon/transport/check.py
    Option("--transport-check", "transport_check", "require-zero-copy", "start-up loopback "
           "READ that proves the data path: require-zero-copy (a UCX_TLS listing only tcp/self "
           "is refused at start; a READ that took tcp stops the sidecar, exit 2), allow-tcp "
           "(tcp passes, reported), off", DATA_PATH, choices=CHECK_MODES,
           check=one_of(CHECK_MODES)),
    # the cost model is daemon/staging_plan.py (MAX_WIRE_OVERHEAD: the 25%)
    Option("--staging", "staging", "off", "D side, host memory only: read whole remote runs "
           "into staging memory and scatter locally when the cost model says it beats posting "
           "scattered descriptors and the runs carry at most 25% more bytes than the read "
           "wants: off (auto maps --staging-bytes per host engine rank at registration), auto "
           "(faster on the hetero demo shapes), always", DATA_PATH,
           choices=("off", "auto", "always"), check=one_of(("off", "auto", "always"))),
    Option("--staging-bytes", "staging_bytes", 256 << 20, "staging memory per engine rank, "
           "mapped and registered in the background when the engine rank registers; a read "
           "that finds no room posts scattered descriptors", DATA_PATH, kind="int",
           check=at_least(0)),
    Option("--cpu-policy", "cpu_policy", "batch", "Linux scheduling policy of every "
           "sidecar thread: batch (SCHED_BATCH: a woken sidecar thread never preempts the one "
           "running, the engine's or its own; more reads/s for less CPU, 1-block p50 unchanged "
           "in measurements, docs/performance.md), normal (the kernel's default)", DATA_PATH,
           choices=("batch", "normal"), check=one_of(("batch", "normal"))),
    Option("--post-during-claim", "post_during_claim_s", 2.0, "D side: post a read's transfers "
           "while its lease claim is still on its way to P when P granted a claim over the same "
           "links within this many seconds (the notification waits for the grant; a refusal "
           "fails the read, or re-links and retries it, once its transfers end); 0 claims "
           "first, always", DATA_PATH, kind="float", check=within(0, 3600, unit="seconds")),
    Option("--post-lanes", "post_lanes", 1, "D side: NIXL agents per engine rank, each owned "
           "by its own worker thread, the engine's memory (and staging pool) registered in "
           "each; a read from several P ranks posts P rank i on lane i mod N, a read of 16 MiB "
           "or more from one P rank is cut into a part per lane (not within a read_many batch "
           "of one P engine: each of its reads is posted whole on lane 0), so their copies run "
           "in parallel; lane 0 notifies every rank once all transfers ended; "
           f"1..{MAX_POST_LANES}", DATA_PATH, kind="int",
           check=within(1, MAX_POST_LANES)),
    Option("--nixl-progress-thread-ms", "nixl_progress_thread_ms", 0, "P side mostly: run "
           "NIXL's UCX progress thread in each engine rank's first agent (lane 0), asleep in "
           "poll() until a peer's message arrives, so a peer's READ of this engine's memory "
           "is answered when it comes instead of at this sidecar's next poll, and a granted "
           "lease no longer sets the worker polling every 50 us: lower latency and CPU for a "
           "few reads at a time, more CPU per read under load (a wake-up per message; "
           "docs/performance.md). The value only sets the thread's guard wake-up against a "
           "wake-up UCX misses: larger is fewer idle wake-ups, but a missed one stalls a read "
           f"that long; 10 is a fair choice. 0 = off (the worker thread polls; not NIXL's "
           f"spinning 0); 0..{MAX_PROGRESS_MS}. Not yet run on a GPU",
           DATA_PATH, kind="int", check=within(0, MAX_PROGRESS_MS)),
    Option("--notif-batch-reads", "notif_batch_reads", 64, "P side: advertise that a reader may "
           "merge up to this many reads it posts together into one NIXL transfer carrying one "
           "notification naming them all (a failed transfer fails each read in it); 0 asks for "
           "one transfer and notification per read; 0..64", DATA_PATH, kind="int",
           check=within(0, 64)),
    # checked against --device in settings.from_args (no digest of GPU memory yet)
    Option("--verify-bytes", "verify_bytes", False, "D side: verify every read's bytes: P's "
           "sidecar digests the pieces the read's plan takes from it, this sidecar what landed, "
           "and a read whose bytes differ fails (host memory only: refused at start-up with "
           "--device cuda:N; a read may also ask alone, read(verify=True))", DATA_PATH,
           kind="switch"),
    # -- logs, metrics, traces
    Option("--log-level", "log_level", "INFO", "logging level (any case)", OBSERVE,
           convert="upper", choices=LOG_LEVELS, check=one_of(LOG_LEVELS, any_case=True)),
    Option("--log-format", "log_format", "text", "text, or json: one object per line with "
           "request_id/engine/peer/rank fields", OBSERVE, choices=("text", "json"),
           check=one_of(("text", "json"))),
    Option("--otlp-endpoint", "otlp_endpoint", "", "send OpenTelemetry traces over OTLP/HTTP "
           "to this URL, e.g. http://collector:4318/v1/traces (needs kvsidecar[otel])",
           OBSERVE, shown="none (no tracing at all)"),
    Option("--metrics-port", "metrics_port", -1, "Prometheus /metrics port; 0 = any free port",
           OBSERVE, kind="int", check=port(off=True), shown="`-1` (off)"),
    Option("--metrics-host", "metrics_host", "127.0.0.1", "address the metrics endpoint binds",
           OBSERVE),
)

BY_FIELD: Final = {o.field: o for o in OPTIONS}
