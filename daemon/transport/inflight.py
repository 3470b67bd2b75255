"""The reads posted on one NIXL agent and not yet reported (worker thread only).

A read is posted (``initialize_xfer`` + ``transfer()``; on host memory the
latter copies inline) and then polled with ``check_xfer_state`` until DONE:
NIXL sends the notification attached to a READ only when the initiator
observes the transfer as DONE, so every handle is polled to completion even if
its awaiting coroutine was cancelled, and only then released.

A read that passes its deadline, ends in an error state or fails while
posting is *doomed*, not reported: it may still be writing into our memory,
and only destroying the agent stops that (see
:mod:`~kvsidecar.daemon.transport.agent_host`). The worker resets the agent
and only then fails it, and every other read in flight on that agent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsidecar.daemon.transport.agent_host import AgentHost
from kvsidecar.daemon.transport.errors import NixlError, NixlTimeout, wrap
from kvsidecar.daemon.transport.jobs import DEFERRED, Fut, Outbox
from kvsidecar.daemon.transport.ops import ReadOp, TransferStats, as_int64, read_bytes

log = logging.getLogger(__name__)

__all__ = ["Inflight", "InflightReads"]


@dataclass
class Inflight:
    handle: Any
    fut: Fut
    remote: str
    nbytes: int
    ndesc: int
    t0: float
    t_post: float
    deadline: float | None = None
    timed_out: bool = False


class InflightReads:
    """Posts reads on ``host``'s agent, polls them, and puts what finished in
    ``outbox``; ``on_posted`` runs when a read did not finish inside
    ``transfer()`` (its completion is imminent)."""

    def __init__(self, host: AgentHost, outbox: Outbox, *, telemetry: bool,
                 on_posted: Callable[[], None]) -> None:
        self._host = host
        self._out = outbox
        self._telemetry = telemetry
        self._on_posted = on_posted
        self.reads: list[Inflight] = []
        #: reads that failed but may still write: reported once the agent is reset
        self.doomed: list[tuple[Inflight, BaseException]] = []
        self._by_agent: dict[str, int] = {}
        #: handles NIXL refused to release, kept referenced (see _release)
        self.stuck_handles: list[Any] = []

    def busy(self, remote: str) -> int:
        """How many reads to ``remote`` are in flight."""
        return self._by_agent.get(remote, 0)

    def post(self, op: ReadOp, fut: Fut) -> object:
        """Post a checked read to a known remote; its stats if it has no
        descriptors (only its notification is sent), else DEFERRED."""
        agent, remote, notif = self._host.agent, op.remote_agent, op.notif
        lens = as_int64(op.length)
        n = len(lens)
        if n == 0:
            if notif:
                agent.send_notif(remote, notif)
            return TransferStats(0, 0, 0.0, 0.0)
        local = np.empty((n, 3), dtype=np.int64)
        local[:, 0] = as_int64(op.local_addr)
        local[:, 1] = lens
        local[:, 2] = op.dev_id
        far = local.copy()
        far[:, 0] = as_int64(op.remote_addr)
        far[:, 2] = op.dev_id if op.remote_dev_id is None else op.remote_dev_id
        remote_mem_type = op.mem_type if op.remote_mem_type is None else op.remote_mem_type
        local_descs = agent.get_xfer_descs(local, op.mem_type)
        remote_descs = agent.get_xfer_descs(far, remote_mem_type)
        if local_descs is None or remote_descs is None:
            raise NixlError(f"read from remote agent {remote!r}: NIXL rejected the descriptor "
                            f"lists (local {op.mem_type!r}, remote {remote_mem_type!r})",
                            remote=remote)
        t0 = time.perf_counter()
        try:
            handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote,
                                           notif or b"")
        except Exception as exc:
            raise wrap(f"read of {n} descriptors from remote agent {remote!r}: "
                       "initialize_xfer", exc, remote) from exc
        r = Inflight(handle, fut, remote, read_bytes(op), n, t0, t0,
                     None if op.timeout_s is None else t0 + op.timeout_s)
        self._by_agent[remote] = self._by_agent.get(remote, 0) + 1
        try:
            state = agent.transfer(handle)
        except Exception as exc:
            # Part of it may be posted: dead only once the agent is reset.
            self.doomed.append((r, wrap(f"read from remote agent {remote!r}", exc, remote)))
            return DEFERRED
        r.t_post = time.perf_counter()
        if state == "DONE":
            self._finish(r)
        elif state == "PROC":
            self.reads.append(r)  # polled to DONE by the worker's progress
            self._on_posted()
        else:
            self.doomed.append((r, NixlError(
                f"read from remote agent {remote!r} failed: transfer() returned {state}",
                remote=remote)))
        return DEFERRED

    def poll(self) -> None:
        """Check every read in flight: report the finished, doom the failed."""
        agent = self._host.agent
        still: list[Inflight] = []
        for r in self.reads:
            try:
                state = agent.check_xfer_state(r.handle)
            except Exception as exc:
                self.doomed.append((r, wrap(f"read from remote agent {r.remote!r}", exc,
                                            r.remote)))
                continue
            if state == "PROC":
                if r.deadline is not None and time.perf_counter() > r.deadline:
                    waited = time.perf_counter() - r.t0
                    r.timed_out = True
                    self.doomed.append((r, NixlTimeout(
                        f"read from remote agent {r.remote!r} timed out after {waited:.1f} s "
                        "(the peer is stalled or unreachable; the agent was reset so that "
                        "nothing of it can land any more)", remote=r.remote)))
                    continue
                still.append(r)
            elif state == "DONE":
                self._finish(r)
            else:
                self.doomed.append((r, NixlError(
                    f"read from remote agent {r.remote!r} failed: transfer state {state}",
                    remote=r.remote)))
        self.reads = still

    def _finish(self, r: Inflight) -> None:
        stats = self._stats(r)
        self._release(r.handle, r.remote)
        left = self._by_agent.get(r.remote, 1) - 1
        if left > 0:
            self._by_agent[r.remote] = left
        else:
            self._by_agent.pop(r.remote, None)
        self._out.done(r.fut, stats)

    def _release(self, handle: Any, remote: str) -> None:
        try:
            self._host.agent.release_xfer_handle(handle)
        except Exception:
            # NIXL refuses to free a handle it cannot cancel; keep it referenced so its
            # finalizer does not run (and fail again) at an arbitrary point.
            log.warning("NIXL agent %r: could not release a handle to %r", self._host.name,
                        remote, exc_info=True)
            self.stuck_handles.append(handle)

    def _stats(self, r: Inflight) -> TransferStats:
        if self._telemetry:
            try:
                tel = self._host.agent.get_xfer_telemetry(r.handle)
                return TransferStats(int(tel.totalBytes), r.ndesc, float(tel.postDuration),
                                     float(tel.xferDuration), True)
            except Exception:
                log.debug("no telemetry for a read from %r", r.remote, exc_info=True)
        done = time.perf_counter()
        return TransferStats(r.nbytes, r.ndesc, (r.t_post - r.t0) * 1e6, (done - r.t0) * 1e6)

    def take_all(self) -> tuple[list[tuple[Inflight, BaseException]], list[Inflight]]:
        """The doomed reads and those still in flight, forgotten here."""
        doomed, self.doomed = self.doomed, []
        others, self.reads = self.reads, []
        return doomed, others

    def drop(self, reads: list[Inflight]) -> None:
        """Release and drop the handles of ``reads`` and every stuck one, before
        the agent is destroyed (NIXL's agent goes with its last reference)."""
        for r in reads:
            try:
                self._host.agent.release_xfer_handle(r.handle)
            except Exception:
                log.debug("NIXL agent %r: releasing a handle before teardown failed",
                          self._host.name, exc_info=True)
            r.handle = None
        self.stuck_handles.clear()
        self._by_agent.clear()
