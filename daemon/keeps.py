"""D side: keep the holds of requests a decode engine admitted, before it reads them.

A request waits on D between its admission and its read (a busy D queues
it). P frees a hold no reader claimed within its timeout, so D keeps the
holds of the requests it admitted alive: each :class:`~kvsidecar.ipc.protocol.Keep`
the engine sends (every few seconds while they wait) makes this sidecar claim
a lease on each hold, as a read's claim does, at the P ranks this D rank
answers for (:func:`ranks_kept`), flagged ``keep`` so P does not get ready for
a read. When the engine stops sending them (it finished waiting, or it is
gone), P frees the blocks one ``--hold-lease`` after the last claim, or at
the hold's own timeout, whichever is later.

Claims here are best effort: a refused or unanswered one is logged and
changes nothing on this side; the read, when it comes, claims for itself and
fails if P no longer holds the blocks.

Bounded, as everything an engine's input grows: a Keep is checked as a
read's remote is (:func:`check_items`: one handshake address per P rank), one
Keep may ask for at most :data:`MAX_KEEP_CLAIMS_PER_MESSAGE` claims, and the
claims in flight (:class:`KeepBook`) at most
:data:`MAX_KEEP_CLAIMS_PER_ENGINE` per engine and :data:`MAX_KEEP_CLAIMS` in
all. Past a bound the Keep is refused whole (``bad_request`` for one too
large, ``unavailable`` at the in-flight bounds, counted in
``kvsidecar_limit_refusals_total{limit="keep_claims"}``) rather than dropped
unanswered: the engine's connector logs the refusal and keeps again at its
next round, when the claims ahead of it have ended. Before, 4 Keeps naming
512 ranks of a dead address spawned 524,288 claim coroutines, grew the daemon
by 1 GB and delayed another engine's ping by 11 s. The claims of one Keep go
out per P rank: one handshake fetch each, and the claims to its address as
one batch where that sidecar takes batches (the handshake client's outbox).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from kvsidecar.daemon.peers.client import ControlAnswer, HandshakeClient
from kvsidecar.daemon.peers.control import Claim
from kvsidecar.daemon.peers.messages import HandshakeFailed
from kvsidecar.ipc.protocol import (
    BAD_REQUEST,
    MAX_KEEP_CLAIMS_PER_KEEP,
    UNAVAILABLE,
    KeepItem,
    RequestError,
)

log = logging.getLogger(__name__)

#: Claims one Keep may ask for (its items times the P ranks this rank keeps of
#: each): 256 items of a P tp 16 engine kept by one D rank (the protocol's bound).
MAX_KEEP_CLAIMS_PER_MESSAGE = MAX_KEEP_CLAIMS_PER_KEEP
#: Claims of one engine rank's Keeps in flight at once: two rounds of full Keeps
#: (a round's claims to a dead P take the handshake timeout, longer than the
#: connector's 3 s between rounds).
MAX_KEEP_CLAIMS_PER_ENGINE = 2 * MAX_KEEP_CLAIMS_PER_MESSAGE
#: Claims of every engine's Keeps in flight at once.
MAX_KEEP_CLAIMS = 4 * MAX_KEEP_CLAIMS_PER_ENGINE


def ranks_kept(p_tp: int, d_tp: int, d_rank: int) -> range:
    """The P ranks D rank ``d_rank`` keeps: ``p % d_tp == d_rank``. Every P rank
    is kept by exactly one D rank (a claim lengthens the whole hold of that
    P rank, whoever reads it), and none twice."""
    return range(d_rank, p_tp, d_tp)


def check_items(items: Sequence[KeepItem], reader_rank: int, reader_tp: int) -> int:
    """Refuse (``bad_request``) a Keep whose remote is malformed as a read's would
    be, or that asks for more than :data:`MAX_KEEP_CLAIMS_PER_MESSAGE` claims;
    the number of claims it asks for."""
    claims = 0
    for item in items:
        r = item.remote
        if len(r.handshake) != r.tp_size:
            raise RequestError(BAD_REQUEST, f"keep: remote engine {r.engine_id[:200]!r} has "
                                            f"tp_size {r.tp_size} but {len(r.handshake)} "
                                            "handshake addresses")
        if len(item.remote_tokens) > r.tp_size:
            raise RequestError(BAD_REQUEST, f"keep: {len(item.remote_tokens)} hold tokens for "
                                            f"remote engine {r.engine_id[:200]!r} of tp_size "
                                            f"{r.tp_size}")
        claims += len(ranks_kept(r.tp_size, reader_tp, reader_rank))
    if claims > MAX_KEEP_CLAIMS_PER_MESSAGE:
        raise RequestError(BAD_REQUEST, f"keep asks for {claims} claims (items x the P ranks "
                                        f"this rank keeps), over {MAX_KEEP_CLAIMS_PER_MESSAGE} "
                                        "per message: send fewer items per Keep")
    return claims


class KeepBook:
    """The Keep claims in flight, per engine id and in all, within their bounds."""

    def __init__(self, per_engine: int = MAX_KEEP_CLAIMS_PER_ENGINE,
                 total: int = MAX_KEEP_CLAIMS,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.per_engine = per_engine
        self.total_limit = total
        #: told the engine id of each Keep refused at a bound (a metric)
        self._on_refused = on_refused
        self._by_engine: dict[str, int] = {}
        self.total = 0

    def of(self, engine_id: str) -> int:
        return self._by_engine.get(engine_id, 0)

    def admit(self, engine_id: str, claims: int) -> None:
        """Book ``claims`` for ``engine_id``, or refuse (``unavailable``) at a bound."""
        mine = self.of(engine_id)
        if mine + claims > self.per_engine:
            why = (f"engine {engine_id[:200]!r} has {mine} keep claims in flight; {claims} "
                   f"more would pass the limit of {self.per_engine} per engine")
        elif self.total + claims > self.total_limit:
            why = (f"this sidecar has {self.total} keep claims in flight; {claims} more "
                   f"would pass its limit of {self.total_limit}")
        else:
            self._by_engine[engine_id] = mine + claims
            self.total += claims
            return
        if self._on_refused is not None:
            self._on_refused(engine_id)
        raise RequestError(UNAVAILABLE, f"{why}: keep again once they have ended (a keep "
                                        "is a renewal; the next round renews these holds)")

    def done(self, engine_id: str, claims: int) -> None:
        """Give back what :meth:`admit` booked."""
        left = self.of(engine_id) - claims
        if left > 0:
            self._by_engine[engine_id] = left
        else:
            self._by_engine.pop(engine_id, None)
        self.total -= claims


async def keep(client: HandshakeClient, items: Sequence[KeepItem], reader_engine: str,
               reader_rank: int, reader_tp: int) -> int:
    """Claim a lease on every item's hold at the P ranks this rank keeps (the items
    checked by :func:`check_items`); the number of claims P granted (never raises).
    One coroutine per P rank named, not per claim."""
    by_rank: dict[tuple[str, str, int], list[tuple[str, str]]] = {}
    for item in items:
        r = item.remote
        for p in ranks_kept(r.tp_size, reader_tp, reader_rank):
            token = item.remote_tokens[p] if p < len(item.remote_tokens) else ""
            by_rank.setdefault((r.handshake[p], r.engine_id, p), []).append(
                (item.remote_request_id, token))
    if not by_rank:
        return 0
    granted = await asyncio.gather(*(
        _claim_rank(client, address, engine_id, p, claims, reader_engine, reader_rank,
                    reader_tp)
        for (address, engine_id, p), claims in by_rank.items()))
    return sum(granted)


async def _claim_rank(client: HandshakeClient, address: str, engine_id: str, rank: int,
                      claims: list[tuple[str, str]], reader_engine: str, reader_rank: int,
                      reader_tp: int) -> int:
    """The claims of one P rank: its info fetched once, the claims sent together
    (one batch where its sidecar takes them); how many were granted."""
    try:
        info = await client.fetch(address, engine_id, rank)
    except Exception as e:  # HandshakeFailed, a bad address, anything: logged, never raised
        reason = e.reason if isinstance(e, HandshakeFailed) else str(e)
        log.info("keeping %d request(s) at P rank %d (%r): %s", len(claims), rank,
                 address[:200], reason)
        return 0
    sent = [client.control_soon(address, Claim(
        engine_id=engine_id, tp_rank=rank, agent_name=info.agent_name,
        request_id=request_id, reader_engine=reader_engine, reader_rank=reader_rank,
        reader_tp=reader_tp, keep=True, token=token)) for request_id, token in claims]
    answers = await asyncio.gather(*sent, return_exceptions=True)
    granted = 0
    for (request_id, _), answer in zip(claims, answers, strict=True):
        granted += _granted(client, address, engine_id, rank, request_id, answer)
    return granted


def _granted(client: HandshakeClient, address: str, engine_id: str, rank: int,
             request_id: str, answer: ControlAnswer | BaseException) -> bool:
    if isinstance(answer, BaseException):
        if not isinstance(answer, Exception):
            raise answer  # cancelled: not a claim's outcome
        reason = answer.reason if isinstance(answer, HandshakeFailed) else str(answer)
        log.info("keeping request %r at P rank %d (%r): %s", request_id, rank, address[:200],
                 reason)
        return False
    reply, _ = answer
    if not reply.granted:
        if reply.stale_link:
            client.forget(address, engine_id)  # P re-registered: fetch its info again
        log.info("P rank %d at %s refused to keep request %r: %s", rank, address, request_id,
                 reply.reason)
    return reply.granted
