"""The P-side hold book, driven by a fake clock (pure bookkeeping, no sockets)."""

from __future__ import annotations

import pytest

from kvsidecar.daemon import notifications
from kvsidecar.daemon.holds import HoldBook, HoldOutcome


def note(req: str, engine: str, rank: int, tp: int, target: str = "P") -> notifications.ReadDone:
    return notifications.decode(notifications.encode(target, req, engine, rank, tp))


def book() -> tuple[HoldBook, list[HoldOutcome]]:
    done: list[HoldOutcome] = []
    return HoldBook(default_timeout_s=10, grace_s=5, on_done=done.append), done


def test_wider_decode_engine_must_send_d_over_p_notifications() -> None:
    b, done = book()
    b.add("P", "r", p_tp=1, readers=1, timeout_s=None, now=0)
    for rank in range(3):
        b.notify(note("r", "D", rank, 4), now=1)
        assert done == []
    b.notify(note("r", "D", 1, 4), now=1)  # duplicate rank: not counted
    assert done == [] and b.duplicates == 1
    b.notify(note("r", "D", 3, 4), now=1)
    assert done == [HoldOutcome("P", "r", "sent")]


def test_two_reader_engines() -> None:
    b, done = book()
    b.add("P", "r", p_tp=2, readers=2, timeout_s=None, now=0)
    b.notify(note("r", "D1", 0, 1), now=1)
    assert done == []
    b.notify(note("r", "D2", 0, 2), now=1)
    assert [d.kind for d in done] == ["sent"]


def test_early_notifications_complete_a_later_hold_at_once() -> None:
    b, done = book()
    b.notify(note("r", "D", 0, 1), now=0)
    b.add("P", "r", p_tp=1, readers=1, timeout_s=None, now=1)
    assert [d.kind for d in done] == ["sent"]
    assert len(b) == 0


def test_unclaimed_notifications_are_counted_after_the_grace_period() -> None:
    b, done = book()
    b.notify(note("ghost", "D", 0, 1), now=0)
    b.expire(now=4.9)
    assert b.unclaimed == 0
    b.expire(now=5.1)
    assert b.unclaimed == 1 and done == []
    b.add("P", "ghost", p_tp=1, readers=1, timeout_s=1, now=6)
    assert done == []  # the stale notification is gone


def test_expiry_names_what_arrived() -> None:
    b, done = book()
    b.add("P", "r", p_tp=1, readers=2, timeout_s=2, now=0)
    b.notify(note("r", "D", 0, 1), now=1)
    b.expire(now=1.9)
    assert done == []
    b.expire(now=2.0)
    assert done[0].kind == "expired"
    assert "1 of 2 reading engines" in done[0].reason and "'D': 1" in done[0].reason


def test_release_and_duplicate_hold() -> None:
    b, done = book()
    b.add("P", "r", p_tp=1, readers=1, timeout_s=None, now=0)
    with pytest.raises(KeyError, match="already held"):
        b.add("P", "r", p_tp=1, readers=1, timeout_s=None, now=0)
    assert b.release("P", "r") and done[0].kind == "aborted"
    assert not b.release("P", "r")


def test_bad_notifications_are_rejected_by_name() -> None:
    with pytest.raises(notifications.BadNotification, match="undecodable"):
        notifications.decode(b"\x00garbage")
    with pytest.raises(notifications.BadNotification, match="outside tp"):
        notifications.decode(notifications.encode("P", "r", "D", 4, 2))
