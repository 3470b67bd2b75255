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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.peers.control import Claim
from kvsidecar.daemon.peers.messages import HandshakeFailed
from kvsidecar.ipc.protocol import KeepItem

log = logging.getLogger(__name__)


def ranks_kept(p_tp: int, d_tp: int, d_rank: int) -> range:
    """The P ranks D rank ``d_rank`` keeps: ``p % d_tp == d_rank``. Every P rank
    is kept by exactly one D rank (a claim lengthens the whole hold of that
    P rank, whoever reads it), and none twice."""
    return range(d_rank, p_tp, d_tp)


async def keep(client: HandshakeClient, items: Sequence[KeepItem], reader_engine: str,
               reader_rank: int, reader_tp: int) -> int:
    """Claim a lease on every item's hold at the P ranks this rank keeps; the
    number of claims P granted (never raises)."""
    sent = []
    for item in items:
        r = item.remote
        for p in ranks_kept(r.tp_size, reader_tp, reader_rank):
            if p < len(r.handshake):
                token = item.remote_tokens[p] if p < len(item.remote_tokens) else ""
                sent.append(_claim(client, r.handshake[p], r.engine_id, p,
                                   item.remote_request_id, reader_engine, reader_rank,
                                   reader_tp, token))
    if not sent:
        return 0
    return sum(await asyncio.gather(*sent))


async def _claim(client: HandshakeClient, address: str, engine_id: str, rank: int,
                 request_id: str, reader_engine: str, reader_rank: int,
                 reader_tp: int, token: str) -> bool:
    try:
        info = await client.fetch(address, engine_id, rank)
        reply, _ = await client.control(address, Claim(
            engine_id=engine_id, tp_rank=rank, agent_name=info.agent_name,
            request_id=request_id, reader_engine=reader_engine, reader_rank=reader_rank,
            reader_tp=reader_tp, keep=True, token=token))
    except HandshakeFailed as e:
        log.info("keeping request %r at P rank %d (%s): %s", request_id, rank, address,
                 e.reason)
        return False
    except Exception as e:  # a bad address or anything else: logged, never raised
        log.info("keeping request %r at P rank %d (%r): %s", request_id, rank,
                 address[:200], e)
        return False
    if not reply.granted:
        if reply.stale_link:
            client.forget(address, engine_id)  # P re-registered: fetch its info again
        log.info("P rank %d at %s refused to keep request %r: %s", rank, address, request_id,
                 reply.reason)
    return reply.granted
