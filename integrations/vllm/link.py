"""A worker's standing with its sidecar, and what happens to transfers when it fails.

No sidecar error leaves the connector as an exception: vLLM takes any
exception from a connector call for a fatal engine error. Each becomes the
outcome of the requests it concerns, by what it says of the sidecar's access
to our memory:

* refused (the sidecar answered no): that request only: a hold ends its
  send, a read is a failed read;
* ``UnknownEngine`` (the sidecar at our socket has no registration of this
  rank: it restarted, or released it), raised by a call or returned by a
  poll as a read's ``unknown_engine`` refusal: a sidecar lets an engine's memory go
  only after its transfers ended, so everything in flight ends now as failed
  (:meth:`SidecarLink._lose`) and the rank registers again
  (:meth:`SidecarLink._register_again`);
* no answer (``SidecarTimeout``: a stopped, overloaded or dead sidecar):
  whether it took the request is unknown, and a request it took may still
  read or write our blocks, so nothing of it is reported yet: the request is
  *uncertain* until the sidecar answers again (:meth:`SidecarLink._settle`).
  Meanwhile the sidecar is *unreachable*: it is asked again after a pause that
  doubles up to REPAIR_MAX_S, so a stuck sidecar costs vLLM one client timeout
  per pause, not one per call; new holds wait (uncertain) to be placed when it
  answers, new reads fail at once (D recomputes rather than wait on a silent
  sidecar; nothing was asked of it).

:class:`SidecarLink` holds that state (lost, unreachable, uncertain) and the
requests in flight it concerns; :class:`~.transfers.Transfers` starts them and
reports their outcomes, :class:`~.worker.WorkerSide` is the rank itself.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Literal

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from ...ipc.client import Duplicate, SidecarClient, SidecarError, SidecarTimeout, UnknownEngine
from ...ipc.keepalive import Keepalive
from ...ipc.memfd import MemfdRegion
from ...ipc.memory import RegionError
from ...ipc.protocol import Completion, MemoryKind
from ...ipc.regions import Region
from .layout import VllmLayout
from .messages import HoldJob, KvSidecarHandshake, ReadJob
from .pool import SidecarKVPool
from .settings import REPAIR_MAX_S, REPAIR_PAUSE_S, Settings

log = logging.getLogger(__name__)


class SidecarLink:
    """One tp rank's sidecar: whether it has the rank's registration and answers,
    the requests in flight on it, and their repair when it fails."""

    def __init__(self, client: SidecarClient, engine_id: str, tp_rank: int, socket: str,
                 settings: Settings, memory: MemoryKind, vl: VllmLayout) -> None:
        self.client = client
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.socket = socket
        self.settings = settings
        self.memory = memory
        self.vl = vl
        self._kvpool: SidecarKVPool | None = None
        self.regions: list[Region] = []
        self.handshake: KvSidecarHandshake | None = None
        self._holding: set[str] = set()
        self._reading: dict[str, tuple[ReadJob, float, float]] = {}  # job, start, post time
        self._released: set[str] = set()
        self._early: list[Completion] = []  # refusals of read(), reported like failures
        self.stats = NixlKVConnectorStats()
        #: holds that ended without a completion (refused, lost): finished_sending next
        self._sends_ended: set[str] = set()
        #: holds and reads whose request got no answer (see the module's docstring)
        self._uncertain: set[str] = set()
        self._hold_blocks: dict[str, list[list[int]]] = {}  # uncertain holds' blocks
        self._lost = ""  # why the sidecar has no registration of this rank ('' while it has)
        self._unreachable = ""  # why the sidecar is taken for unreachable ('' while it answers)
        self._next_repair = 0.0
        self._pause = REPAIR_PAUSE_S
        self._keepalive: Keepalive | None = None
        #: registrations of this rank with its sidecar (more than 1: it registered again)
        self.registrations = 0
        self._unpublished = False  # registered again: the scheduler must learn the address
        self._reserved_again = False  # lost: the KV memory moved into a new reservation

    @property
    def _down(self) -> str:
        """Why no new work goes to the sidecar now ('' when it does)."""
        return self._lost or self._unreachable

    def _no_answer(self, rid: str, what: str, e: SidecarError) -> None:
        """``rid``'s ``what`` got no answer: uncertain until the sidecar answers."""
        log.error("kvsidecar: request %s: no answer from the sidecar to its %s (%s); it is "
                  "settled once the sidecar answers again", rid, what, e)
        self._uncertain.add(rid)
        self._unanswered(e)

    def _unanswered(self, e: SidecarError) -> None:
        """The sidecar did not answer: ask it again after a pause (doubling)."""
        if not self._unreachable:
            self._pause = REPAIR_PAUSE_S
            log.error("kvsidecar: engine %s rank %d: the sidecar at %s does not answer (%s); "
                      "new transfers fail until it does", self.engine_id, self.tp_rank,
                      self.socket, e)
        else:
            self._pause = min(2 * self._pause, REPAIR_MAX_S)
        self._unreachable = f"the sidecar at {self.socket} does not answer ({e})"
        self._next_repair = time.monotonic() + self._pause

    def _lose(self, why: str) -> None:
        """The sidecar has no registration of this rank any more (it restarted or
        released it). It ended our transfers before it let our memory go, so
        nothing in flight can still touch our blocks: every hold ends its send,
        every read fails (a released one ends aborted), all reported by the next
        :meth:`~.transfers.Transfers.results`; the rank registers again at the next step."""
        if self._lost:
            return
        self._lost = (f"the sidecar at {self.socket} lost engine {self.engine_id!r} rank "
                      f"{self.tp_rank}'s registration ({why})")
        self._unreachable = ""
        log.error("kvsidecar: %s: failing %d hold(s) and %d read(s) in flight; registering "
                  "again", self._lost, len(self._holding), len(self._reading))
        for rid in sorted(self._holding):
            self._hold_failed(rid, self._lost)
        early = {c.request_id for c in self._early}
        for rid, (job, _, _) in self._reading.items():
            if rid not in early:
                self._early.append(Completion(rid, self._ended_kind(rid), self._lost,
                                              job.local_block_ids))
        self._uncertain.clear()
        self._next_repair = 0.0
        self._pause = REPAIR_PAUSE_S

    def _ended_kind(self, rid: str) -> Literal["aborted", "failed"]:
        """How a read that ends without a transfer ends: aborted if released."""
        return "aborted" if rid in self._released else "failed"

    def _hold_later(self, h: HoldJob) -> None:
        """Place ``h`` when the sidecar answers again (:meth:`_settle`); its blocks
        stay vLLM's until its send ends."""
        self._holding.add(h.request_id)
        self._hold_blocks[h.request_id] = h.block_ids
        self._uncertain.add(h.request_id)

    def _hold_failed(self, rid: str, why: str) -> None:
        """P cannot keep ``rid``'s blocks for its reader: its send ends now (vLLM
        frees the blocks; D's read of them fails and D recomputes). Counted as
        a failed transfer: the request's KV never leaves P."""
        log.error("kvsidecar: request %s: its KV cannot be held for the decode side (%s); "
                  "its blocks are freed and the decode side's read of them will fail",
                  rid, why)
        self._holding.discard(rid)
        self._uncertain.discard(rid)
        self._hold_blocks.pop(rid, None)
        self.stats.record_failed_transfer()
        self._sends_ended.add(rid)

    def _repair(self) -> None:
        """Before a step's work: notice a lost registration (the keepalive's word,
        or an unreachable sidecar answering again), settle uncertain requests,
        and register again once lost."""
        ka = self._keepalive
        due = time.monotonic() >= self._next_repair
        if not self._lost and ((self._unreachable and due)
                               or (ka is not None and self.engine_id in ka.missing)):
            self._confirm_registered()
        if self._uncertain and not self._down:
            self._settle()
        if self._lost and time.monotonic() >= self._next_repair:
            self._register_again()

    def _confirm_registered(self) -> None:
        """Ask the sidecar, on our own connection, whether it still has this rank
        (the keepalive's answer may predate our registration)."""
        try:
            pong = self.client.ping([self.engine_id])
        except SidecarError as e:
            self._unanswered(e)
            return
        if self._unreachable:
            log.warning("kvsidecar: engine %s rank %d: the sidecar at %s answers again",
                        self.engine_id, self.tp_rank, self.socket)
            self._unreachable = ""
        if self.engine_id not in pong.engines:
            self._lose("it no longer lists the rank: it restarted, or released the rank")
        elif self._keepalive is not None:
            self._keepalive.clear(self.engine_id)

    def _settle(self) -> None:
        """Settle each uncertain request now that the sidecar answers. A read is
        released: the sidecar either has it (``Ok``: its completion follows, as
        for any release) or never took it (refused: it ends now, nothing of it
        can touch our blocks). A hold is placed again: ``Held`` (the first copy
        never reached the sidecar) or ``Duplicate`` (it did: the hold is open, or
        has ended and its completion awaits our poll; the sidecar never pins the
        blocks twice, nor again for a request already read). Either way it is
        held until its one completion ends its send."""
        for rid in sorted(self._uncertain):
            try:
                if rid in self._holding:
                    self._hold_again(rid)
                else:
                    self.client.release(self.engine_id, rid)
            except SidecarTimeout as e:
                self._unanswered(e)
                return
            except UnknownEngine as e:
                self._lose(str(e))
                return
            except SidecarError as e:
                self._uncertain.discard(rid)
                if rid in self._holding:
                    self._hold_failed(rid, f"refused: {e}")
                elif rid in self._reading:
                    job = self._reading[rid][0]
                    self._early.append(Completion(
                        rid, self._ended_kind(rid), f"the sidecar never took the read ({e})",
                        job.local_block_ids))
            else:
                self._uncertain.discard(rid)

    def _hold_again(self, rid: str) -> None:
        """Place ``rid``'s uncertain hold again (see :meth:`_settle`)."""
        with contextlib.suppress(Duplicate):  # Duplicate: the first one was placed
            self.client.hold(self.engine_id, rid, self._hold_blocks[rid],
                             timeout_s=self.settings.hold_timeout_s)
        self._hold_blocks.pop(rid, None)

    def _register_again(self) -> None:
        """Register this rank's KV memory again (the sidecar lost it): the same
        memory, with what it holds (vLLM's prefix cache stays valid).

        Memory this connector attached (``shm``) registers as it is. Memory the
        lost registration's sidecar allocated (``memfd``) is out of a restarted
        sidecar's reach: the new sidecar reserves a new memfd, the KV bytes are
        copied into it, and it is mapped at the old address
        (:meth:`~kvsidecar.ipc.memfd.MemfdRegion.take_over`), so vLLM's tensors
        keep their pointers. GPU reservations cannot be moved that way: the rank
        stays unregistered (each request fails, logged) until the engine restarts.
        """
        try:
            if self._kvpool is not None and not self._reserved_again:
                self._move_reservation()
                self._reserved_again = True
            reg = self.client.register(self.engine_id, self.tp_rank, self.vl.layout,
                                       regions=self.regions)
        except (SidecarError, RegionError, OSError) as e:
            # Unanswered: the next try joins the registration it began, in the same
            # reservation. Refused: reserve again first (the sidecar may have
            # restarted once more).
            self._reserved_again &= isinstance(e, SidecarTimeout)
            log.error("kvsidecar: engine %s rank %d: registering again with the sidecar at "
                      "%s failed (%s); its requests fail until it succeeds (tried again in "
                      "%g s)", self.engine_id, self.tp_rank, self.socket, e, self._pause)
            self._next_repair = time.monotonic() + self._pause
            self._pause = min(2 * self._pause, REPAIR_MAX_S)
            return
        self._lost = ""
        self._reserved_again = False
        self._pause = REPAIR_PAUSE_S
        self.registrations += 1
        self._unpublished = True
        if self._keepalive is not None:
            self._keepalive.clear(self.engine_id)
        self.handshake = KvSidecarHandshake(self.engine_id, self.tp_rank,
                                            reg.handshake_address, reg.hold_key)
        log.warning("kvsidecar: engine %s rank %d registered again with the sidecar at %s "
                    "(handshake %s)", self.engine_id, self.tp_rank, self.socket,
                    reg.handshake_address)

    def _move_reservation(self) -> None:
        assert self._kvpool is not None
        old = self._kvpool.region
        if not isinstance(old, MemfdRegion):
            raise RegionError(f"{self.memory!r} memory the lost sidecar allocated cannot be "
                              "registered with another sidecar; restart the engine")
        try:
            new = self.client.reserve(self.engine_id, old.nbytes, self.memory)
        except Duplicate:  # left by a registration that failed after it: drop, reserve again
            self.client.deregister(self.engine_id)
            new = self.client.reserve(self.engine_id, old.nbytes, self.memory)
        if not isinstance(new, MemfdRegion):
            new.close()
            raise RegionError(f"the sidecar reserved {type(new).__name__}, not a memfd")
        old.take_over(new)
