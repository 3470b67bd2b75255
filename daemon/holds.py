"""P side: blocks held for readers, counted down by their notifications.

A hold for ``readers`` engines completes (``sent``) once that many distinct
reading engines have each delivered every notification the sharding rule
makes them send to this rank (``D_tp / P_tp`` when D is wider, else 1), or
expires after its timeout. Notifications may arrive before the engine calls
``hold`` (asynchronous scheduling); they wait in a grace buffer and complete
the hold the moment it is placed. Notifications nobody claims are counted and
logged, never fatal.

Pure bookkeeping driven by the caller's clock, so it is tested without
sockets or timers: the daemon feeds it notifications and calls
:meth:`HoldBook.expire` periodically.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvsidecar.daemon.notifications import ReadDone
from kvsidecar.daemon.planner import expected_notifications

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (engine_id, request_id)


@dataclass
class _Hold:
    engine_id: str
    request_id: str
    p_tp: int
    readers: int
    deadline: float
    # reading engine -> set of its ranks that have notified
    seen: dict[str, set[int]] = field(default_factory=dict)
    done_engines: set[str] = field(default_factory=set)


@dataclass
class _Early:
    arrived: float
    notes: list[ReadDone]


@dataclass(frozen=True)
class HoldOutcome:
    engine_id: str
    request_id: str
    kind: Literal["sent", "expired", "aborted"]
    reason: str = ""


class HoldBook:
    """All holds of one sidecar, keyed by (engine id, request id)."""

    def __init__(self, *, default_timeout_s: float, grace_s: float,
                 on_done: Callable[[HoldOutcome], None]) -> None:
        self.default_timeout_s = default_timeout_s
        self.grace_s = grace_s
        self._on_done = on_done
        self._holds: dict[Key, _Hold] = {}
        self._early: dict[Key, _Early] = {}
        self.unclaimed = 0
        self.duplicates = 0

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, key: Key) -> bool:
        return key in self._holds

    def add(self, engine_id: str, request_id: str, p_tp: int, readers: int,
            timeout_s: float | None, now: float) -> None:
        key = (engine_id, request_id)
        if key in self._holds:
            raise KeyError(f"request {request_id!r} is already held for engine {engine_id!r}")
        h = _Hold(engine_id, request_id, p_tp, readers,
                  now + (timeout_s if timeout_s is not None else self.default_timeout_s))
        self._holds[key] = h
        early = self._early.pop(key, None)
        if early:
            for note in early.notes:
                self._count(h, note)
            self._maybe_done(key, h)

    def release(self, engine_id: str, request_id: str) -> bool:
        h = self._holds.pop((engine_id, request_id), None)
        if h is None:
            return False
        self._on_done(HoldOutcome(engine_id, request_id, "aborted", "released by the engine"))
        return True

    def drop_engine(self, engine_id: str) -> int:
        """Forget every hold of an engine that went away (no completions: nobody polls)."""
        keys = [k for k in self._holds if k[0] == engine_id]
        for k in keys:
            del self._holds[k]
        for k in [k for k in self._early if k[0] == engine_id]:
            del self._early[k]
        return len(keys)

    def notify(self, note: ReadDone, now: float) -> None:
        key = (note.target_engine, note.request_id)
        h = self._holds.get(key)
        if h is None:
            early = self._early.setdefault(key, _Early(now, []))
            early.notes.append(note)
            return
        self._count(h, note)
        self._maybe_done(key, h)

    def expire(self, now: float) -> None:
        for key, h in list(self._holds.items()):
            if now >= h.deadline:
                del self._holds[key]
                got = {e: len(r) for e, r in h.seen.items()}
                self._on_done(HoldOutcome(
                    h.engine_id, h.request_id, "expired",
                    f"{len(h.done_engines)} of {h.readers} reading engines finished before the "
                    f"timeout (notifications per engine: {got or 'none'})",
                ))
        for key, e in list(self._early.items()):
            if now - e.arrived >= self.grace_s:
                del self._early[key]
                self.unclaimed += len(e.notes)
                log.warning("%d notification(s) for request %r of engine %r were never claimed "
                            "by a hold", len(e.notes), key[1], key[0])

    def _count(self, h: _Hold, note: ReadDone) -> None:
        ranks = h.seen.setdefault(note.reader_engine, set())
        if note.reader_rank in ranks:
            self.duplicates += 1
            log.warning("duplicate notification for %r from %r rank %d", h.request_id,
                        note.reader_engine, note.reader_rank)
            return
        ranks.add(note.reader_rank)
        try:
            want = expected_notifications(h.p_tp, note.reader_tp)
        except ValueError:
            want = 1
        if len(ranks) >= want:
            h.done_engines.add(note.reader_engine)

    def _maybe_done(self, key: Key, h: _Hold) -> None:
        if len(h.done_engines) >= h.readers:
            del self._holds[key]
            self._on_done(HoldOutcome(h.engine_id, h.request_id, "sent"))
