"""Reader agents and the NIXL notifications that end holds.

A handshake request from fleet member ``member`` declares which NIXL agent a
reading engine rank uses (:meth:`Readers.declare`). A notification (one read,
or a batch naming several reads of one transfer) is accepted only from the
agent declared by the member the reader claimed from: anyone who can reach
our NIXL agent can send a notification naming any request, and one member
cannot re-declare another's reader. A malformed batch counts once as ``bad``
and ends nothing; in a well-formed one each read is checked on its own, so a
forged or unknown id is refused alone and the others still end their holds.
"""

from __future__ import annotations

import collections
import logging
import time

from kvsidecar.daemon import notifications
from kvsidecar.daemon.engines.table import EngineTable
from kvsidecar.daemon.p_side.spans import HoldSpans
from kvsidecar.daemon.peers.messages import Reader
from kvsidecar.metrics.registry import Metrics

log = logging.getLogger(__name__)

#: Reader agents remembered from handshakes (one per reading engine rank and target
#: engine); beyond it the oldest is forgotten and counted.
MAX_DECLARED_READERS = 65536


class Readers:
    def __init__(self, table: EngineTable, metrics: Metrics, spans: HoldSpans) -> None:
        self.table = table
        self.metrics = metrics
        self.spans = spans
        #: (target engine, reader engine, reader rank, fleet member) -> the agent that
        #: member declared for that reader in its handshake. Bounded, oldest out.
        self._declared: collections.OrderedDict[tuple[str, str, int, bytes], str] = (
            collections.OrderedDict())

    def declare(self, target_engine: str, reader: Reader, member: bytes) -> None:
        """A handshake request from ``member`` declared which agent a reading
        engine rank uses."""
        key = (target_engine, reader.engine_id, reader.tp_rank, member)
        self._declared[key] = reader.agent
        self._declared.move_to_end(key)
        while len(self._declared) > MAX_DECLARED_READERS:
            self._declared.popitem(last=False)
            self.metrics.declared_readers_evicted.inc()

    def on_notif(self, engine_id: str, agent: str, msg: bytes) -> None:
        """One NIXL notification arrived at ``engine_id``'s agent from ``agent``."""
        try:
            if notifications.is_batch(msg):
                items = notifications.decode_batch(msg)
            else:
                items = [notifications.decode(msg)]
        except notifications.BadNotification as e:
            self.metrics.notifications_received.labels(outcome="bad").inc()
            log.warning("ignoring a notification from %s: %s", agent, e)
            return
        self.metrics.notification_reads.observe(len(items))
        for item in items:
            if isinstance(item, notifications.BadNotification):
                self.metrics.notifications_received.labels(outcome="bad").inc()
                log.warning("ignoring one read of a batched notification from %s: %s",
                            agent, item)
            else:
                self._read_done(agent, item)

    def _read_done(self, agent: str, note: notifications.ReadDone) -> None:
        """One read's notification: end (or note early) its hold's reader, if the
        sender is the agent the reader's member declared."""
        eng = self.table.holder(note.target_engine, note.request_id)
        if eng is None:
            self.metrics.notifications_received.labels(outcome="unknown_engine").inc()
            log.warning("notification for unknown engine %r (request %r) from %s",
                        note.target_engine, note.request_id, agent)
            return
        member = eng.holds.member_of(note.target_engine, note.request_id,
                                     (note.reader_engine, note.reader_rank))
        declared = None if member is None else self._declared.get(
            (note.target_engine, note.reader_engine, note.reader_rank, member))
        if declared != agent:
            # Only the agent that the member the reader claimed from declared (in
            # its handshake) may end a hold; a reader that never claimed, none.
            self.metrics.notifications_received.labels(outcome="wrong_sender").inc()
            log.warning("rejecting a notification for engine %r request %r claiming reader "
                        "%r rank %d: sent by agent %r, the reader declared %r",
                        note.target_engine, note.request_id, note.reader_engine,
                        note.reader_rank, agent, declared)
            return
        self.metrics.series(self.metrics.notifications_received, "ok").inc()
        tracing = self.spans.tracing
        if tracing.enabled:
            tracing.end(tracing.start(
                "kvsidecar.notification", note.request_id,
                self.spans.get(note.target_engine, note.request_id),
                engine=note.target_engine, peer=note.reader_engine, rank=note.reader_rank))
        dropped = eng.holds.early_dropped
        eng.holds.notify(note, time.monotonic(), member or b"")
        if eng.holds.early_dropped != dropped:
            self.metrics.limit_refusals.labels(eng.engine_id, "early_notifications").inc()
