"""The ``kvsidecar`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvsidecar", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve", help="run one sidecar (not yet available)")
    sub.add_parser("demo", help="P tp1 -> D tp2 transfer demo (not yet available)")
    args = parser.parse_args(argv)
    print(f"kvsidecar {args.cmd}: not yet available", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
