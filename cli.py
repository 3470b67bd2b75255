"""The ``kvsidecar`` command line: ``serve`` runs one sidecar, ``demo`` shows it working,
``keys`` makes the fleet's peer key, ``status`` shows a running sidecar's state.

It lives above ``daemon`` and ``sim`` so that the daemon package never imports
the simulated engines the demo needs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from kvsidecar import __version__
from kvsidecar.daemon import settings as settings_mod
from kvsidecar.daemon.options import BY_FIELD
from kvsidecar.ipc.socket_path import default_socket

_DESCRIPTION = ("kvsidecar: a per-GPU KV-cache transfer daemon for disaggregated LLM "
                "inference. Run one `kvsidecar serve` per GPU; engines (e.g. vLLM's "
                "KvSidecarConnector) send it their reads and holds. `kvsidecar <command> "
                "--help` describes each command.")
_SOCKET_ENV = BY_FIELD["socket"].env
_DEVICE = BY_FIELD["device"]


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line naming the flag (and its env variable), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="kvsidecar", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"kvsidecar {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_serve = sub.add_parser(
        "serve", help="run one sidecar (one per GPU)",
        description="Run one sidecar. Every flag has a KVSIDECAR_* environment default; a "
                    "flag wins over its variable (docs/configuration.md has the table).",
    )
    settings_mod.add_arguments(p_serve)
    p_demo = sub.add_parser("demo", help="move hybrid attention+Mamba2 KV from P tp1 to D tp2 "
                                         "through real sidecars and check every byte")
    p_demo.add_argument("--requests", type=int, default=12)
    p_demo.add_argument("--layers", type=int, default=4)
    p_demo.add_argument("--p-tp", type=int, default=1)
    p_demo.add_argument("--d-tp", type=int, default=2)
    p_keys = sub.add_parser("keys", help="create a sidecar's CURVE keypair for the peer channel",
                            description="Write DIR/sidecar.key_secret (mode 0600), "
                                        "DIR/sidecar.key and an empty DIR/authorized/. Member "
                                        "keys: run it once per sidecar (--peer-keys DIR) and "
                                        "copy every member's sidecar.key into each member's "
                                        "DIR/authorized/<member>.key. A shared fleet key (no "
                                        "member identity): give every sidecar the same DIR.")
    p_keys.add_argument("dir")
    p_status = sub.add_parser(
        "status", help="show a running sidecar's engines, reads, holds, peers and readiness",
        description="Ask a running sidecar over its engine socket (as an allowed user). "
                    "Exit status: 0 ready, 1 answered but not ready (or draining), 2 no "
                    "answer.")
    p_status.add_argument("--socket", default=os.environ.get(_SOCKET_ENV, ""),
                          help=f"the sidecar's engine socket (env {_SOCKET_ENV}; default: "
                               f"serve's default for {_DEVICE.env}, else the only "
                               "socket in that folder)")
    p_status.add_argument("--json", action="store_true", help="one JSON object")
    p_status.add_argument("--timeout", type=float, default=5.0,
                          help="seconds to wait for the answer (default 5)")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named after the command they were given to, as argparse does not
        sub.choices[args.cmd].error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.cmd == "status":
        return _status(args.socket or _default_status_socket(), args.json, args.timeout)
    if args.cmd == "keys":
        from kvsidecar.daemon.peer_auth import generate_keys

        try:
            print(generate_keys(args.dir))
        except FileExistsError as e:
            print(f"kvsidecar: {e}", file=sys.stderr)
            return 2
        return 0
    if args.cmd == "serve":
        from kvsidecar.daemon.main import serve
        from kvsidecar.daemon.preflight import Refusal, preflight

        try:
            s = settings_mod.from_args(args)
        except settings_mod.ConfigError as e:
            p_serve.error(str(e))
        try:
            preflight(s)  # before any server or agent (a bare NIXL agent lists the
            # plugins, last): a refusal exits at once
        except Refusal as e:
            print(f"kvsidecar: {e}", file=sys.stderr, flush=True)
            return 2
        return serve(s)
    from kvsidecar.sim.demo import run_demo

    return int(run_demo(requests=args.requests, layers=args.layers, p_tp=args.p_tp,
                        d_tp=args.d_tp))


def _default_status_socket() -> str:
    """serve's default socket for KVSIDECAR_DEVICE; when nothing is there and its
    folder holds exactly one socket, that one: a sidecar whose ``--device`` was a
    flag (as a container's arguments pass it, which the image's HEALTHCHECK
    cannot see) is found all the same. Two or more: none is guessed."""
    path = default_socket(os.environ.get(_DEVICE.env, str(_DEVICE.default)))
    if os.path.exists(path):
        return path
    folder = os.path.dirname(path)
    try:
        socks = [n for n in os.listdir(folder) if n.endswith(".sock")]
    except OSError:
        return path
    return os.path.join(folder, socks[0]) if len(socks) == 1 else path


def _status(socket: str, as_json: bool, timeout_s: float) -> int:
    from kvsidecar.ipc.client import SidecarClient, SidecarError
    from kvsidecar.ipc.status_view import as_json as to_json
    from kvsidecar.ipc.status_view import render

    if not os.path.exists(socket):  # the client would wait for it to appear
        print(f"kvsidecar: no socket at {socket}: is `kvsidecar serve --socket {socket}` "
              f"running? (--socket, env {_SOCKET_ENV})", file=sys.stderr)
        return 2
    try:
        with SidecarClient(socket, timeout_s=timeout_s) as client:
            report = client.status()
    except (OSError, SidecarError) as e:
        print(f"kvsidecar: no status from {socket}: {e} (is `kvsidecar serve --socket "
              f"{socket}` running, and may this user use it?)", file=sys.stderr)
        return 2
    print(to_json(report) if as_json else render(report))
    return 0 if report.ready and not report.draining else 1


if __name__ == "__main__":
    sys.exit(main())
