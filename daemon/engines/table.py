"""The table of engine ranks one sidecar serves: registered ones and draining ones.

Pure bookkeeping, no I/O. ``ranks`` maps each registered engine id to its
:class:`~kvsidecar.daemon.engines.rank.EngineRank`; ``drain`` holds the
generations of ended engines still serving open holds
(:mod:`~kvsidecar.daemon.drain`); ``registering`` the registrations in
progress. Lookups answer the questions requests, peers and notifications
ask: the rank a request names (only to the uid that registered it, renewing
its liveness lease), every rank serving an engine id, the rank holding a
request, the handshake of a rank.
"""

from __future__ import annotations

import asyncio
import time

from kvsidecar.daemon.drain import DrainBook
from kvsidecar.daemon.engine_access import current_peer
from kvsidecar.daemon.engines.rank import EngineRank
from kvsidecar.daemon.peers.messages import HandshakeInfo
from kvsidecar.daemon.reservations import Reservation
from kvsidecar.ipc.protocol import (
    RELEASING,
    UNAVAILABLE,
    UNKNOWN_ENGINE,
    Completion,
    Register,
    Reply,
    RequestError,
)


class EngineTable:
    def __init__(self) -> None:
        self.ranks: dict[str, EngineRank] = {}
        #: registrations whose engine ended with holds open, served until they end
        self.drain: DrainBook[EngineRank] = DrainBook()
        #: the reservation each draining generation's regions are views of (if any)
        self.drain_reserved: dict[int, Reservation] = {}
        #: engine id -> (the registration in progress, its reply), so that a
        #: client retrying after a timeout joins the registration it started
        self.registering: dict[str, tuple[Register, asyncio.Future[Reply]]] = {}
        #: engine id -> (the rank being released, why): no longer registered, but
        #: its own reads may still write into its memory (see :meth:`engine`)
        self.releasing: dict[str, tuple[EngineRank, str]] = {}

    def __len__(self) -> int:
        return len(self.ranks)

    def get(self, engine_id: str) -> EngineRank | None:
        """The registered rank of ``engine_id`` (whoever asks)."""
        return self.ranks.get(engine_id)

    def engine(self, engine_id: str) -> EngineRank:
        """The engine a request names; any request renews its liveness lease."""
        eng = self.ranks.get(engine_id)
        if eng is None:
            self.refuse_releasing(engine_id)
        if eng is None or not mine(eng):
            # Neither the other engines' names nor whether another user's engine
            # of that name exists: both are other tenants' business.
            raise RequestError(UNKNOWN_ENGINE,
                               f"engine {engine_id[:200]!r} is not registered here")
        eng.last_seen = time.monotonic()
        return eng

    def refuse_releasing(self, engine_id: str) -> None:
        """Refuse (``unavailable``) a request naming a rank of the asker's that is
        being released: its reads may still write into its memory, so it is
        neither unknown yet nor to be registered again until they ended."""
        going = self.releasing.get(engine_id)
        if going is not None and mine(going[0]):
            raise RequestError(UNAVAILABLE, releasing_reason(engine_id, going[1]))

    def listed(self) -> list[str]:
        """The engine ids a ping lists to the asking uid: registered ones, and ones
        being released (their memory may still be written; only once it cannot
        does an id go unlisted, which an engine takes for "nothing of mine runs")."""
        return sorted({e for e, eng in self.ranks.items() if mine(eng)}
                      | {e for e, (eng, _) in self.releasing.items() if mine(eng)})

    def serving(self) -> list[EngineRank]:
        """Every rank with holds to serve: registered ones, then draining ones."""
        return list(self.ranks.values()) + [g.rank for g in self.drain]

    def ranks_of(self, engine_id: str) -> list[EngineRank]:
        """Every rank object serving ``engine_id``: the registered one first, then
        its draining generations, newest first."""
        current = self.ranks.get(engine_id)
        ranks = [current] if current is not None else []
        return ranks + [g.rank for g in self.drain.of_engine(engine_id)] if len(
            self.drain) else ranks

    def holder(self, engine_id: str, request_id: str) -> EngineRank | None:
        """The rank (registered or draining) whose holds include this request, else
        the registered rank (early notifications and claims wait there)."""
        if not len(self.drain):  # the common case: one lookup per claim or notification
            return self.ranks.get(engine_id)
        for eng in self.ranks_of(engine_id):
            if (engine_id, request_id) in eng.holds:
                return eng
        return self.ranks.get(engine_id)

    def lookup(self, engine_id: str, rank: int) -> HandshakeInfo | None:
        """The registered rank's handshake; while none is registered, the newest
        draining generation's (its holds are still read)."""
        for eng in self.ranks_of(engine_id):
            if eng.tp_rank == rank:
                return eng.info
        return None

    def deliver(self, eng: EngineRank, c: Completion) -> None:
        """Queue a read's completion, if ``eng`` is still the registered rank."""
        current = self.ranks.get(eng.engine_id)
        if current is not None and current is eng:
            current.complete(c)

    def open_holds(self) -> int:
        """Holds open on every rank, registered and draining."""
        return sum(len(e.holds) for e in self.serving())


def releasing_reason(engine_id: str, why: str) -> str:
    """What a request naming a rank being released is told (``unavailable``):
    not yet ``unknown_engine``, which promises that nothing of the registration
    can still touch the engine's memory."""
    return (f"engine {engine_id[:200]!r} {RELEASING} ({why[:200]}): its reads are still "
            "ending and may write into its memory; it is unknown here once they ended")


def mine(eng: EngineRank) -> bool:
    """Whether the engine whose request is being answered may see ``eng``: the
    uid that registered it (anything goes where either side is unknown)."""
    peer = current_peer.get()
    return peer is None or eng.uid is None or peer.uid == eng.uid
