"""D side: the leases one read holds on the P ranks it reads from.

A read claims the hold on every candidate P rank
(:class:`~kvsidecar.daemon.peers.control.Claim`) before it posts, or, over
links P confirmed within ``--post-during-claim`` seconds, while its transfers
run (its notifications then wait for the grant, see
:func:`~kvsidecar.daemon.d_side.driver.run_group`); a refusal or no answer fails the
read, before anything is posted when it claimed first. While its transfers are pending it renews
every third of the granted lease. Each grant moves that rank's bound to
``t0 + lease_s`` where ``t0`` is this side's monotonic clock when the claim
was sent (claims to one P sidecar issued together travel as one batch, see
:mod:`~kvsidecar.daemon.peers.control`; ``t0`` is then the batch's send time):
P's deadline is at least as late, so while ``now <= bound`` P has not freed
the blocks. A read whose transfers finish after the bound (or whose
renewal P refused) is reported failed, never received. A read that fails or
is aborted *abandons* every rank it linked to, so P stops waiting at once.

Every renewal has an end, so a hold ends by its lease bound whatever D's
read does: renewals stop at the read's own deadline (``until``: its post
time plus ``--read-timeout``) even if a transfer is still pending there,
and a lease that lapsed once (no grant arrived before its bound, e.g. P was
paused) is lost for good: renewing it later would vouch for blocks that P
was free to reuse in between, so the read is reported failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field

import msgspec

from kvsidecar.daemon.peers.client import ControlAnswer, HandshakeClient
from kvsidecar.daemon.peers.control import Abandon, Claim
from kvsidecar.daemon.peers.messages import HandshakeFailed

log = logging.getLogger(__name__)

#: a claim issued by ReaderLeases.send_claims: (P address, claim, P's answer to come)
_Sent = tuple[str, Claim, asyncio.Future[ControlAnswer]]


class LeaseRefused(RuntimeError):
    """A P rank refused (``answered``) or did not answer the claim: the read must not start."""

    def __init__(self, message: str, *, answered: bool, stale_link: bool = False) -> None:
        super().__init__(message)
        self.answered = answered
        self.stale_link = stale_link


class LeaseLost(RuntimeError):
    """The read's lease ran out or was refused on renewal: its bytes cannot be trusted."""


@dataclass
class ReaderLeases:
    """The claims of one read, one per P rank (``targets``: handshake address, claim)."""

    client: HandshakeClient
    targets: list[tuple[str, Claim]]
    bounds: dict[int, float] = field(default_factory=dict)  # P rank -> lease valid until
    lease_s: float = math.inf
    lost: str = ""
    _stale: bool = False

    @property
    def bound(self) -> float:
        """Until when (this clock) every rank's lease is known valid."""
        return min(self.bounds.values(), default=-math.inf)

    def send_claims(self, *, now: bool = False) -> list[_Sent]:
        """Issue every rank's claim now, to be awaited by :meth:`claim`: a read
        issues them before it submits its planning, so they leave first."""
        self._stale = False
        return [(a, c, self.client.control_soon(a, c, now=now)) for a, c in self.targets]

    async def claim(self, sent: list[_Sent] | None = None) -> None:
        """Claim every rank at once (or await the claims :meth:`send_claims`
        issued); raise :class:`LeaseRefused` naming the first refusal."""
        if sent is None:
            sent = self.send_claims()
        if len(sent) == 1:  # the usual case (same tp): no task, no gather
            outcomes = [await self._granted(*sent[0])]
        else:
            outcomes = await asyncio.gather(*(self._granted(*s) for s in sent))
        self._refusals(outcomes)

    def settle(self, sent: list[_Sent]) -> None:
        """:meth:`claim` of claims whose answers have all arrived (every future in
        ``sent`` done), without awaiting: a batch of reads waits for all its
        claims at once, then settles each read's own."""
        self._refusals([self._answered(a, c, f) for a, c, f in sent])

    def _refusals(self, outcomes: list[tuple[bool, str]]) -> None:
        """Raise :class:`LeaseRefused` naming the first refusal among ``outcomes``."""
        problems = [(refused, why) for refused, why in outcomes if why]
        if problems:
            raise LeaseRefused(problems[0][1], answered=problems[0][0], stale_link=self._stale)

    @property
    def renew_every_s(self) -> float:
        """How long after a grant the next renewal goes out (a third of the lease)."""
        return max(0.05, self.lease_s / 3)

    async def renew_forever(self, until: float = math.inf) -> None:
        """Renew every rank each third of the lease until cancelled (the read ended),
        until the lease lapses (lost) or until ``until`` (this clock; the read's
        own deadline), whichever comes first. After that the last grant runs out
        on its own, so P's hold ends at most one lease after ``until``."""
        await asyncio.sleep(self.renew_every_s)
        await self._renewing(until)

    async def _renewing(self, until: float) -> None:
        """Renewals from now on: one now, then one each third of the lease, until
        one says they must stop (see :meth:`renew_forever`)."""
        while await self._renew(until):
            await asyncio.sleep(self.renew_every_s)

    def renew_from_now(self, until: float = math.inf) -> asyncio.Task[None]:
        """The renewals :meth:`renew_later` starts when the first is due, as a
        task started now (a batch of reads keeps one timer for all of them)."""
        return asyncio.ensure_future(self._renewing(until))

    def renew_later(self, until: float = math.inf) -> Renewals:
        """:meth:`renew_forever` in the background, started only when its first
        renewal is due: a read that ends sooner (nearly every read; a lease is
        seconds, a read milliseconds) costs one timer, not a task, its sleep and
        its cancellation. ``cancel()`` the result when the read ends."""
        return Renewals(self, until)

    async def _renew(self, until: float) -> bool:
        """One renewal of every rank, due now; False once renewals must stop."""
        now = time.monotonic()
        if now > self.bound:
            if not self.lost:
                self.lost = (f"the lease ran out {now - self.bound:.3f} s before a renewal "
                             "was granted (the prefill side did not answer in time); "
                             "renewing it now would vouch for blocks it may have reused")
                log.warning("lease lapsed: %s", self.lost)
            return False
        if now >= until:
            log.warning("read still pending at its deadline: lease renewals stop, the "
                        "prefill side frees its blocks when the last lease runs out")
            return False
        outcomes = await asyncio.gather(*(self._claim(a, c) for a, c in self.targets))
        for refused, why in outcomes:
            # Refused: P no longer holds the blocks. Unanswered: the bound
            # simply stops moving and runs out on its own.
            if refused and not self.lost:
                self.lost = f"the prefill side refused to renew the lease: {why}"
                log.warning("lease renewal refused: %s", why)
        return not self.lost

    def check(self, now: float) -> None:
        """Raise :class:`LeaseLost` unless every rank's lease is valid at ``now``."""
        if self.lost:
            raise LeaseLost(self.lost)
        if now > self.bound:
            late = now - self.bound
            raise LeaseLost(f"the read ended {late:.3f} s after its lease on the prefill "
                            "blocks ran out (they may have been freed and reused)")

    def abandon(self, reason: str) -> list[asyncio.Task[None]]:
        """Tell every rank this read is over (failed or aborted), without waiting."""
        return [asyncio.ensure_future(self._abandon(a, c, reason)) for a, c in self.targets]

    async def _claim(self, address: str, claim: Claim) -> tuple[bool, str]:
        """(refused by P, why); ``(False, "")`` when granted."""
        return await self._granted(address, claim, self.client.control_soon(address, claim))

    async def _granted(self, address: str, claim: Claim,
                       answer: asyncio.Future[ControlAnswer]) -> tuple[bool, str]:
        """What :meth:`_claim` says, of a claim already issued (``answer``)."""
        with contextlib.suppress(HandshakeFailed):
            await answer
        return self._answered(address, claim, answer)

    def _answered(self, address: str, claim: Claim,
                  answer: asyncio.Future[ControlAnswer]) -> tuple[bool, str]:
        """What :meth:`_granted` says, of a claim whose ``answer`` arrived."""
        try:
            # t0: when the message carrying the claim left (a batch's send time for
            # every item in it), never earlier than P's receipt could be.
            reply, t0 = answer.result()
        except HandshakeFailed as e:
            return False, f"P rank {claim.tp_rank} at {address}: {e.reason}"
        if not reply.granted or not (0 < reply.lease_s < math.inf):
            self._stale |= reply.stale_link
            return True, f"P rank {claim.tp_rank} at {address} refused the lease: {reply.reason}"
        self.bounds[claim.tp_rank] = max(self.bounds.get(claim.tp_rank, -math.inf),
                                         t0 + reply.lease_s)
        self.lease_s = min(self.lease_s, reply.lease_s)
        return False, ""

    async def _abandon(self, address: str, claim: Claim, reason: str) -> None:
        msg = Abandon(**msgspec.structs.asdict(claim), reason=reason[:1024])
        try:
            await self.client.control(address, msg)
        except HandshakeFailed as e:
            log.info("could not tell P rank %d at %s that request %r was abandoned: %s "
                     "(it releases at its lease deadline)", claim.tp_rank, address,
                     claim.request_id, e.reason)
        except Exception as e:  # e.g. an address the read named that is not one: log, never raise
            log.info("could not tell P rank %d at %r that request %r was abandoned: %s",
                     claim.tp_rank, address[:200], claim.request_id, e)


class Renewals:
    """The renewals of one read (:meth:`ReaderLeases.renew_later`): a timer until
    the first renewal is due, then a task renewing each third of the lease."""

    def __init__(self, leases: ReaderLeases, until: float) -> None:
        self._leases = leases
        self._until = until
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            leases.renew_every_s, self._start)

    def _start(self) -> None:
        self._timer = None
        self._task = self._leases.renew_from_now(self._until)

    def cancel(self) -> None:
        """The read ended: no more renewals (one in flight is abandoned)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()
