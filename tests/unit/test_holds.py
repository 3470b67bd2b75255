"""The P-side hold book, driven by a fake clock (pure bookkeeping, no sockets)."""

from __future__ import annotations

import pytest

from kvsidecar.daemon import notifications
from kvsidecar.daemon.holds import HoldBook, HoldOutcome, Lease, ReaderOutcome, Report


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
    assert done == [HoldOutcome("P", "r", "sent",
                                readers=(ReaderOutcome("D", (0, 1, 2, 3), True),))]


def test_two_reader_engines() -> None:
    b, done = book()
    b.add("P", "r", p_tp=2, readers=2, timeout_s=None, now=0)
    b.notify(note("r", "D1", 0, 1), now=1)
    assert done == []
    b.notify(note("r", "D2", 0, 2), now=1)
    assert [d.kind for d in done] == ["sent"]


def test_sent_names_the_readers_served_and_one_still_reading() -> None:
    """readers=2 with three reading engines: the hold ends ``sent`` when two are
    finished; the third (one of its two ranks reported) is listed unfinished."""
    b, done = book()
    b.add("P", "r", p_tp=1, readers=2, timeout_s=None, now=0)
    b.notify(note("r", "D3", 1, 2), now=1)
    b.notify(note("r", "D1", 0, 1), now=1)
    assert done == []
    b.notify(note("r", "D2", 0, 1), now=1)
    (out,) = done
    assert out.kind == "sent"
    assert out.readers == (ReaderOutcome("D3", (1,), False), ReaderOutcome("D1", (0,), True),
                           ReaderOutcome("D2", (0,), True))
    b.notify(note("r", "D3", 0, 2), now=1)  # late: the hold has ended
    assert len(done) == 1


def test_aborted_and_expired_name_who_gave_up_and_who_never_came() -> None:
    b, done = book()
    b.add("P", "a", p_tp=1, readers=2, timeout_s=None, now=0)
    b.notify(note("a", "D1", 0, 1), now=1)
    b.report("P", "a", Report("D2", 0, 1, "lease lost"), now=1)
    b.add("P", "e", p_tp=1, readers=1, timeout_s=2, now=0)
    b.notify(note("e", "D1", 0, 2), now=1)
    b.expire(now=3)
    assert [(d.request_id, d.kind, d.readers) for d in done] == [
        ("a", "aborted", (ReaderOutcome("D1", (0,), True),
                          ReaderOutcome("D2", (0,), True, "rank 0: lease lost"))),
        ("e", "expired", (ReaderOutcome("D1", (0,), False),)),
    ]


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
    assert b.release("P", "r", now=1) and done[0].kind == "aborted"
    assert not b.release("P", "r", now=1)


def test_bad_notifications_are_rejected_by_name() -> None:
    with pytest.raises(notifications.BadNotification, match="undecodable"):
        notifications.decode(b"\x00garbage")
    with pytest.raises(notifications.BadNotification, match="outside tp"):
        notifications.decode(notifications.encode("P", "r", "D", 4, 2))


# --------------------------------------------------------------------------
# Leases, abandons and bounds
# --------------------------------------------------------------------------


def leased(lease_s: float = 3.0, **kw: int) -> tuple[HoldBook, list[HoldOutcome]]:
    done: list[HoldOutcome] = []
    return HoldBook(default_timeout_s=10, grace_s=5, on_done=done.append, lease_s=lease_s,
                    **kw), done


def test_claims_and_renewals_keep_a_hold_alive_past_its_timeout() -> None:
    b, done = leased()
    b.add("P", "r", p_tp=1, readers=1, timeout_s=2, now=0)
    assert b.claim("P", "r", now=1) == Lease(True, 3.0)
    assert b.deadline("P", "r") == 4  # receipt + lease: never before the reader's bound
    b.expire(now=3.9)
    assert done == []
    assert b.claim("P", "r", now=3.5).granted  # a renewal
    b.expire(now=6.4)
    assert done == []
    b.expire(now=6.5)  # no renewal within the lease: expired at receipt + lease
    assert [d.kind for d in done] == ["expired"]


def test_a_claim_for_an_ended_hold_is_refused() -> None:
    b, _ = leased()
    b.add("P", "r", p_tp=1, readers=1, timeout_s=1, now=0)
    b.expire(now=1)
    lease = b.claim("P", "r", now=2)
    assert not lease.granted and "has ended (expired)" in lease.reason
    b.add("P", "s", p_tp=1, readers=1, timeout_s=None, now=0)
    b.notify(note("s", "D", 0, 1), now=1)
    assert not b.claim("P", "s", now=2).granted  # sent: its blocks may be reused
    b.add("P", "t", p_tp=1, readers=1, timeout_s=None, now=0)
    b.release("P", "t", now=0)
    assert "aborted" in b.claim("P", "t", now=1).reason


def test_an_early_claim_holds_the_later_hold_until_its_lease_ends() -> None:
    b, done = leased(lease_s=30)
    assert b.claim("P", "r", now=0).granted
    b.add("P", "r", p_tp=1, readers=1, timeout_s=1, now=1)
    assert b.deadline("P", "r") == 30
    b.expire(now=29.9)
    assert done == []


def test_an_abandoning_reader_ends_the_hold_at_once_as_aborted() -> None:
    b, done = leased()
    b.add("P", "r", p_tp=1, readers=1, timeout_s=None, now=0)
    b.report("P", "r", Report("D", 0, 1, "NixlError: boom"), now=1)
    assert [(d.kind, "gave up" in d.reason and "boom" in d.reason) for d in done] == [
        ("aborted", True)]


def test_partial_readers_a_wide_reader_counts_once_every_rank_reported() -> None:
    """D tp 2 reading P tp 1: rank 0 read (notified), rank 1 failed (abandoned).
    The reading engine is finished, failed; the hold ends only then."""
    b, done = leased()
    b.add("P", "r", p_tp=1, readers=1, timeout_s=None, now=0)
    b.notify(note("r", "D", 0, 2), now=1)
    assert done == []
    b.report("P", "r", Report("D", 1, 2, "lease lost"), now=1)
    assert [d.kind for d in done] == ["aborted"] and "rank 1: lease lost" in done[0].reason


def test_an_abandon_after_the_notification_changes_nothing() -> None:
    b, done = leased()
    b.add("P", "r", p_tp=1, readers=2, timeout_s=None, now=0)
    b.notify(note("r", "D1", 0, 1), now=1)
    b.report("P", "r", Report("D1", 0, 1, "late abandon"), now=1)
    assert done == []
    b.notify(note("r", "D2", 0, 1), now=1)
    assert [d.kind for d in done] == ["sent"]


def test_early_entries_are_bounded() -> None:
    b, done = leased(max_early=2)
    b.notify(note("a", "D", 0, 1), now=0)
    assert b.claim("P", "b", now=0).granted
    b.notify(note("c", "D", 0, 1), now=0)  # a third request: dropped and counted
    assert b.early == 2 and b.early_dropped == 1
    refused = b.claim("P", "d", now=0)
    assert not refused.granted and "too many" in refused.reason
    b.add("P", "a", p_tp=1, readers=1, timeout_s=None, now=1)
    assert [d.kind for d in done] == ["sent"]  # the kept early notification still counts


def test_ended_holds_stay_refused_after_why_they_ended_is_forgotten() -> None:
    """Why a hold ended is kept for the last ``max_ended`` ends; a claim for an
    older one is still refused: with a token the sidecar issued (at the hold,
    so no hold means it ended) and with one the engine issued (its request may
    have ended within the tokens' life). A request never held is still claimed
    early; a late report waits as early news, but lets no claim through."""
    b, _ = leased(max_ended=2)
    for rid in ("a", "b", "c"):
        b.add("P", rid, p_tp=1, readers=1, timeout_s=None, now=0)
        b.release("P", rid, now=0)
    refused = b.claim("P", "c", now=1)
    assert not refused.granted and "has ended (aborted)" in refused.reason
    by_engine = b.claim("P", "a", now=1)  # why is forgotten: "a" is not an early claim
    assert not by_engine.granted and "may have ended" in by_engine.reason
    by_sidecar = b.claim("P", "a", now=1, may_precede=False)
    assert not by_sidecar.granted and "issued at the hold" in by_sidecar.reason
    assert b.forgotten_refused == 2
    b.notify(note("a", "D", 0, 1), now=1)  # late news, kept as early (bounded, lapses)
    assert b.early == 1
    assert not b.claim("P", "a", now=1).granted  # its entry was no claim's
    assert b.claim("P", "new", now=1).granted and b.early == 2
    assert b.claim("P", "new", now=2).granted  # a renewal
    # The sidecar issues a token only once its hold is placed: never early.
    assert not b.claim("P", "newer", now=1, may_precede=False).granted


def test_a_hold_read_by_its_readers_waits_for_another_claimants_lease() -> None:
    """readers=1, two engines claimed: the first to finish does not end the hold
    while the other's lease runs (it may be copying the blocks). The hold takes
    no new claim or renewal and ends as its reader made it when that lease
    runs out, or at once when the other claimant finishes too."""
    b, done = leased(lease_s=3)
    for rid in ("r", "s"):
        b.add("P", rid, p_tp=1, readers=1, timeout_s=None, now=0)
        assert b.claim("P", rid, now=1, reader=("D1", 0)).granted
        assert b.claim("P", rid, now=2, reader=("D2", 0)).granted  # lease to t=5
        b.notify(note(rid, "D1", 0, 1), now=2.5)
    assert done == [] and len(b) == 2 and b.due("P", "r") == 5
    for who in (("D1", 0), ("D2", 0), ("D3", 0)):
        refused = b.claim("P", "r", now=3, reader=who)
        assert not refused.granted and "read by its 1 reading engine" in refused.reason
    for who in (("D3", 0), ("D4", 0)):  # refused claimants are no readers it waits for
        assert not b.claim("P", "s", now=3, reader=who).granted
    assert b.release("P", "r", now=3) and done == []  # ends as its reader made it
    b.notify(note("s", "D2", 0, 1), now=3)  # the other claimant finished: ends now
    assert [(d.request_id, d.kind) for d in done] == [("s", "sent")]
    b.expire(4.9)
    assert len(done) == 1
    b.expire(5)
    assert [(d.request_id, d.kind) for d in done][1:] == [("r", "sent")]
    assert done[1].readers == (ReaderOutcome("D1", (0,), True), )
    # An abandon that completes the readers fixes the outcome the same way.
    b.add("P", "t", p_tp=1, readers=1, timeout_s=None, now=10)
    assert b.claim("P", "t", now=10, reader=("D1", 0)).granted
    assert b.claim("P", "t", now=10, reader=("D2", 0)).granted
    b.report("P", "t", Report("D1", 0, 1, "link lost"), now=11)
    assert len(done) == 2
    b.expire(13)
    assert done[-1].kind == "aborted" and "1 gave up: D1 rank 0: link lost" in done[-1].reason


def test_a_release_while_a_reader_holds_a_lease_waits_for_the_lease() -> None:
    """The engine may reuse blocks once 'aborted' arrives: not while a reader's
    lease says they may still be read."""
    b, done = leased(lease_s=3)
    b.add("P", "r", p_tp=1, readers=1, timeout_s=None, now=0)
    assert b.claim("P", "r", now=1).granted
    assert b.release("P", "r", now=2)
    assert done == []
    assert not b.claim("P", "r", now=2.5).granted  # no renewals after a release
    b.expire(now=3.9)
    assert done == []
    b.expire(now=4.0)
    assert [(d.kind, "leases have run out" in d.reason) for d in done] == [("aborted", True)]


def test_a_release_without_readers_ends_at_once() -> None:
    b, done = leased()
    b.add("P", "r", p_tp=1, readers=1, timeout_s=None, now=0)
    assert b.release("P", "r", now=1) and [d.kind for d in done] == ["aborted"]


def test_renewals_cannot_keep_a_hold_past_its_longest_life() -> None:
    """Whatever a reader does (a D that renews forever), a hold's leases end at
    placement + max(timeout_s, max_life_s): granted short near the cap, then refused."""
    done: list[HoldOutcome] = []
    b = HoldBook(default_timeout_s=10, grace_s=5, on_done=done.append, lease_s=4,
                 max_life_s=30)
    b.add("P", "r", p_tp=1, readers=1, timeout_s=None, now=0)
    for t in range(0, 28, 2):
        assert b.claim("P", "r", now=t) == Lease(True, 4)
    assert b.claim("P", "r", now=28) == Lease(True, 2)  # only up to the cap
    refused = b.claim("P", "r", now=30)
    assert not refused.granted and "--hold-max-life" in refused.reason
    b.expire(29.9)
    assert done == []
    b.expire(30)
    assert [d.kind for d in done] == ["expired"]


def test_a_long_timeout_is_kept_beyond_the_longest_life() -> None:
    done: list[HoldOutcome] = []
    b = HoldBook(default_timeout_s=10, grace_s=5, on_done=done.append, lease_s=4,
                 max_life_s=30)
    b.add("P", "r", p_tp=1, readers=1, timeout_s=100, now=0)
    assert b.claim("P", "r", now=90) == Lease(True, 4)
    assert b.claim("P", "r", now=99) == Lease(True, 1)
    assert not b.claim("P", "r", now=100).granted
    b.expire(100)
    assert [d.kind for d in done] == ["expired"]


def test_a_claim_naming_other_blocks_than_the_hold_is_refused() -> None:
    b, _ = leased()
    b.add("P", "r", p_tp=1, readers=1, timeout_s=5, now=0, digest=b"a" * 16)
    refused = b.claim("P", "r", now=1, digest=b"b" * 16, member=b"D", reader=("D", 0))
    assert not refused.granted and "other blocks" in refused.reason
    assert b.claim("P", "r", now=1, digest=b"a" * 16, member=b"D", reader=("D", 0)).granted


def test_a_reading_rank_is_its_first_claimants_alone() -> None:
    b, done = leased()
    b.add("P", "r", p_tp=1, readers=1, timeout_s=5, now=0)
    assert b.claim("P", "r", now=1, member=b"D", reader=("D", 0)).granted
    other = b.claim("P", "r", now=1, member=b"M", reader=("D", 0))
    assert not other.granted and "another fleet member" in other.reason
    assert "another fleet member" in b.may_report("P", "r", ("D", 0), b"M")
    assert b.may_report("P", "r", ("D", 0), b"D") == ""
    assert b.member_of("P", "r", ("D", 0)) == b"D"
    assert b.claim("P", "r", now=1, member=b"M", reader=("M", 0)).granted  # its own rank
    assert done == []


def test_early_claims_are_bounded_per_member_and_bind_when_the_hold_comes() -> None:
    b, _ = leased(max_early=8, max_early_per_member=2)
    assert b.claim("P", "a", now=0, member=b"M", reader=("M", 0)).granted
    assert b.claim("P", "b", now=0, member=b"M", reader=("M", 0)).granted
    refused = b.claim("P", "c", now=0, member=b"M", reader=("M", 0))
    assert not refused.granted and "2 per fleet member" in refused.reason
    assert b.claim("P", "d", now=0, digest=b"d" * 16, member=b"D", reader=("D", 0)).granted
    b.add("P", "d", p_tp=1, readers=1, timeout_s=5, now=1, digest=b"d" * 16)
    assert b.member_of("P", "d", ("D", 0)) == b"D"  # the early claim's binding carried over
    assert b.early == 2
    b.expire(now=100)  # the early ones lapse: M's room is back
    assert b.claim("P", "c", now=100, member=b"M", reader=("M", 0)).granted


def test_early_claims_for_other_blocks_than_the_hold_lose_their_lease() -> None:
    b, done = leased()
    assert b.claim("P", "r", now=0, digest=b"x" * 16, member=b"D", reader=("D", 0)).granted
    b.add("P", "r", p_tp=1, readers=1, timeout_s=2, now=1, digest=b"y" * 16)
    b.expire(now=3.5)  # the early lease (to 3) did not stretch it; its timeout ends it
    assert [d.kind for d in done] == ["expired"]


def test_a_refused_hold_refuses_claims_until_it_is_held() -> None:
    """The engine, told its hold was refused, may reuse the blocks: claims from
    then on are refused (the entry of a claim granted early goes too, its
    notifications counted unclaimed); a later hold of the same id is a new
    hold; a refusal of a copy of a placed hold changes nothing."""
    b, done = book()
    assert b.claim("P", "r", now=0).granted  # early: before the hold
    assert b.claimed_early("P", "r", now=1) and not b.claimed_early("P", "x", now=1)
    assert not b.claimed_early("P", "r", now=100)  # its lease ran out
    b.report("P", "r", Report("D", 0, 1), now=1)  # a notification waits too
    b.refused("P", "r", "bad_request: held block id out of range", now=2)
    lease = b.claim("P", "r", now=3)
    assert not lease.granted and "the hold was refused: bad_request" in lease.reason
    assert b.early == 0 and b.unclaimed == 1
    b.add("P", "r", p_tp=1, readers=1, timeout_s=None, now=4)  # held again later
    assert b.claim("P", "r", now=4).granted
    b.refused("P", "r", "duplicate", now=5)  # a copy sent again: the hold stands
    assert b.claim("P", "r", now=5).granted and ("P", "r") in b
    assert done == []


def test_next_due_is_when_expire_first_has_something_to_end() -> None:
    """Housekeeping sleeps until ``next_due``: at that time ``expire`` ends
    something, and a moment before it ends nothing."""
    b, done = leased(lease_s=3)
    assert b.next_due() == float("inf")  # nothing to expire: no pass needed
    b.add("P", "a", p_tp=1, readers=1, timeout_s=5, now=0)
    b.add("P", "b", p_tp=1, readers=1, timeout_s=8, now=0)
    assert b.next_due() == 5
    assert b.claim("P", "a", now=4).granted  # a lease pushes a's deadline to 7
    assert b.next_due() == 7
    assert b.release("P", "b", now=5)  # b ends when no lease runs on it: at once
    assert [d.request_id for d in done] == ["b"] and b.next_due() == 7
    assert b.claim("P", "early", now=6).granted  # claimed before its hold: grace 5 s
    assert b.next_due() == 7
    b.expire(now=6.99)
    assert len(done) == 1
    b.expire(now=7)
    assert [d.request_id for d in done] == ["b", "a"]
    assert b.next_due() == 11  # the early claim: its grace (6 + 5) outlasts its lease (9)
    b.expire(now=10.99)
    assert b.early == 1
    b.expire(now=11)
    assert b.early == 0 and b.next_due() == float("inf")


def test_next_due_of_a_hold_released_under_a_lease_is_the_lease_s_end() -> None:
    b, done = leased(lease_s=3)
    b.add("P", "r", p_tp=1, readers=1, timeout_s=10, now=0)
    assert b.claim("P", "r", now=1).granted
    assert b.release("P", "r", now=2)
    assert b.next_due() == 4  # not its deadline (10): the lease ends first
    b.expire(now=4)
    assert [d.kind for d in done] == ["aborted"]


def test_a_cut_ends_every_hold_expired_once_no_reader_relies_on_it() -> None:
    """SIGTERM's drain timeout: a hold nobody claimed ends at once, one a reader
    holds a lease of ends when that lease runs out (never sooner: the engine
    reuses the blocks on the completion), no lease is granted or renewed after
    the cut, and each hold ends exactly once, its reason naming the cut."""
    b, done = leased(lease_s=3)
    b.add("P", "unread", p_tp=1, readers=1, timeout_s=100, now=0)
    b.add("P", "reading", p_tp=1, readers=1, timeout_s=100, now=0)
    assert b.claim("P", "reading", now=1).granted  # leased until 4
    assert b.cut_all("shutting down", now=2) == 2
    renewal = b.claim("P", "reading", now=2)  # no renewal past the cut
    assert not renewal.granted and renewal.reason.endswith("ends: shutting down"), renewal
    assert not b.claim("P", "unread", now=2).granted
    b.expire(now=2)
    assert [(d.request_id, d.kind) for d in done] == [("unread", "expired")]
    assert done[0].reason.startswith("shutting down: ")
    b.expire(now=3.9)
    assert len(done) == 1  # its reader may still be copying the blocks
    b.expire(now=4)
    assert [(d.request_id, d.kind) for d in done][1:] == [("reading", "expired")]
    b.expire(now=50)
    assert len(b) == 0 and len(done) == 2
