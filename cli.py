"""The ``kvsidecar`` command line: ``serve`` runs one sidecar, ``demo`` shows it working.

It lives above ``daemon`` and ``sim`` so that the daemon package never imports
the simulated engines the demo needs.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from kvsidecar.daemon import settings as settings_mod


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line naming the flag (and its env variable), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="kvsidecar", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_serve = sub.add_parser(
        "serve", help="run one sidecar (one per GPU)",
        description="Run one sidecar. Every flag has a KVSIDECAR_* environment default.",
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
    args = parser.parse_args(argv)
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

        try:
            s = settings_mod.from_args(args)
        except settings_mod.ConfigError as e:
            p_serve.error(str(e))
        return serve(s)
    from kvsidecar.sim.demo import run_demo

    return int(run_demo(requests=args.requests, layers=args.layers, p_tp=args.p_tp,
                        d_tp=args.d_tp))


if __name__ == "__main__":
    sys.exit(main())
