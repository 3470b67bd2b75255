"""P's answer to a reader's digest request (``--verify-bytes``, see daemon/verify.py).

The pieces a reader names are hashed when a live hold of that request pins
every page they touch and the reader holds the hold's token; a hold not
placed yet (its claim came early) is refused with ``retry`` and the reader
asks again (P never waits: a peer's request costs no task here). At most
``MAX_DIGESTS_IN_FLIGHT`` requests and ``MAX_DIGEST_BYTES_IN_FLIGHT`` bytes
are hashed or queued at once; past either, a counted refusal with ``retry``.
"""

from __future__ import annotations

import logging

import msgspec

from kvsidecar.daemon import digest
from kvsidecar.daemon.engines.table import EngineTable
from kvsidecar.daemon.p_side.checks import linked_engine, token_digest
from kvsidecar.daemon.peers import control as peer_control
from kvsidecar.daemon.peers.control import ControlReply, Digest
from kvsidecar.daemon.verify import MAX_DIGEST_BYTES_IN_FLIGHT, MAX_DIGESTS_IN_FLIGHT, Hashing
from kvsidecar.metrics.registry import Metrics

log = logging.getLogger(__name__)


class Digests:
    def __init__(self, table: EngineTable, hashing: Hashing, metrics: Metrics) -> None:
        self.table = table
        self.hashing = hashing
        self.metrics = metrics
        #: digest requests being hashed (or queued to be), and their bytes
        self.open = 0
        self.bytes = 0

    async def answer(self, msg: Digest) -> bytes:
        """The encoded reply to one digest request, counted; never raises."""
        try:
            reply = await self._reply(msg)
        except Exception as e:
            log.exception("answering a digest for %r failed", msg.request_id[:200])
            reply = ControlReply(granted=False, reason=f"internal error: {type(e).__name__}")
        self.metrics.series(self.metrics.lease_requests, "digest",
                            "granted" if reply.granted else "refused").inc()
        return peer_control.encode(msgspec.structs.replace(reply, req_id=msg.req_id))

    async def _reply(self, msg: Digest) -> ControlReply:
        eng = linked_engine(self.table, msg)
        if isinstance(eng, ControlReply):
            return eng
        # As a claim: only the reader the hold issued its token to may ask.
        checked = token_digest(eng, msg, "digest")
        if isinstance(checked, ControlReply):
            return checked
        try:
            digester = digest.digester_for(eng.info.mem_type)
        except digest.DigestUnavailable as e:
            return ControlReply(granted=False, reason=str(e))
        blocks = eng.holds.blocks(msg.engine_id, msg.request_id)
        if blocks is None and eng.holds.waiting(msg.engine_id, msg.request_id):
            return ControlReply(granted=False, retry=True, reason=(
                f"the hold of request {msg.request_id[:200]!r} is not placed yet"))
        if blocks is None:
            return ControlReply(granted=False, reason=(
                f"no live hold of request {msg.request_id[:200]!r} pins blocks of engine "
                f"{msg.engine_id[:200]!r} here"))
        layout = eng.layout
        try:
            region, offset, length = digest.unpack_ranges(msg.ranges)
            digest.check_ranges(region, offset, length, num_regions=layout.num_regions,
                                region_bytes=layout.region_bytes, page_bytes=layout.page_bytes,
                                held_pages=digest.held_pages(blocks))
            if digest.chunk_count(length, msg.chunk_bytes) > digest.MAX_CHUNKS:
                raise digest.BadRanges(f"more than {digest.MAX_CHUNKS} chunks of "
                                       f"{msg.chunk_bytes} B")
        except digest.BadRanges as e:
            return ControlReply(granted=False, reason=f"digest refused: {e}")
        nbytes = int(length.sum())
        busy = self._busy(nbytes)
        if busy is not None:
            return busy
        self.open += 1
        self.bytes += nbytes
        try:
            out = await self.hashing.run(eng.engine_id, digester,
                                         [r.numpy() for r in eng.regions], region, offset,
                                         length, msg.chunk_bytes, threads=1)
        finally:
            self.open -= 1
            self.bytes -= nbytes
        if eng.holds.blocks(msg.engine_id, msg.request_id) is None:
            return ControlReply(granted=False, reason=(
                f"the hold of {msg.request_id[:200]!r} ended while its bytes were hashed"))
        return ControlReply(granted=True, digest=out)

    def _busy(self, nbytes: int) -> ControlReply | None:
        """The refusal (``retry``, counted under no engine's label: a peer's input)
        when hashing ``nbytes`` more would pass the bounds; one request is always
        admitted whatever its size."""
        if self.open >= MAX_DIGESTS_IN_FLIGHT or (
                self.open and self.bytes + nbytes > MAX_DIGEST_BYTES_IN_FLIGHT):
            self.metrics.limit_refusals.labels("", "digests").inc()
            return ControlReply(granted=False, retry=True, reason=(
                f"{self.open} digests of {self.bytes} B are being hashed here "
                f"(at most {MAX_DIGESTS_IN_FLIGHT}, {MAX_DIGEST_BYTES_IN_FLIGHT} B); retry later"))
        return None
