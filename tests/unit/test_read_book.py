"""D's read book (daemon/d_side/book.py), driven through every state x event:
the legal moves, the illegal ones rejected, an abort and the deadline in each
state, the completions and the retry policy."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from kvsidecar.daemon.d_side.book import (
    LIVE,
    RESET_RETRIES,
    RETRIES,
    UNPOSTED,
    AbortAction,
    Failure,
    IllegalEvent,
    Outcome,
    ReadBook,
    ReadState,
    Transfers,
    drops_links,
    goes_on_alone,
)

S = ReadState


def _at(state: ReadState, timeout_s: float | None = 5.0) -> ReadBook:
    """A book brought to ``state`` by legal events only."""
    book = ReadBook(accepted_at=100.0, timeout_s=timeout_s)
    path: list[Callable[[], object]] = [book.link, book.linked, lambda: book.posted_at(110.0)]
    order = [S.ACCEPTED, S.LINKING, S.PLANNING, S.POSTED]
    if state in order:
        for step in path[:order.index(state)]:
            step()
    else:
        for step in path:
            step()
        outcome = {S.RECEIVED: Outcome.DONE, S.FAILED: Outcome.ERROR}.get(state)
        if outcome is None:
            book.abort("released")
            outcome = Outcome.DONE
        book.end(outcome, "boom")
    assert book.state is state
    return book


EVENTS: dict[str, Callable[[ReadBook], object]] = {
    "link": lambda b: b.link(),
    "linked": lambda b: b.linked(),
    "posted": lambda b: b.posted_at(120.0),
    "transfers_ended": lambda b: b.transfers_ended(0, 1, notified=True),
    "notify": lambda b: b.notify(),
    "retry": lambda b: b.retry(Failure.TRANSFER, True),
    "end_done": lambda b: b.end(Outcome.DONE),
    "end_error": lambda b: b.end(Outcome.ERROR, "x"),
    "end_cancelled": lambda b: b.end(Outcome.CANCELLED),
}

LEGAL: dict[tuple[ReadState, str], ReadState] = {
    (S.ACCEPTED, "link"): S.LINKING,
    (S.LINKING, "linked"): S.PLANNING,
    (S.PLANNING, "posted"): S.POSTED,
    (S.POSTED, "transfers_ended"): S.POSTED,
    (S.POSTED, "notify"): S.POSTED,
    (S.POSTED, "end_done"): S.RECEIVED,
    **{(s, "retry"): S.ACCEPTED for s in LIVE},
    **{(s, "end_error"): S.FAILED for s in LIVE},
    **{(s, "end_cancelled"): S.ABORTED for s in LIVE},
}


@pytest.mark.parametrize("state", list(S))
@pytest.mark.parametrize("event", list(EVENTS))
def test_every_state_x_event(state: ReadState, event: str) -> None:
    book = _at(state)
    to = LEGAL.get((state, event))
    if to is None:
        before = (book.state, book.notified, book.abort_reason, book.renew_until)
        with pytest.raises(IllegalEvent):
            EVENTS[event](book)
        assert (book.state, book.notified, book.abort_reason, book.renew_until) == before
    else:
        EVENTS[event](book)
        assert book.state is to


@pytest.mark.parametrize("state", list(S))
def test_abort_in_each_state(state: ReadState) -> None:
    book = _at(state)
    action = book.abort("released by the engine")
    assert action is (AbortAction.CANCEL if state in UNPOSTED else AbortAction.NONE)
    assert book.state is state  # an abort moves nothing; the read's end reports it
    if state in (S.RECEIVED, S.FAILED):
        return
    if state is S.ABORTED:
        assert book.abort_reason == "released"  # the first reason stands
        return
    assert book.abort_reason == "released by the engine"
    book.abort("another reason")
    assert book.abort_reason == "released by the engine"
    assert not book.retry(Failure.TRANSFER, True)  # an aborted read is never retried
    if state is S.POSTED:
        done = book.end(Outcome.DONE)
        assert (done.kind, done.reason) == ("aborted",
                                            "released by the engine; its transfers had finished")
    else:
        done = book.end(Outcome.CANCELLED)
        assert (done.kind, done.reason) == ("aborted",
                                            "released by the engine; nothing had been posted")
    assert done.abandon and book.state is S.ABORTED


@pytest.mark.parametrize("state", list(S))
def test_deadline_in_each_state(state: ReadState) -> None:
    """The deadline is set by posting (post time + timeout) and dropped by a retry."""
    book = _at(state)
    assert book.renew_until == (math.inf if state in UNPOSTED else 115.0)
    if state in LIVE:
        assert book.retry(Failure.TRANSFER, True)
        assert book.renew_until == math.inf
    if state is S.POSTED:  # and a timeout is the one transfer failure never retried
        assert not _at(state).retry(Failure.TIMEOUT, True)


def test_no_timeout_no_deadline() -> None:
    book = _at(S.POSTED, timeout_s=None)
    assert book.renew_until == math.inf


def test_a_retry_forgets_the_deadline_and_posts_again() -> None:
    book = _at(S.POSTED)
    assert book.retry(Failure.TRANSFER, True)
    assert book.state is S.ACCEPTED and book.renew_until == math.inf and not book.posted
    book.link()
    book.linked()
    assert book.posted_at(200.0) == 205.0 and book.posted


def test_completions() -> None:
    assert _at(S.POSTED).end(Outcome.DONE).kind == "received"
    assert not _at(S.POSTED).end(Outcome.DONE).abandon
    failed = _at(S.PLANNING).end(Outcome.ERROR, "PlanError: no")
    assert (failed.kind, failed.reason, failed.abandon) == ("failed", "PlanError: no", True)
    cancelled = _at(S.ACCEPTED).end(Outcome.CANCELLED)
    assert (cancelled.kind, cancelled.reason) == ("aborted", "cancelled; nothing had been posted")


def test_a_notified_read_abandons_nothing() -> None:
    book = _at(S.POSTED)
    assert book.transfers_ended(0, 2, notified=True) is Transfers.OK and book.notified
    done = book.end(Outcome.ERROR, "LeaseLost: ran out")
    assert done.kind == "failed" and not done.abandon
    book = _at(S.POSTED)
    book.notify()
    assert not book.end(Outcome.DONE).abandon
    book = _at(S.POSTED)
    book.abort("x")
    book.notify()
    assert not book.end(Outcome.DONE).abandon


@pytest.mark.parametrize("failed,total,notified,verdict,now_notified", [
    (0, 2, True, Transfers.OK, True),
    (0, 2, False, Transfers.OK, False),  # notified later (after the grant)
    (1, 2, True, Transfers.PARTIAL, False),
    (1, 2, False, Transfers.FAILED, False),  # nothing notified: failed whole
    (2, 2, True, Transfers.FAILED, False),
    (1, 1, True, Transfers.FAILED, False),
])
def test_transfers_ended(failed: int, total: int, notified: bool, verdict: Transfers,
                         now_notified: bool) -> None:
    book = _at(S.POSTED)
    assert book.transfers_ended(failed, total, notified=notified) is verdict
    assert book.notified is now_notified


@pytest.mark.parametrize("failure", list(Failure))
@pytest.mark.parametrize("predate", [False, True])
def test_retry_policy_first_failure(failure: Failure, predate: bool) -> None:
    book = _at(S.POSTED)
    retriable = failure in (Failure.REFUSED_STALE_LINK, Failure.TOKEN, Failure.TRANSFER,
                            Failure.RESET)
    stale = predate or failure is Failure.RESET
    assert book.retry(failure, predate) is (retriable and stale)
    assert book.state is (S.ACCEPTED if retriable and stale else S.POSTED)


def test_retry_budget() -> None:
    book = _at(S.LINKING)
    for _ in range(RETRIES):
        assert book.retry(Failure.TRANSFER, True)
        book.link()
    assert not book.retry(Failure.TRANSFER, True)  # spent, and not a reset
    for _ in range(RESET_RETRIES):
        assert book.retry(Failure.RESET, False)
        book.link()
    assert not book.retry(Failure.RESET, False)


def test_links_dropped() -> None:
    assert {f for f in Failure if drops_links(f)} == {
        Failure.PARTIAL, Failure.REFUSED_STALE_LINK, Failure.TOKEN, Failure.TRANSFER,
        Failure.TIMEOUT, Failure.RESET}


def test_batched_failures_going_on_alone() -> None:
    """What a batch hands to the read's own task: every NIXL failure, a partial
    read, a refused claim and a refused token (a read alone re-links after one);
    anything else completes at once."""
    assert {f for f in Failure if goes_on_alone(f)} == {
        Failure.PARTIAL, Failure.REFUSED, Failure.REFUSED_STALE_LINK, Failure.TOKEN,
        Failure.TRANSFER, Failure.TIMEOUT, Failure.RESET}
