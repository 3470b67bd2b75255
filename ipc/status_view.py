"""A :class:`~kvsidecar.ipc.protocol.StatusReport` for people (``kvsidecar status``)
and for scripts (``--json``). Pure functions: the command line does the asking."""

from __future__ import annotations

import json

import msgspec

from .protocol import EngineStatus, StatusReport

__all__ = ["as_json", "render"]


def as_json(report: StatusReport) -> str:
    """The report's fields as one JSON object (the wire's names; no request id)."""
    fields = msgspec.to_builtins(report)
    fields.pop("id", None)
    fields.pop("op", None)
    return json.dumps(fields, indent=2)


def _age(seconds: float, count: int) -> str:
    if not count:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


#: the longest peer version shown (it comes from the peer's handshake: any length)
MAX_VERSION_CHARS = 40


def _shown(text: str, limit: int = 0) -> str:
    """``text`` as a table cell: control characters (a terminal's escape
    sequences, from a peer's handshake or an engine's id) escaped, and cut to
    ``limit`` characters when given."""
    out = text if text.isprintable() else "".join(
        c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return out if not limit or len(out) <= limit else out[:limit - 1] + "\u2026"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    rows = [[_shown(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]


def _engine_row(e: EngineStatus) -> list[str]:
    return [e.engine_id, f"{e.tp_rank}/{e.tp_size}", str(e.pid), str(e.lanes), str(e.reads),
            _age(e.oldest_read_s, e.reads), str(e.holds), _age(e.oldest_hold_s, e.holds),
            str(e.queued), str(e.peers_linked)]


def render(r: StatusReport) -> str:
    """A few lines: who and whether ready (failed checks named), the totals, a
    table of engine ranks and one of linked peers."""
    state = "draining" if r.draining else "ready" if r.ready else "NOT READY"
    lines = [f"kvsidecar {r.version}  daemon {r.daemon_id}  up {_age(r.uptime_s, 1)}  {state}",
             f"engines on {r.socket}, handshakes on {r.handshake_address}, "
             f"transport {r.transport}"]
    lines += [f"  failed check {c.name}: {c.detail}" for c in r.checks if not c.ok]
    reads = sum(e.reads for e in r.engines)
    holds = sum(e.holds for e in r.engines)
    oldest_read = max((e.oldest_read_s for e in r.engines), default=0.0)
    oldest_hold = max((e.oldest_hold_s for e in r.engines), default=0.0)
    peers = sum(e.peers_linked for e in r.engines)
    lines.append(f"{len(r.engines)} engine rank(s); {reads} read(s) in flight (oldest "
                 f"{_age(oldest_read, reads)}); {holds} hold(s) open (oldest "
                 f"{_age(oldest_hold, holds)}); {peers} peer link(s)")
    if r.engines_draining:
        lines.append(f"{r.engines_draining} ended engine(s) draining their holds "
                     f"({r.drain_bytes} B kept for them)")
    if r.engines:
        lines.append("")
        lines += _table(["ENGINE", "RANK", "PID", "LANES", "READS", "OLDEST", "HOLDS",
                         "OLDEST", "QUEUED", "PEERS"], [_engine_row(e) for e in r.engines])
    links = [[f"{e.engine_id}/{e.tp_rank}", p.address, p.engine_id, str(p.tp_rank),
              _shown(p.version, MAX_VERSION_CHARS) or "?", str(p.reads)]
             for e in r.engines for p in e.peers]
    if links:
        lines.append("")
        lines += _table(["LINKED FROM", "PEER ADDRESS", "PEER ENGINE", "RANK", "VERSION",
                         "READS"], links)
    return "\n".join(lines)
