"""Reads and holds sent without waiting for their answer (``read_nowait``,
``hold_nowait``, and in batches ``read_many_nowait``, ``hold_many_nowait``):
the client's bookkeeping of them, without I/O.

A request sent so is the same :class:`~.protocol.Read`, :class:`~.protocol.Hold`
or :class:`~.protocol.Batch` message the blocking call sends (a batch's items
are answered, and refused, one by one); only its answer is taken later,
whenever the client next receives (any call, or ``poll``). The book
remembers each such request until that answer comes:

- ``Ok`` (a read) or ``Held`` (a hold): accepted. Forgotten here; its
  completion comes from the sidecar through ``poll``, as any read's or hold's.
- an ``Error``: refused, nothing was started. It becomes a ``failed``
  completion of that request id, which the engine's next ``poll`` of its
  engine returns ahead of the sidecar's own (reason: the refusal's code and
  message; no block was written or pinned, so none is listed invalid).

The sidecar answers one connection's requests in the order it reads them, at
once, and a reply it queued stays readable after it closes the connection.
When a connection is lost, the answers still queued on it are taken first.
If the sidecar closed it with messages of ours unread (the client sees a
reset), the requests it left unanswered were never read: they go again on the
next connection (:meth:`PostedRequests.new_connection`), as a blocking call's
request is, and a ``duplicate`` refusal there means the first copy was
taken after all, and is dropped. If it ended without a reset, the sidecar
had read everything (it stopped while handling them): those requests are
dropped (:meth:`PostedRequests.drop_due`), never sent twice; their
completions, if any, come from the sidecar. A request sent on a connection
the client itself gave up (it closed, or a forked child) may still be
handled from that connection's queue, so it is never sent again either: it
is reported ``failed`` (:meth:`PostedRequests.fail_behind`) only where the
sidecar is known not to have read it.

Polls parked at the sidecar (``poll_nowait``) are booked apart: a
:class:`~.protocol.Poll` with ``wait_s`` sent without waiting, at most one
per engine, which the sidecar answers when a completion arrives (or the
wait ends). The answer is kept (:meth:`PostedRequests.take_pushed`) until
the engine polls; a parked poll lives as long as its connection
(:meth:`PostedRequests.unpark` when it goes: never sent again, its
completions, unacknowledged, come with the next poll) and none is counted
among the requests awaiting answers (a client never waits for one).

Bounded: at most ``max_unanswered`` requests await their answers (a client
takes answers, waiting if it must, before it sends more) and at most
``max_refused`` refusals of one engine await its poll; past that
:meth:`check_room` raises :class:`~.errors.Unavailable` for that engine (it
polls, then sends again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from .errors import BadMessage, SidecarError, Unavailable
from .protocol import (
    BAD_MESSAGE,
    DUPLICATE,
    UNAVAILABLE,
    Batch,
    Completion,
    Completions,
    Error,
    Hold,
    Poll,
    Read,
    Replies,
    Reply,
)

__all__ = ["MAX_REFUSED", "MAX_UNANSWERED", "PostedRequests", "refusal_code", "refusal_reason"]

#: requests sent without waiting whose answers a client has not taken yet (the
#: sidecar reads up to 64 queued messages of a connection in one wake-up)
MAX_UNANSWERED: Final = 64
#: refused requests of one engine a client keeps for that engine's next poll
MAX_REFUSED: Final = 4096


@dataclass
class _Sent:
    engine_id: str
    request_id: str
    #: the encoded message, for sending it again on a new connection
    data: bytes
    #: the connection it last went out on (another than the current one: behind)
    conn: int
    #: went out on an earlier connection, which closed without answering it
    resent: bool = False
    #: a batch's items' request ids, in order (empty: one request, ``request_id``)
    items: tuple[str, ...] = ()


class PostedRequests:
    """The reads and holds a client sent without waiting, by message id, and the
    refusals not yet polled, by engine. Pure: the client face does the I/O
    and tells the book each new connection and what went out on it."""

    def __init__(self, max_unanswered: int = MAX_UNANSWERED,
                 max_refused: int = MAX_REFUSED) -> None:
        self.max_unanswered = max_unanswered
        self.max_refused = max_refused
        self._sent: dict[int, _Sent] = {}
        self._refused: dict[str, list[Completion]] = {}
        #: the client's current connection (numbered by :meth:`new_connection`)
        self._conn = 0
        #: unanswered requests not yet sent on the current connection
        self.behind = 0
        #: parked polls: message id -> engine, and engine -> (message id, when parked)
        self._parked: dict[int, str] = {}
        self._parked_of: dict[str, tuple[int, float]] = {}
        #: the answers of parked polls, by engine, until its next poll
        self._pushed: dict[str, Completions | Error | SidecarError] = {}

    def __len__(self) -> int:
        """Requests sent and not answered yet."""
        return len(self._sent)

    def __contains__(self, msg_id: int) -> bool:
        return msg_id in self._sent

    @property
    def full(self) -> bool:
        """As many requests await answers as may: take answers before sending more."""
        return len(self._sent) >= self.max_unanswered

    @property
    def due(self) -> int:
        """Requests sent on the current connection and not answered yet: the
        answers that connection still owes."""
        return len(self._sent) - self.behind

    def check_room(self, engine_id: str) -> None:
        """Raise Unavailable when ``max_refused`` refusals of ``engine_id`` wait
        for its poll."""
        waiting = len(self._refused.get(engine_id, ()))
        if waiting >= self.max_refused:
            raise Unavailable(UNAVAILABLE, (
                f"{waiting} reads or holds of engine {engine_id[:200]!r} sent without waiting "
                "were refused and wait for poll() to report them, the limit; poll, then "
                "send again"))

    def add(self, req: Read | Hold | Batch | Poll, data: bytes, now: float = 0.0) -> None:
        """``req`` (encoded as ``data``) goes out now on the current connection;
        its answer comes later. A :class:`Batch` is of one engine's reads or
        holds; each item refused becomes a refusal of its own. A :class:`Poll`
        is parked (:meth:`park`)."""
        if isinstance(req, Poll):
            self.park(req, now)
        elif isinstance(req, Batch):
            items = tuple(r.request_id for r in req.requests)
            engine_id = req.requests[0].engine_id if req.requests else ""
            self._sent[req.id] = _Sent(engine_id, "", data, self._conn, items=items)
        else:
            self._sent[req.id] = _Sent(req.engine_id, req.request_id, data, self._conn)

    def park(self, req: Poll, now: float = 0.0) -> None:
        """``req`` goes out ``now``, parked: its answer comes when the sidecar has
        something for its engine (or its wait ends)."""
        self._parked[req.id] = req.engine_id
        self._parked_of[req.engine_id] = (req.id, now)

    def parked(self, engine_id: str) -> bool:
        """A poll of ``engine_id`` is parked at the sidecar, its answer not in yet."""
        return engine_id in self._parked_of

    def overdue(self, engine_id: str, now: float, after_s: float) -> bool:
        """The poll of ``engine_id`` was parked more than ``after_s`` before ``now``
        and is still unanswered: forgotten here (a late answer is stale), and
        the caller says the sidecar did not answer."""
        parked = self._parked_of.get(engine_id)
        if parked is None or now - parked[1] <= after_s:
            return False
        self._drop_parked(parked[0])
        return True

    def _drop_parked(self, msg_id: int) -> str | None:
        """Forget the parked poll ``msg_id``: its engine, or None if it is none."""
        engine_id = self._parked.pop(msg_id, None)
        if engine_id is not None:
            del self._parked_of[engine_id]
        return engine_id

    def unpark(self) -> None:
        """The connection went: its parked polls are never answered (what they
        would have brought, unacknowledged, comes with the next poll)."""
        self._parked.clear()
        self._parked_of.clear()

    def forget_polls(self, engine_id: str) -> None:
        """``engine_id`` registered anew: what a poll parked before brought, or
        will bring, is the old registration's (stale)."""
        self._pushed.pop(engine_id, None)
        parked = self._parked_of.get(engine_id)
        if parked is not None:
            self._drop_parked(parked[0])

    def take_pushed(self, engine_id: str) -> Completions | Error | SidecarError | None:
        """The answer a parked poll of ``engine_id`` brought, once."""
        return self._pushed.pop(engine_id, None)

    def discard(self, msg_id: int) -> None:
        """Message ``msg_id`` did not go out after all: forget it."""
        if self._drop_parked(msg_id) is not None:
            return
        sent = self._sent.pop(msg_id, None)
        if sent is not None and sent.conn != self._conn:
            self.behind -= 1

    def answered(self, msg_id: int, outcome: Reply | SidecarError) -> bool:
        """Take the answer to message ``msg_id`` if it is one of these requests
        (True), else leave it to its caller (False)."""
        engine_id = self._drop_parked(msg_id)
        if engine_id is not None:
            if isinstance(outcome, (Completions, Error, SidecarError)):
                self._pushed[engine_id] = outcome
            else:
                self._pushed[engine_id] = BadMessage(
                    BAD_MESSAGE, f"a poll was answered with a {type(outcome).__name__}")
            return True
        sent = self._sent.pop(msg_id, None)
        if sent is None:
            return False
        if sent.conn != self._conn:
            self.behind -= 1  # answered on a connection closed since: counted, not owed
        if isinstance(outcome, Replies) and sent.items:
            for i, rid in enumerate(sent.items):  # a batch: item by item, in order
                item = outcome.items[i] if i < len(outcome.items) else None
                if item is None:
                    self.refuse(sent.engine_id, rid, "the sidecar's answer to its batch "
                                                     "left it out")
                elif isinstance(item, Error) and not (sent.resent and item.code == DUPLICATE):
                    self.refuse(sent.engine_id, rid, refusal_reason(item))
            return True
        if not isinstance(outcome, (Error, SidecarError)):
            return True  # accepted: its completion comes from the sidecar
        if sent.resent and outcome.code == DUPLICATE:
            return True  # its first copy was taken before the connection closed
        self._refuse(sent, refusal_reason(outcome))
        return True

    def _refuse(self, sent: _Sent, reason: str) -> None:
        for rid in sent.items or (sent.request_id,):
            self.refuse(sent.engine_id, rid, reason)

    def refuse(self, engine_id: str, request_id: str, reason: str) -> None:
        """Report ``request_id`` of ``engine_id`` ``failed`` (``reason``) at its
        next poll: a request the sidecar refused (or never read)."""
        self._refused.setdefault(engine_id, []).append(
            Completion(request_id, "failed", reason=reason))

    def has_refused(self, engine_id: str) -> bool:
        return bool(self._refused.get(engine_id))

    def take_refused(self, engine_id: str) -> list[Completion]:
        """The refusals of ``engine_id``'s requests, each returned once."""
        return self._refused.pop(engine_id, [])

    def new_connection(self) -> None:
        """The last connection closed (the sidecar closed it: what it left
        unanswered it never read); a new one starts. Every unanswered request
        is now behind: :meth:`unsent` gives them, in the order first sent."""
        self._conn += 1
        for sent in self._sent.values():
            sent.resent = True
        self.behind = len(self._sent)

    def unsent(self) -> list[tuple[int, bytes]]:
        """(message id, message) of the unanswered requests not yet sent on the
        current connection, in the order first sent."""
        return [(i, s.data) for i, s in sorted(self._sent.items()) if s.conn != self._conn]

    def sent_again(self, msg_id: int) -> None:
        """Message ``msg_id`` of :meth:`unsent` went out on the current connection."""
        sent = self._sent.get(msg_id)
        if sent is not None and sent.conn != self._conn:
            sent.conn = self._conn
            self.behind -= 1

    def not_sent_again(self, msg_id: int) -> None:
        """Undo :meth:`sent_again`: its send failed, it is still behind."""
        sent = self._sent.get(msg_id)
        if sent is not None and sent.conn == self._conn:
            sent.conn = self._conn - 1
            self.behind += 1

    def fail_behind(self, reason: str) -> None:
        """Report ``failed`` (``reason``) every unanswered request not sent on the
        current connection: the sidecar never read them (it closed their
        connection), and they will not be sent again."""
        for msg_id, sent in list(self._sent.items()):
            if sent.conn != self._conn:
                self._refuse(sent, reason)
                del self._sent[msg_id]
        self.behind = 0

    def drop_due(self) -> None:
        """Forget the unanswered requests sent on the current connection, never to
        send or report them: the sidecar read them (its connection ended
        without a reset) and their completions, if any, come from it."""
        for msg_id in [i for i, sent in self._sent.items() if sent.conn == self._conn]:
            del self._sent[msg_id]

    def drop_unanswered(self) -> None:
        """Forget the requests still unanswered, never to send or report them: the
        sidecar may still handle them (their connection's queue), and their
        completions, if any, come from it."""
        self._sent.clear()
        self.behind = 0

    def forget(self) -> None:
        """Drop everything: a forked child's client starts with its own book (the
        requests are its parent's, and so are their answers and refusals)."""
        self.drop_unanswered()
        self._refused.clear()
        self.unpark()
        self._pushed.clear()

    def forget_engine(self, engine_id: str) -> None:
        """``engine_id`` deregistered: nobody polls its refusals (or what a
        parked poll of it brought) any more."""
        self._refused.pop(engine_id, None)
        self._pushed.pop(engine_id, None)


_REFUSED: Final = "refused by the sidecar ("


def refusal_reason(err: Error | SidecarError) -> str:
    """How a refusal reads in the ``failed`` completion it becomes."""
    return f"{_REFUSED}{err.code}): {err.message}"


def refusal_code(c: Completion) -> str:
    """The error code of the refusal a ``failed`` completion reports (one this
    book made of an ``Error``: :func:`refusal_reason`), or '' for any other
    completion. ``unknown_engine``: the sidecar has no registration of the
    engine (it restarted, or released it), so nothing else of it is in
    flight there either."""
    if c.kind != "failed" or not c.reason.startswith(_REFUSED):
        return ""
    code, sep, _ = c.reason[len(_REFUSED):].partition("): ")
    return code if sep else ""
