"""A worker's transfers: the step's holds, reads, releases and keeps, and their outcomes.

:class:`Transfers` starts what the scheduler decided (in batches where the
sidecar takes them) and turns the sidecar's completions, and the refusals and
failures its :class:`~.link.SidecarLink` recorded, into vLLM's
``KVConnectorTransferResults``, in vLLM's NIXL terms.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from ...ipc.client import (
    HoldSpec,
    SidecarClient,
    SidecarError,
    SidecarTimeout,
    UnknownEngine,
    refusal_code,
)
from ...ipc.protocol import (
    MAX_BATCH,
    MAX_KEEP_CLAIMS_PER_KEEP,
    UNKNOWN_ENGINE,
    Completion,
    Held,
    KeepItem,
    MemoryKind,
)
from .layout import VllmLayout
from .link import SidecarLink
from .messages import HoldJob, KvSidecarMetadata, ReadJob, read_spec
from .settings import NULL_BLOCK, Settings

log = logging.getLogger(__name__)


class Transfers(SidecarLink):
    """Starts a rank's transfers and reports how they ended."""

    def __init__(self, client: SidecarClient, engine_id: str, tp_rank: int, socket: str,
                 settings: Settings, memory: MemoryKind, vl: VllmLayout, *,
                 batches: bool, keeps: bool, one_group: bool) -> None:
        super().__init__(client, engine_id, tp_rank, socket, settings, memory, vl)
        #: a step's holds and reads go in one message each (a sidecar before
        #: BATCH_MINOR gets them one by one)
        self._batches = batches
        self._keeps = keeps  # the sidecar keeps P's holds for us
        self._keep_from = 0  # where the next round of keeps starts (see _keep)
        self.one_group = one_group
        self._invalid: set[int] = set()
        #: why the last poll was refused ('' once one brings completions, or the
        #: rank is lost): the same refusal again is logged at DEBUG
        self._poll_refused = ""

    def preempted(self, meta: KvSidecarMetadata) -> None:
        """Preemption frees a request's blocks for reuse at once, so no transfer
        may still write into them. vLLM 0.33 preempts only running requests, and
        a request runs only after its read was reported finished: a preempted
        request has nothing in flight, and P's hold ended with D's notification.
        Should a later vLLM preempt a request whose read is still in flight,
        the read is released at once (P is told by the abort) and the breach
        logged as an error: its blocks may be written until the abort lands."""
        for rid in meta.preempted:
            if rid in self._reading and rid not in self._released:
                log.error("kvsidecar: request %s was preempted while its read was in "
                          "flight; releasing it (its freed blocks may still be written "
                          "until the abort completes)", rid)
                self._release(rid)

    def _release(self, rid: str) -> None:
        self._released.add(rid)
        if self._lost:
            return  # it failed already, with everything in flight
        if self._unreachable:
            self._uncertain.add(rid)  # released once the sidecar answers
            return
        try:
            self.client.release(self.engine_id, rid)
        except SidecarTimeout as e:
            self._no_answer(rid, "release", e)
        except UnknownEngine as e:
            self._lose(str(e))
        except SidecarError as e:  # finished meanwhile: its completion says how
            log.debug("kvsidecar: release %s: %s", rid, e)

    def start(self, meta: KvSidecarMetadata) -> None:
        self._repair()
        if meta.keeps:
            self._keep(meta.keeps)
        self._start_holds(meta.holds)
        for rid in meta.releases:
            if rid in self._reading:
                self._release(rid)
        self._start_reads(meta.reads)

    def _start_holds(self, holds: Sequence[HoldJob]) -> None:
        """Place a step's holds (in batches of at most MAX_BATCH where the sidecar
        takes batches); each refused one ends its send (:meth:`_hold_failed`)."""
        if not holds:
            return
        outcomes: list[Held | SidecarError] = []
        if self._lost:
            for h in holds:
                self._hold_failed(h.request_id, self._lost)
            return
        if self._unreachable:
            for h in holds:
                log.warning("kvsidecar: request %s: held once the sidecar answers again (%s)",
                            h.request_id, self._unreachable)
                self._hold_later(h)
            return
        if self._batches and len(holds) > 1:
            for i in range(0, len(holds), MAX_BATCH):
                part = holds[i:i + MAX_BATCH]
                try:
                    outcomes += self.client.hold_many(self.engine_id, [
                        HoldSpec(h.request_id, h.block_ids,
                                 timeout_s=self.settings.hold_timeout_s) for h in part])
                except SidecarError as e:
                    outcomes += [e] * len(part)
        else:
            for h in holds:
                try:
                    outcomes.append(self.client.hold(self.engine_id, h.request_id, h.block_ids,
                                                     timeout_s=self.settings.hold_timeout_s))
                except SidecarError as e:
                    outcomes.append(e)
        for h, o in zip(holds, outcomes):
            self._held(h, o)

    def _held(self, h: HoldJob, outcome: Held | SidecarError) -> None:
        rid = h.request_id
        if not isinstance(outcome, SidecarError):
            self._holding.add(rid)
        elif isinstance(outcome, SidecarTimeout):
            self._hold_later(h)
            self._no_answer(rid, "hold", outcome)
        else:
            if isinstance(outcome, UnknownEngine):
                self._lose(str(outcome))
            self._hold_failed(rid, self._lost or f"refused: {outcome}")

    def _keep(self, items: Sequence[KeepItem]) -> None:
        """Have the sidecar keep P's holds of the requests waiting for their read
        (best effort: a sidecar that cannot is logged; the read finds out)."""
        if self._down or not self._keeps:
            return
        # A round the sidecar cuts short (claims in flight at their bound) starts
        # the next one where it stopped, so no waiting request is left out for good.
        start = self._keep_from % len(items) if items else 0
        ordered = [*items[start:], *items[:start]]
        chunks = keep_chunks(ordered)
        for n, chunk in enumerate(chunks):
            try:
                self.client.keep(self.engine_id, chunk)
            except UnknownEngine as e:
                self._lose(str(e))
                return
            except SidecarError as e:
                log.warning("kvsidecar: keeping %d waiting request(s) alive at the prefill "
                            "side failed: %s", len(ordered) - n, e)
                self._keep_from = start + sum(len(c) for c in chunks[:n])
                return
        self._keep_from = 0

    def _start_reads(self, jobs: Sequence[ReadJob]) -> None:
        """Send the step's reads without waiting for the sidecar's answer (in
        batches of at most MAX_BATCH where it takes batches): the step goes on
        at once, and a read the sidecar refuses comes from a later poll as a
        ``failed`` completion, a failed read like any other. A call that
        raises (not sent, or no answer to a batch too long for one packet)
        is this step's, as for a blocking read (:meth:`_started`)."""
        step = MAX_BATCH if self._batches else 1
        for i in range(0, len(jobs), step):
            part = jobs[i:i + step]
            t0 = time.perf_counter()
            if self._down:  # lost or silent, maybe since an earlier part: fail at once
                for job in part:
                    self._started(job, self._down, t0, 0.0)
                continue
            refused: SidecarError | None = None
            try:
                if len(part) > 1:
                    self.client.read_many_nowait(self.engine_id,
                                                 [read_spec(job) for job in part])
                else:  # a ReadSpec's fields are read_nowait()'s arguments, by name
                    self.client.read_nowait(self.engine_id, **vars(read_spec(part[0])))
            except SidecarError as e:
                refused = e
            each = (time.perf_counter() - t0) / len(part)
            for job in part:
                self._started(job, refused, t0, each)

    def _started(self, job: ReadJob, refused: SidecarError | str | None, t0: float,
                 post_s: float) -> None:
        """Track a read the sidecar took, or make its refusal a failed read
        (one route for errors); a read without an answer is uncertain."""
        rid = job.request_id
        self._reading[rid] = (job, t0, post_s)
        if refused is None:
            return
        if isinstance(refused, SidecarTimeout):
            self._no_answer(rid, "read", refused)
            return
        if isinstance(refused, UnknownEngine):
            self._lose(str(refused))
        why = refused if isinstance(refused, str) else self._lost or f"refused: {refused}"
        self._early.append(Completion(rid, "failed", why, job.local_block_ids))

    def results(self) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        self._repair()
        items: list[Completion] = []
        if not self._down:
            try:
                # Never waits for the sidecar: what it pushed since (a poll stays
                # parked there), an empty step's poll costing no round trip.
                items = self.client.poll_nowait(self.engine_id)
            except UnknownEngine as e:
                self._poll_refused = ""
                self._lose(str(e))
            except SidecarTimeout as e:  # its completions come again with a later poll
                self._unanswered(e)
            except SidecarError as e:
                # A rank being released is refused each step until its reads end:
                # said once (ERROR), its repeats at DEBUG, not one ERROR per step.
                level = logging.DEBUG if str(e) == self._poll_refused else logging.ERROR
                self._poll_refused = str(e)
                log.log(level, "kvsidecar: engine %s rank %d: the sidecar at %s refused a "
                        "poll (%s); trying again next step", self.engine_id, self.tp_rank,
                        self.socket, e)
            if items:  # answered (an empty list may only mean no answer yet)
                self._poll_refused = ""
        # A read sent without waiting that reached the sidecar only after it lost
        # the rank (sent again on a new connection to a restarted sidecar) is
        # refused unknown_engine: the registration is gone, so is all in flight.
        lost = next((c.reason for c in items if refusal_code(c) == UNKNOWN_ENGINE), "")
        if lost:
            self._lose(lost)
        out.finished_sending.update(self._sends_ended)
        self._sends_ended.clear()
        early, self._early = self._early, []
        for c in [*early, *items]:
            self._uncertain.discard(c.request_id)
            if c.request_id in self._holding:
                self._sent(c, out)
            elif c.request_id in self._reading:
                self._received(c, out)
            else:
                log.debug("kvsidecar: completion for unknown request %s (%s)", c.request_id,
                          c.kind)
        return out

    def _sent(self, c: Completion, out: KVConnectorTransferResults) -> None:
        self._holding.discard(c.request_id)
        self._hold_blocks.pop(c.request_id, None)
        if c.kind == "expired":
            self.stats.record_kv_expired_req()
        out.finished_sending.add(c.request_id)

    def _received(self, c: Completion, out: KVConnectorTransferResults) -> None:
        """A read's outcome, in vLLM's NIXL terms: a failed read is a failed
        transfer (finished; with one KV-cache group its blocks are reported
        invalid and vLLM keeps the valid prefix, with several it is also
        failed); a failed notify-only read (a full prefix hit, an abort) is a
        failed notification."""
        job, t0, post_s = self._reading.pop(c.request_id)
        released = c.request_id in self._released
        self._released.discard(c.request_id)
        if c.kind == "received":
            if job.awaited:  # else notify-only: the scheduler awaits nothing
                self._record_transfers(c, time.perf_counter() - t0, post_s)
                out.finished_recving.add(c.request_id)
            return
        if released:
            out.finished_recving.add(c.request_id)  # the scheduler aborted it; blocks free
            return
        if not job.awaited:
            # The KV is local, nothing to redo; P frees its blocks at its lease.
            self.stats.record_failed_notification()
            log.error("kvsidecar: request %s: telling the prefill side that it may free its "
                      "blocks failed (%s: %s); it frees them when its hold runs out",
                      c.request_id, c.kind, c.reason)
            return
        self.stats.record_failed_transfer()
        out.finished_recving.add(c.request_id)
        bad = c.invalid_block_ids or job.local_block_ids
        if self.one_group and any(bad):
            # One group: the blocks the sidecar names are reported alone, so vLLM
            # keeps the request's valid prefix (its local prefix-cache hit and any
            # page before the first bad one) and recomputes from there.
            self._invalid.update(b for g in bad for b in g if b != NULL_BLOCK)
        else:
            # vLLM 0.33 maps block-level errors to requests for one group only;
            # hybrid configs take failed_recving (the whole request recomputes).
            out.failed_recving.add(c.request_id)
        log.error("kvsidecar: request %s: its KV read failed (%s: %s); vLLM recomputes it",
                  c.request_id, c.kind, c.reason)

    def _record_transfers(self, c: Completion, seen_s: float, post_s: float) -> None:
        """vLLM's NIXL semantics: one successful transfer per remote rank read
        from, with the sidecar's timings for it. A sidecar before protocol minor
        3 reports none: then one per read, timed as the engine saw it (read
        request to the poll that returned it)."""
        data = self.stats.data
        if c.transfers:
            for t in c.transfers:
                data["transfer_duration"].append(t.xfer_s)
                data["post_duration"].append(t.post_s)
                data["bytes_transferred"].append(t.nbytes)
                data["num_descriptors"].append(t.descriptors)
        elif c.nbytes:
            data["transfer_duration"].append(seen_s)
            data["post_duration"].append(post_s)
            data["bytes_transferred"].append(c.nbytes)
            data["num_descriptors"].append(c.descriptors)

    def load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def take_stats(self) -> NixlKVConnectorStats | None:
        if self.stats.is_empty():
            return None
        out: NixlKVConnectorStats = self.stats.clone_and_reset()
        return out


def keep_chunks(items: Sequence[KeepItem]) -> list[list[KeepItem]]:
    """``items`` in Keeps the sidecar takes: at most MAX_BATCH items and at most
    MAX_KEEP_CLAIMS_PER_KEEP claims each (an item claims at most its P tp size)."""
    chunks: list[list[KeepItem]] = []
    cur: list[KeepItem] = []
    claims = 0
    for item in items:
        cost = max(1, item.remote.tp_size)
        if cur and (len(cur) >= MAX_BATCH or claims + cost > MAX_KEEP_CLAIMS_PER_KEEP):
            chunks.append(cur)
            cur, claims = [], 0
        cur.append(item)
        claims += cost
    if cur:
        chunks.append(cur)
    return chunks

