"""Liveness and readiness verdicts for ``/healthz`` and ``/readyz``.

They are answered on the HTTP server's own thread from plain values the
daemon keeps up to date (heartbeat timestamps, flags), so a wedged event loop
or NIXL worker thread is *reported* rather than making the probe hang.

- healthz (liveness: restart me if red): the event loop and every NIXL worker
  thread went round their loops within ``bound_s``.
- readyz (send me traffic): healthz, plus every NIXL agent running, the
  handshake port's socket listening (read from the kernel's socket tables:
  a probe that connected would be a failed peer handshake), the transport
  self-check passed, and the daemon not draining.

The bodies are JSON naming each check and which failed, e.g.
``{"status": "fail", "failed": ["worker:prefill-0"], "checks": {...}}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def heartbeat(name: str, age_s: float, bound_s: float) -> Check:
    if age_s <= bound_s:
        return Check(name, True, f"last beat {age_s:.3f} s ago")
    return Check(name, False, f"no beat for {age_s:.1f} s (bound {bound_s:g} s): wedged")


def verdict(checks: list[Check]) -> tuple[int, bytes]:
    """HTTP status (200 or 503) and JSON body for a list of checks."""
    failed = [c.name for c in checks if not c.ok]
    body = {
        "status": "fail" if failed else "ok",
        "failed": failed,
        "checks": {c.name: {"ok": c.ok, "detail": c.detail} for c in checks},
    }
    return (503 if failed else 200), (json.dumps(body, sort_keys=True) + "\n").encode()
