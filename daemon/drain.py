"""Draining: engine registrations whose engine ended while holds were open.

A prefill engine that exits, dies (its pid proven gone; an engine released by
its lease alone may only be frozen, so its holds end with it) or deregisters
with ``drain`` after placing holds does not take its KV with it: the sidecar
allocated (or mapped) that memory and registered it with NIXL, so it can keep
serving the open holds (handshakes, claims, reads, notifications) until each
ends as it would have (``sent``, ``aborted``, ``expired``), then free
everything. Each such
registration is a *generation*: an engine that registers again with the same
id meanwhile gets a new registration (new memory, new agent), and the old
generation's memory stays until its own holds end.

This module is the pure part: which generations drain, what each kept, how
its holds ended, and when its memory may be freed (:meth:`DrainBook.may_free`:
once nothing of the engine's own reads can still write into it *and* no hold
is open). Clock-injected like :class:`~kvsidecar.daemon.holds.HoldBook`; the
daemon (engines/departures.py, p_side/) does the I/O: it moves the rank
here, routes peers' claims and notifications to it, and releases its memory
when told it may.

Which memory can be kept (:func:`keepable`): what the sidecar allocated
(allocate mode, reservations) and attached host shared memory (the sidecar
holds its own mapping, valid after the engine exits or unlinks the name).
Engine-allocated GPU memory (``cuda_ipc`` attach) is not: the driver frees it
with the process that allocated it, so those holds end at once as before.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

R = TypeVar("R")

#: Region kinds an attach-mode registration may be kept with (see :func:`keepable`).
KEEPABLE_ATTACHED: frozenset[str] = frozenset({"shm", "reserved"})


def keepable(owned: bool, attached_kinds: frozenset[str]) -> bool:
    """Whether a registration's memory stays valid after its engine process is gone:
    memory the sidecar allocated (``owned``), or attached regions all of kinds the
    sidecar keeps mapped itself (:data:`KEEPABLE_ATTACHED`)."""
    return owned or (bool(attached_kinds) and attached_kinds <= KEEPABLE_ATTACHED)


@dataclass
class Generation(Generic[R]):
    """One drained registration of an engine rank; ``rank`` is the daemon's object."""

    engine_id: str
    number: int
    rank: R
    why: str
    started: float
    nbytes: int
    #: the engine's own reads are over (nothing of them can still write into its memory)
    quiet: bool = False
    #: its memory is being freed (set once, by may_free)
    freeing: bool = False
    #: hold outcomes after the engine ended: sent, aborted, expired (and dropped: cut short)
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)

    def summary(self, now: float) -> str:
        """The log line's body: how its holds ended and how long it drained."""
        counts = ", ".join(f"{k} {self.outcomes[k]}"
                           for k in ("sent", "aborted", "expired", "dropped")
                           if self.outcomes[k]) or "no holds ended"
        return (f"engine {self.engine_id!r} generation {self.number} drained in "
                f"{now - self.started:.1f} s ({self.why}): {counts}; {self.nbytes} B freed")


class DrainBook(Generic[R]):
    """Every generation draining on one sidecar, keyed by its number."""

    def __init__(self) -> None:
        self._gens: dict[int, Generation[R]] = {}
        self._next = 1

    def __len__(self) -> int:
        return len(self._gens)

    def __iter__(self) -> Iterator[Generation[R]]:
        return iter(list(self._gens.values()))

    @property
    def nbytes(self) -> int:
        """Bytes kept for engines that ended (memory still mapped and registered)."""
        return sum(g.nbytes for g in self._gens.values())

    def start(self, engine_id: str, rank: R, why: str, nbytes: int, now: float) -> Generation[R]:
        """``rank``'s engine ended with holds open: keep it until they end."""
        g = Generation(engine_id, self._next, rank, why, now, nbytes)
        self._next += 1
        self._gens[g.number] = g
        return g

    def of_engine(self, engine_id: str) -> list[Generation[R]]:
        """The draining generations of ``engine_id``, newest first."""
        return sorted((g for g in self._gens.values() if g.engine_id == engine_id),
                      key=lambda g: -g.number)

    def ended(self, g: Generation[R], kind: str) -> None:
        """One of ``g``'s holds ended (``sent``, ``aborted``, ``expired``)."""
        g.outcomes[kind] += 1

    def may_free(self, g: Generation[R], open_holds: int) -> bool:
        """True exactly once: when ``g``'s reads are over and its last hold ended.
        The caller then frees its memory and calls :meth:`finish`."""
        if g.freeing or not g.quiet or open_holds > 0 or g.number not in self._gens:
            return False
        g.freeing = True
        return True

    def finish(self, g: Generation[R]) -> None:
        """``g``'s memory is freed: forget it."""
        self._gens.pop(g.number, None)
