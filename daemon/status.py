"""The answer to an engine-socket ``Status`` request (``kvsidecar status``).

Pure functions from the sidecar's state to :class:`~kvsidecar.ipc.protocol.StatusReport`
parts; the Sidecar's handler gathers the state and calls them on the event loop
(no I/O, nothing awaited, so the snapshot is consistent).

Who sees what: engine ranks are listed for the uid that registered them, for
the sidecar's own uid and for root (both could read the engines' memory
anyway); another allowed user sees the sidecar's own facts and only its own
engines.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from kvsidecar.daemon.engine_access import PeerCred
from kvsidecar.daemon.engines.rank import EngineRank
from kvsidecar.daemon.health import Check
from kvsidecar.daemon.transport.check import CheckResult
from kvsidecar.ipc.protocol import MAX_STATUS_PEERS, EngineStatus, PeerStatus, StatusCheck

__all__ = ["checks_of", "engine_status", "sees", "transport_of"]


def sees(asker: PeerCred | None, eng: EngineRank) -> bool:
    """Whether ``asker`` may see ``eng`` in a status report (None: in-process, unknown)."""
    return (asker is None or eng.uid is None or asker.uid in (0, os.geteuid())
            or asker.uid == eng.uid)


def engine_status(eng: EngineRank, reads: int, oldest_read_s: float, now: float) -> EngineStatus:
    """One engine rank: its reads (counted by the read table), holds and linked
    peers (the most recently used first, at most MAX_STATUS_PEERS of them)."""
    links = eng.peers.linked()
    peers = [PeerStatus(address=p.key[0], engine_id=p.key[1], tp_rank=p.key[2],
                        version=p.info.sidecar_version, reads=users)
             for p, users in reversed(links[-MAX_STATUS_PEERS:])]
    return EngineStatus(
        engine_id=eng.engine_id, tp_rank=eng.tp_rank, tp_size=eng.layout.tp_size, pid=eng.pid,
        lanes=len(eng.lanes), reads=reads, oldest_read_s=round(oldest_read_s, 3),
        holds=len(eng.holds), oldest_hold_s=round(eng.holds.oldest_age(now), 3),
        queued=len(eng.completions), peers_linked=len(links), peers=peers)


def transport_of(mode: str, host: CheckResult | None, vram: CheckResult | None,
                 gpu: bool) -> tuple[str, str]:
    """(the path reads take, a detail line) from the start-up self-check(s):
    ``off`` when disabled, ``checking`` while the check runs, else the path it
    found (``cma``, ``shm``, ``rdma``, ``tcp``...), ``failed`` appended when the
    mode does not accept it."""
    if mode == "off":
        return "off", "--transport-check off"
    if host is None:
        return "checking", "the start-up loopback READ is running"
    path = host.path if host.passed else f"{host.path} (failed)"
    detail = host.detail
    if gpu:
        path += (", vram checking" if vram is None else
                 f", vram {vram.path}" + ("" if vram.passed else " (failed)"))
    return path, detail


def checks_of(checks: Iterable[Check]) -> list[StatusCheck]:
    return [StatusCheck(c.name, c.ok, c.detail) for c in checks]
