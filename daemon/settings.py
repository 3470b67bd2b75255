"""Sidecar settings: the ``kvsidecar serve`` flags of :mod:`kvsidecar.daemon.options`,
each with its ``KVSIDECAR_*`` environment default, parsed and checked into a
:class:`Settings`.

Environment variables exist for systemd units and Kubernetes pods, where one
template serves every GPU; flags win over the environment. A bad value is a
:class:`ConfigError` naming the flag and its variable (the CLI prints it as one
line and exits 2); a value that is not a number fails in argparse already.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvsidecar.daemon.addresses import WILDCARDS, bracket, routable_address
from kvsidecar.daemon.options import (
    OPTIONS,
    SECTIONS,
    Convert,
    Option,
    csv,
    switch,
    switch_words,
)
from kvsidecar.ipc.socket_path import default_socket


@dataclass(frozen=True)
class Settings:
    """One field per option of :data:`~kvsidecar.daemon.options.OPTIONS` (its flag,
    variable, meaning and accepted values are there); the defaults are the
    table's, as tests/unit/test_options.py proves."""

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
    drain_timeout_s: float = 30.0
    max_reads_per_engine: int = 4096
    max_holds_per_engine: int = 65536
    max_completions_per_engine: int = 65536
    max_early_notifications: int = 4096
    max_peer_links_per_engine: int = 1024
    max_engines: int = 64
    metrics_port: int = -1
    metrics_host: str = "127.0.0.1"
    log_level: str = "INFO"
    allow_uids: tuple[int, ...] = ()
    allow_gids: tuple[int, ...] = ()
    max_message_bytes: int = 16 << 20
    max_engine_connections: int = 256
    max_engine_connections_per_uid: int = 64
    max_peer_connections: int = 1024
    max_assembling_bytes: int = 0
    long_message_timeout_s: float = 30.0
    engine_idle_timeout_s: float = 60.0
    transport_check: str = "require-zero-copy"
    health_timeout_s: float = 10.0
    log_format: str = "text"
    otlp_endpoint: str = ""
    peer_keys: str = ""
    insecure_peers: bool = False
    allow_unsealed_shm: bool = False
    cuda_attach: str = "warn"
    staging: str = "off"
    staging_bytes: int = 256 << 20
    cpu_policy: str = "batch"
    post_during_claim_s: float = 2.0
    notif_batch_reads: int = 64
    post_lanes: int = 1
    nixl_progress_thread_ms: int = 0
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


class ConfigError(ValueError):
    """A bad flag or KVSIDECAR_* value; the CLI prints it as one line and exits 2."""


# -- argparse, generated from the table --------------------------------------------------------

def _env_default(opt: Option) -> str:
    """The flag's default as text: its variable, else the fallback variable, else the table's."""
    text = ("1" if opt.default else "") if opt.kind == "switch" else str(opt.default)
    if opt.env_fallback:
        text = os.environ.get(opt.env_fallback, text)
    return os.environ.get(opt.env, text)


def _number(kind: type[int] | type[float], env: str) -> Callable[[str], int | float]:
    """An argparse ``type`` that names the flag's environment variable when the
    value (typed on the command line or taken from the environment) is bad."""
    def parse(text: str) -> int | float:
        try:
            return kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(
                f"must be {what} (flag or env {env}), got {text!r}") from None
    parse.__name__ = kind.__name__
    return parse


_NUMBERS: dict[str, type[int] | type[float]] = {"int": int, "float": float}


def _switch_value(env: str) -> Callable[[str], bool]:
    """The argparse ``type`` of a switch: parses its variable's text (argparse
    runs a string default through it when the flag is not given)."""
    def parse(text: str) -> bool:
        on = switch(text)
        if on is None:
            raise argparse.ArgumentTypeError(
                f"must be {switch_words()} (env {env}), got {text!r}")
        return on
    parse.__name__ = "switch"
    return parse


class _Switch(argparse.Action):
    """``store_true`` whose default is its variable's text, parsed strictly by
    ``type`` (a bad value is a usage error naming the variable)."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True)


def _help(opt: Option) -> str:
    env = f"{opt.env}=1" if opt.kind == "switch" else opt.env
    default = opt.shown_default().replace("`", "")
    return f"{opt.help} (env {env}; default {default})".replace("%", "%%")


def _metavar(opt: Option) -> str | None:
    if opt.choices:
        return "{" + ",".join(opt.choices) + "}"
    return "SECONDS" if opt.field.endswith("_s") else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per option, grouped by section, each defaulting to its variable."""
    groups = {title: p.add_argument_group(title) for title in SECTIONS}
    for opt in OPTIONS:
        group = groups[opt.section]
        if opt.kind == "switch":
            group.add_argument(opt.flag, action=_Switch, help=_help(opt),
                               default=_env_default(opt), type=_switch_value(opt.env))
            continue
        typed: dict[str, Any] = {}
        if opt.kind in _NUMBERS:
            typed["type"] = _number(_NUMBERS[opt.kind], opt.env)
        group.add_argument(opt.flag, default=_env_default(opt), help=_help(opt),
                           metavar=_metavar(opt), **typed)


# -- from parsed flags to Settings ------------------------------------------------------------

def _ids(text: str, opt: Option) -> tuple[int, ...]:
    """``"1000,1001"`` -> (1000, 1001); names are resolved by the system's user/group db."""
    import grp
    import pwd

    what = "uid" if opt.convert == "uids" else "gid"
    out = []
    for item in csv(text):
        if item.isdigit():
            out.append(int(item))
            continue
        try:
            out.append(pwd.getpwnam(item).pw_uid if what == "uid" else grp.getgrnam(item).gr_gid)
        except KeyError:
            raise ConfigError(f"{opt.flag} (env {opt.env}): no such {what} {item!r}") from None
    return tuple(out)


_CONVERT: dict[Convert, Callable[[Any, Option], Any]] = {
    "as-is": lambda v, _: v,
    "csv": lambda v, _: csv(v),
    "upper": lambda v, _: v.upper(),
    "uids": _ids,
    "gids": _ids,
}


def _check_together(ns: argparse.Namespace) -> None:
    """The checks that involve two options."""
    if ns.max_assembling_bytes and not (
            2 * ns.max_message_bytes <= ns.max_assembling_bytes):
        raise ConfigError(f"--max-assembling-bytes (env KVSIDECAR_MAX_ASSEMBLING_BYTES) must be "
                          f"0 (8x --max-message-bytes) or at least 2x --max-message-bytes "
                          f"({2 * ns.max_message_bytes}), got {ns.max_assembling_bytes}")
    if ns.verify_bytes and ns.device.startswith("cuda"):
        from kvsidecar.daemon.digest import DigestUnavailable, digester_for

        try:
            digester_for("VRAM")
        except DigestUnavailable as e:
            raise ConfigError(f"--verify-bytes with --device {ns.device}: {e}") from None


def from_args(ns: argparse.Namespace) -> Settings:
    """Check every option (in table order), then the pairs, then build Settings."""
    for opt in OPTIONS:
        complaint = opt.complaint(getattr(ns, opt.dest))
        if complaint is not None:
            raise ConfigError(f"{opt.flag} (env {opt.env}) {complaint}")
    _check_together(ns)
    values = {opt.field: _CONVERT[opt.convert](getattr(ns, opt.dest), opt) for opt in OPTIONS}
    # One absolute, normalised path for every consumer (the directory checks, the
    # READY line, the shm prefix): ``a/new/../x.sock`` must be checked as ``a``.
    values["socket"] = os.path.abspath(ns.socket or default_socket(ns.device))
    return Settings(**values)
