"""D-side leases (daemon/leases.py) against a P hold book, in one process.

The peer channel is replaced by ``BookPeer``, a named fake: it answers a
claim by calling the real :class:`HoldBook` on the same monotonic clock, or
stays silent while "paused". It stands in for a D read whose transfer is
stuck past its deadline while P keeps answering, which the real worker never
allows to happen (it resets its agent at the deadline); the real-process
pause case is in tests/e2e/test_leases.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvsidecar.daemon.holds import HoldBook, HoldOutcome
from kvsidecar.daemon.leases import LeaseLost, ReaderLeases
from kvsidecar.daemon.peers.client import ControlAnswer
from kvsidecar.daemon.peers.control import Claim, ControlReply, ControlRequest
from kvsidecar.daemon.peers.messages import HandshakeFailed

LEASE_S = 0.3


class BookPeer:
    """Fake peer channel: answers claims from a real HoldBook; ``paused`` drops them."""

    def __init__(self) -> None:
        self.done: list[HoldOutcome] = []
        self.book = HoldBook(default_timeout_s=0.1, grace_s=1, on_done=self.done.append,
                             lease_s=LEASE_S)
        self.sent: list[float] = []
        self.paused = False

    async def control(self, address: str, msg: ControlRequest) -> ControlAnswer:
        sent_at = time.monotonic()
        self.sent.append(sent_at)
        if self.paused:
            await asyncio.sleep(LEASE_S * 2)
            raise HandshakeFailed(address, "no answer (paused)")
        assert isinstance(msg, Claim)
        lease = self.book.claim(msg.engine_id, msg.request_id, time.monotonic())
        return ControlAnswer(ControlReply(granted=lease.granted, lease_s=lease.lease_s,
                                          reason=lease.reason), sent_at)

    def control_soon(self, address: str, msg: ControlRequest, *,
                     now: bool = False) -> asyncio.Future[ControlAnswer]:
        return asyncio.ensure_future(self.control(address, msg))


def leases(peer: BookPeer) -> ReaderLeases:
    claim = Claim(engine_id="P", tp_rank=0, agent_name="a", request_id="r",
                  reader_engine="D", reader_rank=0, reader_tp=1)
    return ReaderLeases(peer, [("127.0.0.1:1", claim)])  # type: ignore[arg-type]


async def test_renewals_stop_at_the_reads_deadline_so_the_hold_ends_one_lease_later() -> None:
    peer = BookPeer()
    peer.book.add("P", "r", p_tp=1, readers=1, timeout_s=0.1, now=time.monotonic())
    ls = leases(peer)
    await ls.claim()
    until = time.monotonic() + 4 * LEASE_S
    # A transfer that never ends: nothing cancels the renewals, they must end by themselves.
    await asyncio.wait_for(ls.renew_forever(until), timeout=60)
    assert len(peer.sent) >= 2  # it did renew while the read was within its deadline
    assert all(t < until for t in peer.sent)
    deadline = peer.book.deadline("P", "r")
    assert deadline is not None and deadline <= until + LEASE_S
    peer.book.expire(deadline)
    assert [d.kind for d in peer.done] == ["expired"]
    with pytest.raises(LeaseLost, match="after its lease"):
        ls.check(deadline + 0.001)


async def test_a_lease_that_lapsed_is_lost_even_if_p_answers_again() -> None:
    peer = BookPeer()
    peer.book.add("P", "r", p_tp=1, readers=1, timeout_s=60, now=time.monotonic())
    ls = leases(peer)
    await ls.claim()
    peer.paused = True  # P stops answering: the bound stops moving and runs out
    renewing = asyncio.ensure_future(ls.renew_forever())
    while ls.bound >= time.monotonic():
        await asyncio.sleep(0.02)
    peer.paused = False  # P answers again; the lapse must not be papered over
    await asyncio.wait_for(renewing, timeout=60)
    with pytest.raises(LeaseLost, match="lease ran out"):
        ls.check(time.monotonic())
    sent = len(peer.sent)
    await asyncio.sleep(LEASE_S)
    assert len(peer.sent) == sent  # no renewal after the lapse
