"""The book of reads and holds sent without waiting (ipc/posted_requests.py): pure,
no socket."""

from __future__ import annotations

import pytest

from kvsidecar.ipc.client_core import PARK_S
from kvsidecar.ipc.errors import BadMessage, BadRequest, Unavailable
from kvsidecar.ipc.posted_requests import PostedRequests
from kvsidecar.ipc.protocol import (
    BAD_REQUEST,
    DUPLICATE,
    UNKNOWN_ENGINE,
    Batch,
    Completion,
    Completions,
    Error,
    Held,
    Ok,
    Poll,
    Pong,
    Read,
    RemoteEngine,
    Replies,
)

REMOTE = RemoteEngine("p0", 1, ["127.0.0.1:7000"])


def _read(msg_id: int, engine: str = "d0", rid: str | None = None) -> Read:
    return Read(engine, rid or f"r{msg_id}", [[0]], REMOTE, [[1]], id=msg_id)


def _sent(book: PostedRequests, *ids: int, engine: str = "d0") -> None:
    for i in ids:
        book.add(_read(i, engine), f"msg{i}".encode())


def test_an_accepted_read_is_forgotten_and_reported_by_nobody_here() -> None:
    book = PostedRequests()
    _sent(book, 1)
    assert len(book) == 1 and 1 in book
    assert book.answered(1, Ok(id=1))
    assert len(book) == 0 and not book.has_refused("d0") and book.take_refused("d0") == []


def test_a_refusal_becomes_one_failed_completion_for_its_engines_poll() -> None:
    book = PostedRequests()
    _sent(book, 1, 2)
    _sent(book, 3, engine="d1")
    assert book.answered(2, Error(BAD_REQUEST, "local block id 9 out of range", id=2))
    assert book.answered(3, BadRequest(BAD_REQUEST, "no such group"))  # a decoded error too
    assert book.has_refused("d0") and book.has_refused("d1")
    assert book.take_refused("d0") == [Completion(
        "r2", "failed", reason="refused by the sidecar (bad_request): local block id 9 out of "
                               "range")]
    assert book.take_refused("d0") == []  # each once
    assert [c.request_id for c in book.take_refused("d1")] == ["r3"]
    assert len(book) == 1  # r1 still awaits its answer


def test_what_is_not_an_answer_to_a_posted_read_is_left_to_the_caller() -> None:
    book = PostedRequests()
    _sent(book, 1)
    assert not book.answered(7, Pong(1, id=7))
    assert not book.answered(-1, Error(BAD_REQUEST, "no id"))
    assert len(book) == 1


def test_sent_again_a_duplicate_means_the_first_copy_was_taken() -> None:
    book = PostedRequests()
    _sent(book, 1, 2, 3)
    assert book.answered(1, Ok(id=1))
    assert book.due == 2 and book.behind == 0
    book.new_connection()  # the sidecar closed the connection: 2 and 3 go again
    assert book.behind == 2 and book.due == 0
    assert book.unsent() == [(2, b"msg2"), (3, b"msg3")]  # in the order first sent
    book.sent_again(2)
    assert book.behind == 1 and book.unsent() == [(3, b"msg3")]
    book.not_sent_again(2)  # its send failed after all
    assert book.behind == 2 and book.unsent() == [(2, b"msg2"), (3, b"msg3")]
    book.sent_again(2)
    book.sent_again(3)
    assert book.behind == 0 and book.due == 2
    assert book.answered(2, Error(DUPLICATE, "read 'r2' is already in progress", id=2))
    assert book.answered(3, Error(UNKNOWN_ENGINE, "engine 'd0' is not registered", id=3))
    # the duplicate of a read sent again is dropped; another refusal still counts
    assert [c.request_id for c in book.take_refused("d0")] == ["r3"]


def test_an_answer_from_a_closed_connection_settles_a_read_behind() -> None:
    """Answers read from a connection's queue after it closed (new_connection
    already counted the read behind) settle it and it is not sent again."""
    book = PostedRequests()
    _sent(book, 1, 2)
    book.new_connection()
    assert book.answered(1, Ok(id=1))
    assert book.behind == 1 and book.unsent() == [(2, b"msg2")]


def test_a_duplicate_of_a_read_sent_once_is_the_engines_and_reported() -> None:
    book = PostedRequests()
    _sent(book, 1)
    assert book.answered(1, Error(DUPLICATE, "read 'r1' is already in progress", id=1))
    assert [c.kind for c in book.take_refused("d0")] == ["failed"]


def test_bounds_unanswered_and_refused_per_engine() -> None:
    book = PostedRequests(max_unanswered=2, max_refused=2)
    _sent(book, 1)
    assert not book.full
    _sent(book, 2)
    assert book.full
    book.check_room("d0")
    for i in (1, 2):
        book.answered(i, Error(BAD_REQUEST, "no", id=i))
    assert not book.full
    with pytest.raises(Unavailable, match="2 reads or holds of engine 'd0' sent without waiting"):
        book.check_room("d0")
    book.check_room("d1")  # another engine's reads are not held up
    book.take_refused("d0")
    book.check_room("d0")
    _sent(book, 3)
    book.answered(3, Error(BAD_REQUEST, "no", id=3))
    book.forget_engine("d0")  # deregistered: nobody polls them
    assert not book.has_refused("d0")


def test_fail_behind_drop_discard_and_forget() -> None:
    book = PostedRequests()
    _sent(book, 1, 2, 3)
    book.answered(3, Error(BAD_REQUEST, "no", id=3))
    book.discard(1)
    assert 1 not in book and len(book) == 1
    book.new_connection()  # 2 was never read by the sidecar
    _sent(book, 4)  # went out on the new connection
    book.fail_behind("never read")
    assert [(c.request_id, c.reason) for c in book.take_refused("d0")] == [
        ("r3", "refused by the sidecar (bad_request): no"), ("r2", "never read")]
    assert len(book) == 1 and book.behind == 0 and book.due == 1
    _sent(book, 6)
    book.new_connection()  # 4 and 6 behind
    book.sent_again(4)
    book.drop_due()  # the connection ended after the sidecar read 4: dropped; 6 stays behind
    assert 4 not in book and 6 in book and book.behind == 1
    book.drop_unanswered()  # the client closed: 6 may still be read from its queue
    assert len(book) == 0 and book.behind == 0
    _sent(book, 5)
    book.answered(5, Error(BAD_REQUEST, "no", id=5))
    book.forget()  # a forked child's
    assert len(book) == 0 and not book.has_refused("d0")


def _batch(msg_id: int, *rids: str) -> Batch:
    return Batch([_read(100 * msg_id + i, rid=rid) for i, rid in enumerate(rids)], id=msg_id)


def test_a_batch_is_answered_item_by_item() -> None:
    """Each refused item of a batch is a refusal of its own request id, in
    order; accepted items are nobody's business here."""
    book = PostedRequests()
    book.add(_batch(1, "a", "b", "c"), b"batch")
    assert len(book) == 1
    assert book.answered(1, Replies([Ok(id=100), Error(BAD_REQUEST, "no such block", id=101),
                                     Held(10.0, 60.0, id=102)], id=1))
    got = book.take_refused("d0")
    assert [(c.request_id, c.kind) for c in got] == [("b", "failed")]
    assert got[0].reason == "refused by the sidecar (bad_request): no such block"
    assert len(book) == 0


def test_a_whole_batch_refused_or_answered_short_refuses_its_items() -> None:
    book = PostedRequests()
    book.add(_batch(1, "a", "b"), b"one")
    book.add(_batch(2, "c", "d"), b"two")
    book.answered(1, Error(UNKNOWN_ENGINE, "not registered", id=1))
    book.answered(2, Replies([Ok(id=200)], id=2))  # a reply for "d" missing
    assert [(c.request_id, "unknown_engine" in c.reason or "left it out" in c.reason)
            for c in book.take_refused("d0")] == [("a", True), ("b", True), ("d", True)]


def test_a_batch_sent_again_drops_the_duplicates_of_what_was_taken() -> None:
    book = PostedRequests()
    book.add(_batch(1, "a", "b"), b"batch")
    book.new_connection()
    assert book.unsent() == [(1, b"batch")]
    book.sent_again(1)
    book.answered(1, Replies([Error(DUPLICATE, "in progress", id=100),
                              Error(BAD_REQUEST, "no such block", id=101)], id=1))
    assert [c.request_id for c in book.take_refused("d0")] == ["b"]


def test_refusals_made_by_the_client_itself_come_the_same_way() -> None:
    book = PostedRequests()
    book.refuse("d0", "x", "refused by the sidecar (bad_request): too long")
    assert book.has_refused("d0") and book.take_refused("d0")[0].request_id == "x"


def _parked(book: PostedRequests, msg_id: int, engine: str = "d0") -> None:
    book.add(Poll(engine, 0, "", PARK_S, id=msg_id), b"poll")


def test_a_parked_poll_is_booked_apart_and_its_answer_kept_for_the_engine() -> None:
    book = PostedRequests()
    _sent(book, 1)
    _parked(book, 2)
    _parked(book, 3, engine="d1")
    assert len(book) == 1 and book.due == 1  # nobody waits for a parked poll
    assert book.parked("d0") and book.parked("d1") and not book.parked("d2")
    done = Completions([Completion("r9", "received")], last=4, epoch="e1", id=2)
    assert book.answered(2, done)
    assert not book.parked("d0") and book.parked("d1")
    assert book.take_pushed("d0") == done and book.take_pushed("d0") is None  # once
    refused = Error(UNKNOWN_ENGINE, "engine 'd1' is not registered here", id=3)
    assert book.answered(3, refused)
    assert book.take_pushed("d1") == refused
    assert len(book) == 1 and not book.answered(2, done)  # answered once


def test_a_parked_poll_answered_with_something_else_is_a_bad_message() -> None:
    book = PostedRequests()
    _parked(book, 5)
    assert book.answered(5, Ok(id=5))
    got = book.take_pushed("d0")
    assert isinstance(got, BadMessage) and "answered with a Ok" in got.message


def test_parked_polls_go_with_their_connection_and_never_again() -> None:
    book = PostedRequests()
    _parked(book, 1)
    _parked(book, 2, engine="d1")
    book.discard(1)  # its send failed
    assert not book.parked("d0") and book.parked("d1")
    book.new_connection()  # read requests go again; a parked poll is not among them
    assert book.unsent() == [] and book.behind == 0
    book.unpark()  # the socket went
    assert not book.parked("d1") and not book.answered(2, Completions(id=2))
    _parked(book, 3)
    book.answered(3, Completions(id=3))
    book.forget_engine("d0")
    assert book.take_pushed("d0") is None
    _parked(book, 6)
    book.answered(6, Completions(id=6))
    _parked(book, 7, engine="d1")
    book.forget_polls("d0")  # registered anew: what the old one's poll brought is stale
    book.forget_polls("d1")
    assert book.take_pushed("d0") is None and not book.parked("d1")
    assert not book.answered(7, Completions(id=7))
    _parked(book, 4)
    book.answered(4, Completions(id=4))
    _parked(book, 5)
    book.forget()  # a forked child: nothing of its parent's
    assert book.take_pushed("d0") is None and not book.parked("d0")


def test_a_parked_poll_unanswered_too_long_is_overdue_once_and_its_answer_stale() -> None:
    book = PostedRequests()
    book.add(Poll("d0", 0, "", PARK_S, id=1), b"poll", 100.0)
    assert not book.overdue("d0", 102.0, 2.0) and book.parked("d0")  # not yet
    assert not book.overdue("d1", 200.0, 2.0)  # nothing parked
    assert book.overdue("d0", 102.5, 2.0)
    assert not book.parked("d0") and not book.overdue("d0", 300.0, 2.0)  # said once
    assert not book.answered(1, Completions(id=1))  # late: stale
