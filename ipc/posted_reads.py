"""Reads sent without waiting for their answer (``read_nowait``): the client's
bookkeeping of them, without I/O.

A read sent so is the same :class:`~.protocol.Read` message a blocking
``read`` sends; only its answer is taken later, whenever the client next
receives (any call, or ``poll``). The book remembers each such read until
that answer comes:

- ``Ok``: accepted. Forgotten here; its completion comes from the sidecar
  through ``poll``, as any read's.
- an ``Error``: refused, nothing was started. It becomes a ``failed``
  completion of that request id, which the engine's next ``poll`` of its
  engine returns ahead of the sidecar's own (reason: the refusal's code and
  message; no block was written, so none is listed invalid).

No read is lost to a connection the sidecar closes: the answers still queued
on it are taken first, and the reads it left unanswered are sent again on the
next connection (:meth:`PostedReads.resend`), as a blocking call's request
is. A read sent twice so can meet ``duplicate`` the second time: its first
copy was taken (the sidecar answers in order, and a closed connection's
queued answers were read) and its completion comes as usual, so that refusal
is dropped.

Bounded: at most ``max_unanswered`` reads await their answers (a client takes
answers, waiting if it must, before it sends more) and at most
``max_refused`` refusals await a poll; past that :meth:`check_room` raises
:class:`~.errors.Unavailable` (the engine polls, then sends again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from .errors import SidecarError, Unavailable
from .protocol import DUPLICATE, UNAVAILABLE, Completion, Error, Read, Reply

__all__ = ["MAX_REFUSED", "MAX_UNANSWERED", "PostedReads"]

#: reads sent without waiting whose answers a client has not taken yet (the
#: sidecar reads up to 64 queued messages of a connection in one wake-up)
MAX_UNANSWERED: Final = 64
#: refused reads a client keeps for the engine's next poll
MAX_REFUSED: Final = 4096


@dataclass
class _Sent:
    engine_id: str
    request_id: str
    #: the encoded message, for sending it again on a new connection
    data: bytes
    #: sent again after its connection closed unanswered
    resent: bool = False


class PostedReads:
    """The reads a client sent without waiting, by message id, and the
    refusals not yet polled, by engine. Pure: the client face does the I/O."""

    def __init__(self, max_unanswered: int = MAX_UNANSWERED,
                 max_refused: int = MAX_REFUSED) -> None:
        self.max_unanswered = max_unanswered
        self.max_refused = max_refused
        self._sent: dict[int, _Sent] = {}
        self._refused: dict[str, list[Completion]] = {}
        self._refused_count = 0

    def __len__(self) -> int:
        """Reads sent and not answered yet."""
        return len(self._sent)

    @property
    def full(self) -> bool:
        """As many reads await answers as may: take answers before sending more."""
        return len(self._sent) >= self.max_unanswered

    def check_room(self) -> None:
        """Raise Unavailable when ``max_refused`` refusals wait for a poll."""
        if self._refused_count >= self.max_refused:
            raise Unavailable(UNAVAILABLE, (
                f"{self._refused_count} reads sent without waiting were refused and wait "
                "for poll() to report them, the limit; poll, then send again"))

    def add(self, req: Read, data: bytes) -> None:
        """``req`` (encoded as ``data``) is being sent; its answer comes later."""
        self._sent[req.id] = _Sent(req.engine_id, req.request_id, data)

    def answered(self, msg_id: int, outcome: Reply | SidecarError) -> bool:
        """Take the answer to message ``msg_id`` if it is one of these reads
        (True), else leave it to its caller (False)."""
        sent = self._sent.pop(msg_id, None)
        if sent is None:
            return False
        if not isinstance(outcome, (Error, SidecarError)):
            return True  # accepted: its completion comes from the sidecar
        code, message = outcome.code, outcome.message
        if sent.resent and code == DUPLICATE:
            return True  # its first copy was taken before the connection closed
        self._refused.setdefault(sent.engine_id, []).append(Completion(
            sent.request_id, "failed", reason=f"refused by the sidecar ({code}): {message}"))
        self._refused_count += 1
        return True

    def discard(self, msg_id: int) -> None:
        """Message ``msg_id`` was not sent after all: forget it."""
        self._sent.pop(msg_id, None)

    def drop_unanswered(self) -> None:
        """Forget the reads still unanswered (their client closed): never sent
        again; the refusals already taken stay for a poll."""
        self._sent.clear()

    def __contains__(self, msg_id: int) -> bool:
        return msg_id in self._sent

    def has_refused(self, engine_id: str) -> bool:
        return bool(self._refused.get(engine_id))

    def take_refused(self, engine_id: str) -> list[Completion]:
        """The refusals of ``engine_id``'s reads, each returned once."""
        out = self._refused.pop(engine_id, [])
        self._refused_count -= len(out)
        return out

    def resend(self) -> list[bytes]:
        """The unanswered reads' messages, in the order they were sent, for a new
        connection (the last one closed without answering them)."""
        out = []
        for _, sent in sorted(self._sent.items()):
            sent.resent = True
            out.append(sent.data)
        return out

    def forget(self) -> None:
        """Drop everything: a forked child's client starts with its own book (the
        reads are its parent's, and so are their answers)."""
        self._sent.clear()
        self._refused.clear()
        self._refused_count = 0
