"""Allocations an engine reserved before it knew its layout (``Reserve``).

vLLM allocates its KV cache as one buffer and derives the layout from it; a
memory pool in the engine (:mod:`kvsidecar.integrations.vllm.pool`) therefore asks the
sidecar for one fixed-size allocation first, carves vLLM's buffer from it,
and then registers ``reserved`` views into it. The sidecar registers its own
memory: nothing is imported, nothing re-exported (the GPU case needs that).

One owner: this table holds each reservation until its engine's registration
ends; one never registered goes with a ``Deregister`` of its engine id, the
sidecar's shutdown, or :meth:`Reservations.stale` after the engine lease (an
engine that died between reserving and registering). Bounded: at most
``limit`` reservations per sidecar, those being allocated counted with those
held (:meth:`Reservations.book`), so Reserves pipelined on one connection,
each allocating off the event loop, cannot each find the same room.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from kvsidecar.ipc.protocol import DUPLICATE, UNAVAILABLE, RequestError
from kvsidecar.ipc.regions import Region

__all__ = ["MAX_RESERVATIONS", "Reservation", "Reservations"]

MAX_RESERVATIONS = 64


@dataclass
class Reservation:
    engine_id: str
    uid: int | None
    memory: str
    region: Region
    fd_token: str = ""
    #: monotonic time of the Reserve (or its last retry)
    at: float = field(default_factory=time.monotonic)


class Reservations:
    def __init__(self, limit: int = MAX_RESERVATIONS,
                 on_limit: Callable[[str], None] | None = None) -> None:
        self.limit = limit
        #: told the engine id of each request refused at the limit (a metric)
        self._on_limit = on_limit
        self._by_engine: dict[str, Reservation] = {}
        #: engine ids whose reservation is being allocated (room booked for each)
        self._booked: set[str] = set()

    def __len__(self) -> int:
        return len(self._by_engine)

    @property
    def booked(self) -> int:
        """Reservations being allocated now (counted against the limit)."""
        return len(self._booked)

    def check_room(self, engine_id: str, uid: int | None, nbytes: int,
                   memory: str) -> Reservation | None:
        """The same reservation again (a retry: returned), or room for a new one
        (None); otherwise a RequestError naming why not. Reservations being
        allocated (:meth:`book`) take room as held ones do."""
        old = self._by_engine.get(engine_id)
        if old is not None:
            if old.uid == uid and old.memory == memory and old.region.nbytes == nbytes:
                old.at = time.monotonic()
                return old
            raise RequestError(DUPLICATE, f"engine {engine_id[:200]!r} already has a "
                                          "reservation (deregister the engine id to drop it)")
        if engine_id in self._booked:
            raise RequestError(DUPLICATE, f"engine {engine_id[:200]!r} is being reserved")
        if len(self._by_engine) + len(self._booked) >= self.limit:
            if self._on_limit is not None:
                self._on_limit(engine_id)
            raise RequestError(UNAVAILABLE, (
                f"this sidecar holds {self.limit} reservations already (the limit; "
                f"{len(self._booked)} of them being allocated): register or deregister them"))
        return None

    def book(self, engine_id: str) -> None:
        """Take room for ``engine_id``'s reservation, which :meth:`check_room` just
        allowed, before its allocation is awaited; :meth:`add` or :meth:`unbook`
        gives it back."""
        self._booked.add(engine_id)

    def unbook(self, engine_id: str) -> None:
        """Give back a booking whose allocation failed (no-op after :meth:`add`)."""
        self._booked.discard(engine_id)

    def add(self, r: Reservation) -> None:
        self._booked.discard(r.engine_id)
        self._by_engine[r.engine_id] = r

    def of(self, engine_id: str, uid: int | None) -> Reservation | None:
        """The engine's reservation, only for the uid that made it."""
        r = self._by_engine.get(engine_id)
        if r is None or (r.uid is not None and uid is not None and r.uid != uid):
            return None
        return r

    def pop(self, engine_id: str) -> Reservation | None:
        return self._by_engine.pop(engine_id, None)

    def engine_ids(self) -> list[str]:
        return list(self._by_engine)

    def stale(self, now: float, lease_s: float, registered: Collection[str]) -> list[str]:
        """Engine ids whose reservation is older than ``lease_s`` with no registration
        (``registered``: the engines registered or registering now)."""
        return [e for e, r in self._by_engine.items()
                if e not in registered and now - r.at > lease_s]
