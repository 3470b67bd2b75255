"""P's answers to readers' control messages: claims, renewals, abandons, digests.

``answer(frame, member)`` is the handshake server's control callback. A
batch is answered item by item: one refused (or failing) item never refuses
the others; only an undecodable message is refused whole, with one plain
reply. Each item is checked against the rank the reader linked to and the
hold token it carries (:mod:`.checks`), then applied to that rank's holds
(:class:`~kvsidecar.daemon.holds.HoldBook`). Digests are :mod:`.digests`'.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from kvsidecar.daemon.engines.rank import EngineRank
from kvsidecar.daemon.engines.table import EngineTable
from kvsidecar.daemon.holds import Report
from kvsidecar.daemon.p_side.checks import linked_engine, token_digest
from kvsidecar.daemon.p_side.digests import Digests
from kvsidecar.daemon.peers import control as peer_control
from kvsidecar.daemon.peers.control import (
    Abandon,
    Claim,
    ControlBatch,
    ControlBatchReply,
    ControlReply,
    ControlRequest,
    Digest,
)
from kvsidecar.daemon.transport.worker import NixlError
from kvsidecar.ipc.hold_token import Issued
from kvsidecar.metrics.registry import Metrics

log = logging.getLogger(__name__)

#: The metric label of each control item kind.
_CONTROL_OPS: dict[type[ControlRequest], str] = {Claim: "claim", Abandon: "abandon"}
#: a granted claim puts the NIXL worker on its soon poll only with this many holds or
#: fewer (one read at a time is latency-bound; many keep the worker going round anyway)
_SOON_MAX_HOLDS = 2

Answer = bytes | Awaitable[bytes]


class ControlAnswers:
    def __init__(self, table: EngineTable, digests: Digests, metrics: Metrics) -> None:
        self.table = table
        self.digests = digests
        self.metrics = metrics
        #: one answer per message type (decode_request returns exactly these)
        self._by_type: dict[type, Callable[[Any, bytes], Answer]] = {
            Digest: lambda msg, _member: self.digests.answer(msg),
            ControlBatch: self._batch, Claim: self._single, Abandon: self._single,
        }

    def answer(self, frame: bytes, member: bytes = b"") -> Answer:
        """Answer a reader's claim, abandon, digest, or batch of claims and abandons."""
        try:
            msg = peer_control.decode_request(frame)
        except peer_control.BadControl as e:
            op = "batch" if peer_control.op_of(frame) == "batch" else "unknown"
            self.metrics.lease_requests.labels(op=op, result="bad").inc()
            return peer_control.encode(ControlReply(
                granted=False, reason=str(e), req_id=peer_control.request_id_of(frame)))
        return self._by_type[type(msg)](msg, member)

    def _batch(self, msg: ControlBatch, member: bytes) -> bytes:
        self.metrics.series(self.metrics.control_items, "answered").observe(len(msg.items))
        return peer_control.encode(ControlBatchReply(
            replies=[self._answer_item(item, member) for item in msg.items],
            req_id=msg.req_id))

    def _single(self, msg: ControlRequest, member: bytes) -> bytes:
        self.metrics.series(self.metrics.control_items, "answered").observe(1)
        return peer_control.encode(self._answer_item(msg, member))

    def _answer_item(self, msg: ControlRequest, member: bytes) -> ControlReply:
        """The reply to one claim or abandon, counted; never raises."""
        op = _CONTROL_OPS[type(msg)]
        if msg.v != peer_control.CONTROL_VERSION:
            reply = ControlReply(granted=False, reason=(
                f"control item v{msg.v}, this side speaks v{peer_control.CONTROL_VERSION}"))
        else:
            try:
                reply = self._control_reply(msg, member)
            except Exception as e:  # one bad item must not cost the others their answers
                log.exception("answering a %s for %r failed", op, msg.request_id[:200])
                reply = ControlReply(granted=False, reason=f"internal error: {type(e).__name__}")
        self.metrics.series(self.metrics.lease_requests, op,
                            "granted" if reply.granted else "refused").inc()
        return msgspec.structs.replace(reply, req_id=msg.req_id)

    def _control_reply(self, msg: ControlRequest, member: bytes) -> ControlReply:
        eng = linked_engine(self.table, msg)
        if isinstance(eng, ControlReply):
            return eng
        issued = token_digest(eng, msg, _CONTROL_OPS[type(msg)])
        if isinstance(issued, ControlReply):
            return issued
        if isinstance(msg, Claim):
            forgotten = eng.holds.forgotten_refused
            reply = _claim(eng, msg, issued, member)
            if eng.holds.forgotten_refused != forgotten:
                # no hold, and why it ended is no longer remembered (see daemon.holds)
                self.metrics.limit_refusals.labels(eng.engine_id, "ended_holds").inc()
            return reply
        return _abandon(eng, msg, member)


def _claim(eng: EngineRank, msg: Claim, issued: Issued, member: bytes) -> ControlReply:
    """Grant (or refuse) a claim or renewal of a hold's lease."""
    lease = eng.holds.claim(msg.engine_id, msg.request_id, time.monotonic(),
                            digest=issued.digest, member=member,
                            reader=(msg.reader_engine, msg.reader_rank),
                            may_precede=not issued.by_sidecar)
    if lease.granted and not msg.keep:
        # The reader posts its READ when this reply arrives: progress tightly
        # while its lease runs (wire-up, its READ's closing flush, and over
        # TCP the bytes, need us, unless NIXL's progress thread runs: then
        # only notifications are polled for, see NixlWorker.expect_reads).
        # Told once this reply has left: waking the worker thread now would
        # contend for the GIL with the reply.
        # Few holds: this read is worth the worker's 50 us poll; many: the
        # worker is busy anyway (see transport.poll_policy.PollPacer.imminent).
        asyncio.get_running_loop().call_soon(
            functools.partial(eng.worker.expect_reads, lease.lease_s,
                              soon=len(eng.holds) <= _SOON_MAX_HOLDS))
    return ControlReply(granted=lease.granted, lease_s=lease.lease_s, reason=lease.reason)


def _abandon(eng: EngineRank, msg: Abandon, member: bytes) -> ControlReply:
    """Report a reader's abandon to the hold, once the worker took what NIXL has."""
    reader = (msg.reader_engine, msg.reader_rank)
    refused = eng.holds.may_report(msg.engine_id, msg.request_id, reader, member)
    if refused:
        return ControlReply(granted=False, reason=f"abandon refused: {refused}")
    report = Report(msg.reader_engine, msg.reader_rank, msg.reader_tp,
                    msg.reason or "abandoned by the reader")

    def apply(done: asyncio.Future[Any] | None = None) -> None:
        if done is not None and not done.cancelled():
            done.exception()  # a worker that stopped meanwhile changes nothing here
        eng.holds.report(msg.engine_id, msg.request_id, report, time.monotonic(), member)
        eng.worker.set_hot(len(eng.holds) > 0)

    # The reader may have sent its read's completion notification (over NIXL)
    # before this abandon (over ZMQ): apply the abandon only after the worker
    # took what NIXL has for us, so a read that finished counts as finished
    # however deeply the worker slept.
    try:
        eng.worker.progressed().add_done_callback(apply)
    except NixlError:  # the worker is stopping: nothing more will arrive
        apply()
    return ControlReply(granted=True)
