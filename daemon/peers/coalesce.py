"""Which control items travel together: the per-address outbox, without I/O.

D's claims, renewals and abandons for one P sidecar are queued here and
leave as messages of up to ``max_items`` items and ``max_bytes`` bytes.
Coalescing needs no timer, so a lone claim is never held back:

* the first item for an idle address starts a flush (the I/O shell runs it
  on the event loop's next turn, after whatever else this turn queues: the
  claims of one engine ``Batch`` are issued in one turn and leave together);
* while a message to that address is in flight, newer items wait for its
  reply and then leave together as the next message (at most one message
  per address is in flight; the reply's round trip is the only wait).

An item that has waited in the outbox longer than ``max_wait_s`` (messages
ahead of it were slow to answer) is handed back as expired rather than
sent, so no item waits more than that plus its own message's timeout.

The shell (:class:`~kvsidecar.daemon.peers.client.HandshakeClient`) owns
the futures, the sockets and the clock; this module only decides.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["Outbox", "Taken"]

T = TypeVar("T")


@dataclass(frozen=True)
class _Queued(Generic[T]):
    item: T
    size: int
    queued_at: float


@dataclass(frozen=True)
class Taken(Generic[T]):
    """What :meth:`Outbox.take` decided: the next message's items (in order) and
    the items that waited too long to be sent at all."""

    items: list[T]
    expired: list[T]


@dataclass
class Outbox(Generic[T]):
    """The items waiting for one peer address, and whether a flush is under way.

    ``overhead`` is what a message costs besides its items' sizes. An item
    larger than ``max_bytes`` on its own still leaves, alone.
    """

    max_items: int
    max_bytes: int
    overhead: int = 0
    waiting: deque[_Queued[T]] = field(default_factory=deque)
    #: a flush owns this address: it is scheduled, sending, or awaiting a reply
    busy: bool = False

    def __post_init__(self) -> None:
        if self.max_items < 1 or self.max_bytes < 1:
            raise ValueError("an outbox needs max_items >= 1 and max_bytes >= 1")

    def add(self, item: T, size: int, now: float) -> bool:
        """Queue ``item`` (``size`` bytes encoded); True when the caller must start a
        flush (nothing is under way for this address), False when the flush that
        is under way will take it."""
        self.waiting.append(_Queued(item, size, now))
        if self.busy:
            return False
        self.busy = True
        return True

    def take(self, now: float, max_wait_s: float) -> Taken[T]:
        """The next message's items, oldest first, within both bounds; expired
        items are dropped from the queue and returned apart. An empty ``items``
        means the flush is over (``busy`` is False again) and the next
        :meth:`add` starts a new one."""
        items: list[T] = []
        expired: list[T] = []
        total = self.overhead
        while self.waiting:
            head = self.waiting[0]
            if now - head.queued_at > max_wait_s:
                expired.append(self.waiting.popleft().item)
                continue
            if items and (len(items) >= self.max_items or total + head.size > self.max_bytes):
                break
            items.append(self.waiting.popleft().item)
            total += head.size
        if not items:
            self.busy = False
        return Taken(items, expired)

    @property
    def idle(self) -> bool:
        """Nothing waits and no flush is under way: the outbox can be dropped."""
        return not self.busy and not self.waiting
