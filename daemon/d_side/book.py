"""D side: one read's life as a pure state machine (no asyncio, no I/O).

::

    ACCEPTED ─link─▶ LINKING ─linked─▶ PLANNING ─posted─▶ POSTED
        ▲                │                 │                 │
        └──── retry ─────┴─────────────────┴─────────────────┤
                                                             ▼
          every live state ─end─▶ RECEIVED | FAILED | ABORTED

* ``link``: the read's task took its first step (handshakes, links).
* ``linked``: every candidate P rank's link is made; claims and planning start.
* ``posted``: its transfers went to the worker; renewals run until
  ``post time + timeout`` (:attr:`ReadBook.renew_until`, the read's deadline:
  the worker times its transfers out there, which fails the attempt as
  :attr:`Failure.TIMEOUT`, never retried).
* ``transfers_ended``: every transfer's outcome is known; the book says whether
  the read stands, failed whole, or failed partially (:class:`Transfers`).
* ``notified``: its notifications went out (with DONE transfers, or after the
  claim was granted); P ends its holds ``sent`` so nothing is abandoned after.
* ``abort``: before posting the driver cancels at once (:attr:`AbortAction.CANCEL`);
  once posted it waits for every transfer and reports ``aborted`` then.
* ``retry``: a failed attempt that a fresh handshake may cure starts again
  from ``ACCEPTED``; the policy (what is retried, how often) is
  :meth:`ReadBook.retry`, the only place it lives.
* ``end``: the read's one completion (kind and reason from :meth:`ReadBook.end`).

An event a state does not accept raises :class:`IllegalEvent`: the driver
reports events in the order the read lives them, so one out of order is a bug.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Literal


class ReadState(enum.Enum):
    ACCEPTED = "accepted"
    LINKING = "linking"
    PLANNING = "planning"
    POSTED = "posted"
    RECEIVED = "received"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def ended(self) -> bool:
        return self in _ENDED


_ENDED = frozenset({ReadState.RECEIVED, ReadState.FAILED, ReadState.ABORTED})
#: the states in which nothing of the read is posted yet
UNPOSTED = frozenset({ReadState.ACCEPTED, ReadState.LINKING, ReadState.PLANNING})
LIVE = UNPOSTED | {ReadState.POSTED}


class IllegalEvent(RuntimeError):
    """An event the read's state does not accept (a bug in its driver)."""


class AbortAction(enum.Enum):
    """What the driver does about an abort request."""

    NONE = "none"  # posted (its end reports ``aborted``) or already ended
    CANCEL = "cancel"  # nothing posted: stop the read now


class Failure(enum.Enum):
    """Why an attempt failed, as far as the retry policy cares."""

    OTHER = "other"  # a plan error, a lost lease, a bug...: never retried
    PARTIAL = "partial"  # some ranks read and notified: never retried, links dropped
    REFUSED = "refused"  # P refused the claim (the hold ended): never retried
    REFUSED_STALE_LINK = "refused_stale_link"  # refused over an old link: re-link
    TOKEN = "token"  # a hold token refused: may be the rank's previous key
    TRANSFER = "transfer"  # a NIXL transfer failed
    TIMEOUT = "timeout"  # a NIXL transfer timed out: the peer is stalled, not restarted
    RESET = "reset"  # the local agent was reset under the read (nothing of it lands)


#: failures after which the read's links are dropped (the next use re-links)
_DROPS_LINKS = frozenset({Failure.PARTIAL, Failure.REFUSED_STALE_LINK, Failure.TOKEN,
                          Failure.TRANSFER, Failure.TIMEOUT, Failure.RESET})
#: failures a fresh handshake may cure (when the links may have been stale)
_RETRIABLE = frozenset({Failure.REFUSED_STALE_LINK, Failure.TOKEN, Failure.TRANSFER,
                        Failure.RESET})

#: tries after the first for any retriable failure over stale links
RETRIES = 1
#: more tries for a read whose link the local agent's reset made stale (several
#: reads tripping over the same stale peer at once may each meet a reset)
RESET_RETRIES = 2


class Transfers(enum.Enum):
    """What a read's ended transfers mean for it."""

    OK = "ok"
    FAILED = "failed"  # the read fails (or is retried) whole
    PARTIAL = "partial"  # some ranks were read and notified: never retried


class Outcome(enum.Enum):
    """How the read's task ended, as its completion needs it."""

    CANCELLED = "cancelled"  # stopped before posting
    ERROR = "error"
    DONE = "done"  # every transfer DONE, lease valid


@dataclass(frozen=True)
class Completed:
    """The read's completion: ``received``, ``failed`` or ``aborted``, and why."""

    kind: Literal["received", "failed", "aborted"]
    reason: str = ""
    #: P is told (an abandon) that this read will not read its holds
    abandon: bool = False


_MOVES: dict[tuple[ReadState, str], ReadState] = {
    (ReadState.ACCEPTED, "link"): ReadState.LINKING,
    (ReadState.LINKING, "linked"): ReadState.PLANNING,
    (ReadState.PLANNING, "posted"): ReadState.POSTED,
}


@dataclass
class ReadBook:
    """One read's state and everything decided from it (clock values come in)."""

    accepted_at: float
    timeout_s: float | None = None
    state: ReadState = ReadState.ACCEPTED
    abort_reason: str | None = None
    #: its notifications went out: P ends its holds ``sent``
    notified: bool = False
    #: tries left for any retriable failure, and for agent resets beyond them
    retries: int = RETRIES
    resets: int = RESET_RETRIES
    #: until when its leases are renewed (the read's deadline); inf until posted
    renew_until: float = math.inf

    # -- queries ---------------------------------------------------------------

    @property
    def ended(self) -> bool:
        return self.state.ended

    @property
    def posted(self) -> bool:
        return self.state is ReadState.POSTED

    # -- events ----------------------------------------------------------------

    def _move(self, event: str) -> None:
        to = _MOVES.get((self.state, event))
        if to is None:
            raise IllegalEvent(f"{event!r} in state {self.state.value}")
        self.state = to

    def link(self) -> None:
        """The read's task starts linking (its first step, or a retry's)."""
        self._move("link")

    def linked(self) -> None:
        """Every link is made: claims and planning start."""
        self._move("linked")

    def posted_at(self, now: float) -> float:
        """Its transfers went to the worker at ``now``: returns its deadline."""
        self._move("posted")
        self.renew_until = math.inf if self.timeout_s is None else now + self.timeout_s
        return self.renew_until

    def transfers_ended(self, failed: int, total: int, *, notified: bool) -> Transfers:
        """Every transfer's outcome is known (``failed`` of ``total``);
        ``notified``: the transfers carried the read's notifications. Some
        ranks read and notified while others failed is partial: their holds
        may be gone, so the read must not be retried whole."""
        if self.state is not ReadState.POSTED:
            raise IllegalEvent(f"'transfers_ended' in state {self.state.value}")
        if failed and failed < total and notified:
            return Transfers.PARTIAL
        if failed:
            return Transfers.FAILED
        if notified:
            self.notified = True
        return Transfers.OK

    def notify(self) -> None:
        """Its notifications went out after its transfers ended (and its claim,
        if any, was granted)."""
        if self.state is not ReadState.POSTED:
            raise IllegalEvent(f"'notify' in state {self.state.value}")
        self.notified = True

    def abort(self, reason: str) -> AbortAction:
        """An abort was asked for (the first reason stands)."""
        if self.abort_reason is None:
            self.abort_reason = reason
        if self.state in UNPOSTED:
            return AbortAction.CANCEL
        return AbortAction.NONE

    def retry(self, failure: Failure, links_predate: bool) -> bool:
        """An attempt failed: True (back to ``ACCEPTED``) when it goes again.

        Retried only when a fresh handshake may cure it: its links predate the
        request (``links_predate``) or the local agent was reset under it, and
        never after a timeout (the peer is stalled) or an abort. One retry for
        any such failure; agent resets (which several reads over one stale
        peer may each meet) earn up to :data:`RESET_RETRIES` more."""
        if self.state not in LIVE:
            raise IllegalEvent(f"'retry' in state {self.state.value}")
        stale = links_predate or failure is Failure.RESET
        if failure not in _RETRIABLE or not stale or self.abort_reason is not None:
            return False
        if self.retries:
            self.retries -= 1
        elif failure is Failure.RESET and self.resets:
            self.resets -= 1
        else:
            return False
        self.state = ReadState.ACCEPTED
        self.renew_until = math.inf
        return True

    def end(self, outcome: Outcome, error: str = "") -> Completed:
        """The read's one completion (``error``: why, for :attr:`Outcome.ERROR`)."""
        if self.state.ended or (outcome is Outcome.DONE and self.state is not ReadState.POSTED):
            raise IllegalEvent(f"'end' ({outcome.value}) in state {self.state.value}")
        if outcome is Outcome.CANCELLED:
            done = Completed("aborted", f"{self.abort_reason or 'cancelled'}; "
                                        "nothing had been posted")
        elif outcome is Outcome.ERROR:
            done = Completed("failed", error)
        elif self.abort_reason is not None:
            done = Completed("aborted", f"{self.abort_reason}; its transfers had finished")
        else:
            done = Completed("received")
        self.state = ReadState(done.kind)
        if done.kind != "received" and not self.notified:
            done = Completed(done.kind, done.reason, abandon=True)
        return done


def drops_links(failure: Failure) -> bool:
    """The read's links are dropped after ``failure`` (the next read re-links)."""
    return failure in _DROPS_LINKS


#: a batched read's failures handed to its own task (links dropped there, and
#: maybe retried) rather than completed by the batch at once
_GOES_ON_ALONE = frozenset({Failure.PARTIAL, Failure.REFUSED, Failure.REFUSED_STALE_LINK,
                            Failure.TOKEN, Failure.TRANSFER, Failure.TIMEOUT,
                            Failure.RESET})


def goes_on_alone(failure: Failure) -> bool:
    """A read of a batch that failed so carries on in a task of its own, where
    :meth:`ReadBook.retry` decides, as for a read alone (a token refused over
    links made before the request re-links once: the rank may have registered
    again, with a new hold key); any other failure completes it at once."""
    return failure in _GOES_ON_ALONE
