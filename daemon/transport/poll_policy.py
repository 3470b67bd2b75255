"""When the NIXL worker thread polls NIXL next: a pure policy and its state.

The thread progresses NIXL itself (by default no NIXL progress thread: as
``nixl_agent`` makes it, it spins a core), so how long it blocks on its job
queue between rounds is the trade of latency against CPU (each timed wake-up
costs CPU, not NIXL's idle poll). With NIXL's thread asleep until a message
(``--nixl-progress-thread-ms``) a peer's READ needs none of our polls, and the
worker opens no soon window for a lease it granted (``NixlWorker.expect_reads``):

- a completion is imminent (``soon``): ``soon_s`` for at most
  ``soon_window_s`` after this worker posted a read that did not finish inside
  ``transfer()`` (while at most ``soon_max_reads`` are in flight), or after
  the owner granted a reader a lease, until the next notification arrives.
  The target side too because NIXL ends every transfer with an endpoint flush
  that, over UCX with tcp for control, completes only once the *peer's* worker
  answers it;
- reads in flight: ``busy_s`` (their completion is the reader's latency);
- a reader holds a lease on our blocks: ``hot_s`` (over UCX/TCP a peer's READ
  is served by *our* progress);
- otherwise a wait that starts at a floor (``hot_s`` with blocks held,
  ``idle_s`` without) and doubles with every round in which nothing happened,
  up to a cap (``hot_max_s`` / ``idle_max_s``, both 0.5 s by default: they
  only bound how late UCX sees a peer go away; every read claims a lease
  first, and a granted claim wakes the worker).

Anything that happens (a job, a wake-up, a notification) starts the
escalation again from its floor. :class:`PollPolicy` computes the wait;
:class:`PollPacer` keeps what it depends on (holds, leases, the last post),
set from the event loop and read by the worker thread (single stores of
floats and bools; a stale value only delays one round). Both take no locks
and no I/O; the clock is injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PollPacer", "PollPolicy"]


@dataclass(frozen=True)
class PollPolicy:
    """How long the worker waits for work before polling NIXL again (seconds).

    Fixed while reads are in flight (``busy_s``) or expected (``hot_s``: a
    reader holds a lease); otherwise a wait that starts at a floor (``hot_s``
    with blocks held, ``idle_s`` without) and doubles with every round in which
    nothing happened, up to a cap (``hot_max_s`` / ``idle_max_s``). Pure, so
    the escalation is tested without threads or clocks.
    """

    busy_s: float = 0.0002
    hot_s: float = 0.001
    #: the cap with blocks held and no lease running: idle's, since every read's
    #: claim wakes the worker
    hot_max_s: float = 0.5
    idle_s: float = 0.005
    idle_max_s: float = 0.5
    #: the wait while a transfer's completion is imminent (``soon``)
    soon_s: float = 0.00005
    #: how long such a window lasts at most after it opened (seconds)
    soon_window_s: float = 0.005
    #: a read of ours opens the soon window only while at most this many are
    #: in flight (see :meth:`PollPacer.imminent`)
    soon_max_reads: int = 2

    def __post_init__(self) -> None:
        if min(self.busy_s, self.hot_s, self.idle_s, self.soon_s) <= 0:
            raise ValueError("poll intervals must be positive")
        if self.hot_max_s < self.hot_s or self.idle_max_s < self.idle_s:
            raise ValueError("a poll cap must not be below its floor")

    def next_wait(self, last: float, *, active: bool, inflight: bool, reads_expected: bool,
                  hot: bool, soon: bool = False) -> float:
        """The wait after a round that waited ``last``; ``active``: something
        happened in it (a job, a wake-up, a notification); ``soon``: a
        completion is imminent (a read of ours posted, or one of a reader we
        just granted a lease, within ``soon_window_s``)."""
        if soon:
            return self.soon_s
        if inflight:
            return self.busy_s
        if reads_expected:
            return self.hot_s
        floor, cap = (self.hot_s, self.hot_max_s) if hot else (self.idle_s, self.idle_max_s)
        if active:
            return floor
        return min(cap, max(floor, last * 2))


class PollPacer:
    """What the next wait depends on: blocks held (:meth:`set_hot`), leases
    granted (:meth:`expect_reads`), the worker's last post (:meth:`posted`)
    and notifications (:meth:`notified`). The event-loop side methods return
    whether the worker thread must be woken now (it may be in a long wait)."""

    def __init__(self, policy: PollPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self.hot = False
        #: poll at hot_s until this time (a reader holds a lease)
        self._reads_expected_until = 0.0
        #: poll at soon_s until this time or the next notification, whichever
        #: comes first (see expect_reads)
        self._soon_until = 0.0
        #: leases granted (counted on the loop thread, read by the worker's rounds)
        self.grants = 0
        #: when this worker last posted a read that did not finish inside transfer()
        self._last_post = 0.0

    def set_hot(self, hot: bool) -> bool:
        """Blocks are held (or not). ``False`` (nothing held any more) also ends
        an :meth:`expect_reads` window: nobody reads memory that is not held."""
        was = self.hot
        self.hot = bool(hot)
        if not self.hot:
            self._reads_expected_until = 0.0
            self._soon_until = 0.0
            return False
        return not was  # leave the idle wait now, not up to idle_max_s later

    def expect_reads(self, for_s: float, *, soon: bool = True) -> bool:
        """A peer is about to read our memory for the next ``for_s`` seconds;
        ``soon``: its read is imminent and worth the soon window."""
        now = self._clock()
        expected = now < self._reads_expected_until
        if now + for_s > self._reads_expected_until:
            self._reads_expected_until = now + for_s
        if not soon:
            # Wake it from a longer wait (blocks held and nothing happening
            # escalates it to hot_max_s): the reader's transfers end only once
            # we answer their closing flush, so it must be on hot_s when they come.
            return not expected
        # The reader posts the moment our grant reaches it, and its READ with a
        # notification completes only after OUR worker answers the endpoint
        # flush: poll every soon_s until its notification came (or the window passed).
        self.grants += 1
        soon_already = now < self._soon_until
        self._soon_until = now + self.policy.soon_window_s
        # Inside an open window it polls every soon_s anyway (a batch of claims
        # would otherwise wake it per claim).
        return not soon_already

    def posted(self) -> None:
        """The worker posted a read that did not finish inside ``transfer()``."""
        self._last_post = self._clock()

    def notified(self, grants_before: int) -> None:
        """A notification came in a round that began with ``grants_before``
        grants: the read a grant opened the window for has most likely
        finished. Closing at the first one keeps a busy target (reads notifying
        all the time) off the soon poll; a read still under way then completes
        at the rate its state asks for."""
        if self.grants == grants_before:  # else a grant came during the round: keep it
            self._soon_until = 0.0
            if self.grants != grants_before:  # one came just now after all
                self._soon_until = self._clock() + self.policy.soon_window_s

    def imminent(self, now: float, inflight: int) -> bool:
        """Whether a completion is imminent: a lease granted within the soon
        window and no notification since, or a read of ours posted within it
        with at most ``soon_max_reads`` transfers in flight. Unbounded (a
        window every grant extends, on any number of reads) it never closes
        under load, and the wake-ups cost more than they save; a busy worker
        goes round often anyway."""
        if now < self._soon_until:
            return True
        return (0 < inflight <= self.policy.soon_max_reads
                and now - self._last_post < self.policy.soon_window_s)

    def next_wait(self, last: float, *, active: bool, inflight: int) -> float:
        """The wait after a round that waited ``last`` (see :class:`PollPolicy`)."""
        now = self._clock()
        return self.policy.next_wait(
            last, active=active, inflight=inflight > 0, hot=self.hot,
            reads_expected=now < self._reads_expected_until,
            soon=self.imminent(now, inflight))
