"""Everything ``kvsidecar serve`` can refuse, checked before it starts anything.

:func:`preflight` runs after the settings parsed and before any thread, server,
NIXL import or GPU context exists, so a refused process has nothing to keep it
alive: it prints one line and exits 2 within a second or so of its start, with
metrics on or off. Each check raises :class:`Refusal`, whose message names the
problem and the fix. The checks are the start-up's own conditions, tried without
side effects (a lock taken and let go, a port bound and closed); the start-up
still handles each of them, for the rare race between the check and the start.

Checks, in order: peer keys; the address peers dial; the transport the
``--transport-check`` mode demands (as far as ``UCX_TLS`` decides it; the
measured loopback READ runs after start-up and gates ``/readyz``); the GPU of
``--device cuda:N``; the handshake and metrics listeners (host and port); the engine socket (its
path, its directory, which is created as the start-up would, and whether
another sidecar holds it); last, the ``--backends`` against the NIXL plugins
installed (the one check that imports NIXL, about a second, which the start-up
pays anyway: so it runs after every cheap one).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat

from kvsidecar.daemon.settings import Settings

__all__ = ["Refusal", "preflight", "zero_copy_excluded"]

#: The longest unix socket path (sun_path less its terminating NUL).
_UNIX_PATH_MAX = 107
#: UCX_TLS names that carry no zero-copy read between processes.
_NOT_ZERO_COPY = frozenset({"tcp", "self", "cuda_copy", "rocm_copy"})


class Refusal(Exception):
    """A start-up refusal: the message is the one line to print; the exit status is 2."""


def preflight(s: Settings) -> None:
    """Raise :class:`Refusal` for the first thing that would make ``serve`` refuse."""
    for check in (_peer_keys, _advertised, _transport, _device, _ports, _socket, _backends):
        check(s)


def _peer_keys(s: Settings) -> None:
    if s.insecure_peers:
        return
    if not s.peer_keys:  # no flag, no variable, no systemd credentials
        raise Refusal("no peer key: pass --peer-keys DIR (env KVSIDECAR_PEER_KEYS), a directory "
                      "made once with `kvsidecar keys DIR` and shared by the sidecars that read "
                      "from each other (or --insecure-peers, for development only)")
    from kvsidecar.daemon.peer_auth import load_keys

    try:
        load_keys(s.peer_keys)
    except (ValueError, OSError) as e:
        raise Refusal(f"{e} (or --insecure-peers, for development only)") from None


def _advertised(s: Settings) -> None:
    try:
        s.advertised  # noqa: B018 - raises SystemExit when no address can be found
    except SystemExit as e:
        raise Refusal(str(e.code).removeprefix("kvsidecar: ")) from None


def zero_copy_excluded(ucx_tls: str | None) -> bool:
    """True when ``UCX_TLS`` lists transports and none of them reads another
    process's memory without a socket in between (e.g. ``tcp`` or ``tcp,self``)."""
    if not ucx_tls or ucx_tls.startswith("^"):
        return False
    names = {t.strip().split(":")[0] for t in ucx_tls.split(",") if t.strip()}
    return bool(names) and names <= _NOT_ZERO_COPY


def _transport(s: Settings) -> None:
    tls = os.environ.get("UCX_TLS")
    if s.transport_check == "require-zero-copy" and zero_copy_excluded(tls):
        raise Refusal(f"--transport-check require-zero-copy, but UCX_TLS={tls} allows no "
                      "zero-copy transport; add cma (host memory) or cuda_ipc/rc (GPU) to "
                      "UCX_TLS, unset it, or pass --transport-check allow-tcp")


def _socket(s: Settings) -> None:
    """The socket's directory is usable and no other sidecar holds the socket."""
    from kvsidecar.daemon.engine_access import (
        AccessPolicy,
        SocketInUse,
        lock_socket,
        prepare_socket_dir,
        unlock_socket,
    )

    path = s.socket
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise Refusal(f"--socket {path} is longer than {_UNIX_PATH_MAX} bytes (a unix socket "
                      "limit); pass a shorter path")
    access = AccessPolicy.of(s.allow_uids, s.allow_gids)
    try:
        # Creates a missing directory (0700) as the start-up would; changes nothing else.
        prepare_socket_dir(os.path.dirname(path) or ".", shared=access.shared, group=access.group,
                           uids=access.other_uids)
    except OSError as e:  # not ours, not a directory, a read-only file system...
        raise Refusal(f"cannot serve {path}: {e}") from None
    try:
        fd = lock_socket(path)
    except SocketInUse:
        raise Refusal(f"another sidecar is serving {path} (it holds {path}.lock); stop it "
                      "or pass another --socket") from None
    except OSError as e:
        raise Refusal(f"cannot serve {path}: {path}.lock: {e.strerror}; pass a --socket in "
                      "a directory the sidecar owns") from None
    unlock_socket(path, fd)  # the start-up takes it for good
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise Refusal(f"{path} exists and is not a socket; remove it or pass another "
                          "--socket")


def _backends(s: Settings) -> None:
    """Every ``--backends`` name is a NIXL plugin this installation has (else every
    engine's registration would fail creating its agent, long after READY)."""
    from kvsidecar.daemon.transport.agent_host import available_plugins

    try:
        available = available_plugins()
    except Exception as e:  # NIXL itself unusable: say so, whatever it raised
        raise Refusal(f"cannot list NIXL's backend plugins: {type(e).__name__}: {e}; is "
                      "NIXL installed (pip install kvsidecar) and NIXL_PLUGIN_DIR right?"
                      ) from None
    unknown = [b for b in s.backends if b not in available]
    if unknown:
        raise Refusal(f"--backends (env KVSIDECAR_BACKENDS): no NIXL plugin "
                      f"{', '.join(unknown)} here; available: {', '.join(available) or 'none'}"
                      "; pass some of these (names are case-sensitive), e.g. UCX")


def _ports(s: Settings) -> None:
    """The handshake and metrics listeners can bind: the host is one of this
    machine's addresses (or a wildcard) and a fixed port is free."""
    wanted = [("handshake", s.handshake_host, s.handshake_port)]
    if s.metrics_port >= 0:
        wanted.append(("metrics", s.metrics_host, s.metrics_port))
    for what, host, port in wanted:
        bind_host = "" if host in ("*", "") else host.strip("[]")
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((bind_host, port))
            except OSError as e:
                why = e.strerror or str(e)
                if e.errno == errno.EADDRINUSE:
                    raise Refusal(f"--{what}-port {port} on {host or '*'}: {why}; stop what "
                                  f"holds it or pass another --{what}-port (0: any free "
                                  "port)") from None
                raise Refusal(f"--{what}-host {host}: {why}; pass an address of this host, "
                              "or 0.0.0.0 for all") from None


def _device(s: Settings) -> None:
    """``cuda:N``: the binding, the driver and GPU N are there (no context is made)."""
    if not s.device.startswith("cuda:"):
        return
    from kvsidecar.ipc import cuda

    try:
        cuda.device_uuid(int(s.device.split(":", 1)[1]))
    except cuda.CudaError as e:
        fix = "" if "pip install" in str(e) else (
            "; pass a GPU this process can see (CUDA_VISIBLE_DEVICES) or --device cpu")
        raise Refusal(f"--device {s.device}: {e}{fix}") from None
