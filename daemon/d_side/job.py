"""D side: one read's record (:class:`ReadJob`) and the facts a read checks
before it posts: its tokens, its P ranks' layouts, its claims; how its
outcome becomes the engine's completion; how an exception is classified for
the retry policy (:meth:`~kvsidecar.daemon.d_side.book.ReadBook.retry`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from kvsidecar.daemon import verify
from kvsidecar.daemon.d_side.book import AbortAction, Completed, Failure, ReadBook
from kvsidecar.daemon.d_side.rank import ReaderRank
from kvsidecar.daemon.leases import LeaseRefused, ReaderLeases
from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.peers.control import Claim
from kvsidecar.daemon.peers.links import Peer
from kvsidecar.daemon.tracing import Tracing
from kvsidecar.daemon.transport.worker import (
    NixlAgentReset,
    NixlError,
    NixlKilledByReset,
    NixlTimeout,
    TransferStats,
)
from kvsidecar.ipc import hold_token
from kvsidecar.ipc.layout import Layout
from kvsidecar.ipc.protocol import Completion, Read, TransferReport
from kvsidecar.metrics.registry import Metrics


class PartialReadError(RuntimeError):
    """Some P ranks were read and notified, others failed: never retried."""


@dataclass
class ReadJob:
    """One accepted read: its request, its :class:`ReadBook` (state, abort,
    notified, retries, deadline) and what its driver holds for it."""

    req: Read
    book: ReadBook = field(default_factory=lambda: ReadBook(time.monotonic()))
    peers: list[Peer] = field(default_factory=list)
    #: links this read holds (PeerLinks.get(user=...)); released when it ends
    links: list[Peer] = field(default_factory=list)
    leases: ReaderLeases | None = None
    task: asyncio.Task[None] | None = None
    #: the request's kvsidecar.read span and its tracer (None when tracing is off)
    span: Any = None
    tracing: Tracing | None = None
    #: how to abort it before posting when it shares its task with other reads
    #: (a group, see :mod:`.driver`): cancelling the task would abort them all
    on_abort: Callable[[ReadJob], None] | None = None
    #: set when its bytes are verified (``--verify-bytes`` or ``Read.verify``)
    verify: verify.Verifier | None = None
    #: its hold tokens were presented by an earlier read on this sidecar: it is
    #: never posted during its claim (see spent_tokens.py)
    replayed: bool = False

    @property
    def accepted_at(self) -> float:
        return self.book.accepted_at

    @property
    def posted(self) -> bool:
        return self.book.posted

    @property
    def ended(self) -> bool:
        """Its completion is out."""
        return self.book.ended

    @property
    def notified(self) -> bool:
        """Its notifications went out: P ends the holds ``sent``."""
        return self.book.notified

    @property
    def abort_reason(self) -> str | None:
        return self.book.abort_reason

    @property
    def trace_id(self) -> str:
        """The id both P and D know (the prefill request id): it names the trace."""
        return self.req.remote_request_id or self.req.request_id

    def abort(self, reason: str) -> None:
        """Abort now if nothing is posted yet; else report ``aborted`` once transfers end."""
        if self.book.abort(reason) is not AbortAction.CANCEL:
            return
        if self.on_abort is not None:
            self.on_abort(self)
        elif self.task is not None:
            self.task.cancel()


@dataclass
class Attempt:
    """One attempt of one read: the read and what each of its steps uses."""

    eng: ReaderRank
    job: ReadJob
    #: the planning thread (staged bytes are scattered there too)
    planner: Executor
    timeout_s: float | None = None
    metrics: Metrics | None = None
    #: where claims go; None: the read holds no leases
    handshakes: HandshakeClient | None = None
    #: the candidate P ranks and their links, once linked
    cands: Sequence[int] = ()
    peers: list[Peer] = field(default_factory=list)


@dataclass(frozen=True)
class ReadOutcome:
    nbytes: int
    descriptors: int
    descriptors_before: int
    stats: list[TransferStats]
    #: one per remote rank that bytes were read from (what the completion reports)
    transfers: list[TransferReport] = field(default_factory=list)


def claims_of(handshakes: HandshakeClient, eng: ReaderRank, req: Read,
              ranks: Iterable[tuple[int, str]]) -> ReaderLeases:
    """The leases ``req`` claims from P: one claim per ``(P rank, its agent
    name)`` (an empty name where no link is known; P then skips the agent
    check), on the hold under the request id P knows it by."""
    r = req.remote
    rid = req.remote_request_id or req.request_id
    return ReaderLeases(handshakes, [
        (r.handshake[p], Claim(
            engine_id=r.engine_id, tp_rank=p, agent_name=agent, request_id=rid,
            reader_engine=eng.engine_id, reader_rank=eng.tp_rank,
            reader_tp=eng.layout.tp_size,
            token=req.remote_tokens[p] if p < len(req.remote_tokens) else ""))
        for p, agent in ranks])


def check_tokens(req: Read, cands: Sequence[int], peers: Sequence[Peer], now: float) -> None:
    """Before anything is posted: each P rank read from issued the read's token
    for this request and exactly the blocks it names (checked with the rank's
    checking key from its handshake; see :mod:`~kvsidecar.ipc.hold_token`).
    Raises :class:`~kvsidecar.ipc.hold_token.TokenError` naming the rank."""
    rid = req.remote_request_id or req.request_id
    for p, peer in zip(cands, peers):
        if not peer.info.hold_key:
            raise hold_token.TokenError(f"remote rank {p}'s sidecar issues no hold tokens "
                                        "(an older kvsidecar): upgrade it")
        try:
            hold_token.check_for_reader(peer.info.hold_key, req.remote.engine_id, rid,
                                        req.remote_block_ids, req.remote_tokens[p], now)
        except hold_token.TokenError as e:
            raise hold_token.TokenError(f"remote rank {p}: {e}") from None


def agents_of(cands: Sequence[int], peers: list[Peer]) -> Iterator[tuple[int, str]]:
    """Each candidate P rank with the agent name of its link."""
    return ((p, peer.info.agent_name) for p, peer in zip(cands, peers))


def log_fields(eng: ReaderRank, req: Read, outcome: str, reason: str) -> dict[str, object]:
    """The identifiers a log line of this read carries (JSON log fields)."""
    return {"request_id": req.request_id, "engine": eng.engine_id, "rank": eng.tp_rank,
            "peer": req.remote.engine_id, "outcome": outcome, "reason": reason}


def completion(req: Read, done: Completed, out: ReadOutcome | None = None) -> Completion:
    """The engine's message for the book's :class:`Completed` (``out``: received)."""
    if done.kind == "received":
        assert out is not None
        return Completion(req.request_id, "received", nbytes=out.nbytes,
                          descriptors=out.descriptors, transfers=out.transfers)
    return Completion(req.request_id, done.kind, done.reason,
                      invalid_block_ids=[list(g) for g in req.local_block_ids])


def same_layout(remote_engine: str, cands: Sequence[int], peers: Sequence[Peer]) -> Layout:
    """The remote layout every candidate P rank reports (RuntimeError when they differ)."""
    layout = peers[0].info.layout
    for p, peer in zip(cands[1:], peers[1:]):
        if peer.info.layout != layout:
            raise RuntimeError(
                f"remote engine {remote_engine!r} ranks {cands[0]} and {p} report different "
                "layouts (cache sizes differ between ranks)"
            )
    return layout


#: how the retry policy (:meth:`ReadBook.retry`) sees an exception, first match wins
_FAILURES: tuple[tuple[type[BaseException], Failure], ...] = (
    (PartialReadError, Failure.PARTIAL),
    (hold_token.TokenError, Failure.TOKEN),
    (NixlTimeout, Failure.TIMEOUT),
    (NixlAgentReset, Failure.RESET),
    (NixlKilledByReset, Failure.RESET),
    (NixlError, Failure.TRANSFER),
)


def failure_of(e: BaseException) -> Failure:
    """What an attempt's exception means to the retry policy."""
    if isinstance(e, LeaseRefused):
        return Failure.REFUSED_STALE_LINK if e.stale_link else Failure.REFUSED
    return next((f for cls, f in _FAILURES if isinstance(e, cls)), Failure.OTHER)


#: what a group's read ends with (its outcome, or why it failed), handed to its owner
Settle = Callable[[ReadJob, "ReadOutcome | BaseException"], None]
