"""D side: a verified read's digest requests to P and the comparison of what
landed (``--verify-bytes`` or ``Read.verify``; see :mod:`~kvsidecar.daemon.verify`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvsidecar.daemon import digest, verify
from kvsidecar.daemon.d_side.addresses import I64
from kvsidecar.daemon.d_side.job import ReadJob
from kvsidecar.daemon.d_side.rank import ReaderRank
from kvsidecar.daemon.peers.control import Digest
from kvsidecar.daemon.peers.links import Peer
from kvsidecar.daemon.planner import ReadPlan
from kvsidecar.metrics.registry import Metrics


def ask_digests(eng: ReaderRank, job: ReadJob, cands: Sequence[int], peers: list[Peer],
                plan: ReadPlan) -> list[verify.Asked]:
    """Ask each P rank this read takes bytes from for the digest of its pieces."""
    assert job.verify is not None
    req = job.req
    r = req.remote
    rid = req.remote_request_id or req.request_id
    agents = {p: peer.info.agent_name for p, peer in zip(cands, peers)}

    def request(rank: int, ranges: bytes, chunk_bytes: int) -> Digest:
        return Digest(engine_id=r.engine_id, tp_rank=rank, agent_name=agents[rank],
                      request_id=rid, reader_engine=eng.engine_id, reader_rank=eng.tp_rank,
                      reader_tp=eng.layout.tp_size, ranges=ranges, chunk_bytes=chunk_bytes,
                      token=req.remote_tokens[rank] if rank < len(req.remote_tokens) else "")

    return verify.ask(job.verify, plan, {p: r.handshake[p] for p in cands}, request)


def landing(eng: ReaderRank, job: ReadJob, parts: Sequence[asyncio.Future[Any]],
            pieces: Sequence[tuple[I64, I64, I64]]) -> asyncio.Future[bytes]:
    """Hash each pipelined part (:func:`~kvsidecar.daemon.d_side.parts.pipeline`)
    as it lands, beside the next part's copy."""
    assert job.verify is not None
    return verify.landing(job.verify, eng.engine_id, job.req.request_id,
                          digest.digester_for(eng.info.mem_type),
                          [r.numpy() for r in eng.regions], parts, pieces)


async def verified(eng: ReaderRank, job: ReadJob, asked: list[verify.Asked],
                   metrics: Metrics | None,
                   landed: asyncio.Future[bytes] | None = None) -> None:
    """Hash what landed and compare with P's digests (counted); raises
    :class:`~kvsidecar.daemon.verify.VerifyFailed` when they differ or P gave none."""
    assert job.verify is not None
    views = [r.numpy() for r in eng.regions]
    try:
        nbytes = await verify.check(job.verify, eng.engine_id, job.req.request_id,
                                    digest.digester_for(eng.info.mem_type), views, asked,
                                    landed)
    except verify.VerifyFailed as e:
        if metrics is not None:
            metrics.verify_failures.labels(eng.engine_id, e.reason).inc()
        raise
    if metrics is not None:
        metrics.verified_bytes.labels(eng.engine_id).inc(nbytes)
