"""One registered engine rank: its memory, its NIXL agent, its queue of completions.

Each engine rank gets its own NIXL worker (agent + thread). An agent's
metadata then never changes after registration, so a peer that loaded it once
never reads with a stale copy, and notifications arrive at the agent of the
engine they are for.

With ``--post-lanes N`` a D engine rank has N workers ("lanes"), the engine's
memory registered in each: lane 0 is :attr:`EngineRank.worker`, the agent
peers know (handshake, notifications in and out, holds); the others only post
READs (see :func:`~kvsidecar.daemon.d_side.parts.lane_of`). On host memory
``transfer()`` is the CMA copy itself, so one worker thread would copy a
hetero read's P ranks one after the other while the other core idles.

What the rank needs of the daemon's configuration (hold timing, staging,
verification, posting during claims) it reads from :attr:`EngineRank.settings`.
Memory mapping and release are :mod:`~kvsidecar.daemon.engines.memory`'s.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from kvsidecar.daemon.holds import HoldBook, HoldOutcome
from kvsidecar.daemon.peers.links import PeerLinks
from kvsidecar.daemon.peers.messages import HandshakeInfo
from kvsidecar.daemon.settings import Settings
from kvsidecar.daemon.staging import StagingPool
from kvsidecar.daemon.transport.worker import NixlWorker
from kvsidecar.ipc.layout import Layout
from kvsidecar.ipc.protocol import Completion, Completions, ReaderReport
from kvsidecar.ipc.regions import Region
from kvsidecar.metrics.registry import Metrics


@dataclass
class EngineRank:
    engine_id: str
    tp_rank: int
    layout: Layout
    regions: list[Region]
    owned: bool
    keep_on_exit: bool
    pid: int
    worker: NixlWorker
    reg_id: int
    bases: NDArray[np.int64]
    peers: PeerLinks
    info: HandshakeInfo
    #: the daemon's settings: hold timing, staging, verification, posting during claims
    settings: Settings
    instance: str = ""
    pid_visible: bool = False
    """``pid`` names a process in the sidecar's own PID namespace (checkable)."""
    last_seen: float = field(default_factory=time.monotonic)
    """When the engine last sent a request (its liveness lease runs from here)."""
    orphaned: bool = False
    """A kept registration whose process is dead: a new instance may take it over."""
    #: The uid that registered this rank (None: unknown, e.g. a direct call in
    #: a unit test); only that uid may use or deregister it.
    uid: int | None = None
    #: the fd-socket token of this rank's exported fds ('' when none)
    fd_token: str = ""
    #: what allocate mode allocated (shm, memfd, cuda_malloc, cuda_vmm); '' in attach mode
    memory: str = ""
    completions: collections.deque[tuple[int, Completion]] = field(
        default_factory=collections.deque)
    holds: HoldBook = field(init=False)
    epoch: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    #: counts every completion by outcome (None: not counted, e.g. in unit tests)
    metrics: Metrics | None = None
    #: told of every completion (tracing ends the request's span), when set
    on_complete: Callable[[str, Completion], None] | None = None
    #: sidecar-owned host memory for staged reads (None: never staged)
    staging: StagingPool | None = None
    #: every worker that posts reads, lane 0 (``worker``) first; set from ``worker``
    #: when left empty (one lane)
    lanes: list[NixlWorker] = field(default_factory=list)
    #: this registration's hold key (ipc/hold_token.py): issues and checks the
    #: tokens of its holds; the checking half is in ``info`` for peers
    hold_key: bytes = b""
    _seq: int = 0
    #: polls waiting for this rank's next completion (``Poll.wait_s``)
    _pollers: list[asyncio.Future[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.lanes:
            self.lanes = [self.worker]
        if self.lanes[0] is not self.worker:
            raise ValueError("lane 0 must be the engine rank's worker")
        s = self.settings
        self.holds = HoldBook(default_timeout_s=s.hold_timeout_s, grace_s=s.notif_grace_s,
                              on_done=self.hold_done, lease_s=s.hold_lease_s,
                              max_life_s=s.hold_max_life_s,
                              max_early=s.max_early_notifications,
                              # as many ends as completions may await a poll (a hold
                              # sent again meets `duplicate`); refusals are remembered
                              # there too, so only that many refusals between an end
                              # and its poll could push the end out
                              max_ended=max(65536, s.max_completions_per_engine),
                              # one member's early claims never refuse another's
                              max_early_per_member=max(1, s.max_early_notifications // 4))

    @property
    def staging_mode(self) -> str:
        """off, auto or always: settings.staging where a staging pool is attached
        (host memory only), else off."""
        return self.settings.staging if self.staging is not None else "off"

    @property
    def post_during_claim_s(self) -> float:
        """Post reads during their claim over links P confirmed this recently
        (seconds; 0 = claim first)."""
        return self.settings.post_during_claim_s

    @property
    def verify_bytes(self) -> bool:
        """Verify the bytes of every read (a read may ask alone)."""
        return self.settings.verify_bytes

    def complete(self, c: Completion) -> None:
        if self.metrics is not None:
            self.metrics.series(self.metrics.completions, self.engine_id, c.kind).inc()
        if self.on_complete is not None:
            self.on_complete(self.engine_id, c)
        self._seq += 1
        self.completions.append((self._seq, c))
        self.wake_pollers()

    @property
    def waiting_polls(self) -> int:
        return len(self._pollers)

    async def wait_for_completion(self, wait_s: float) -> None:
        """Return when a completion arrives, ``wait_s`` passes or the rank goes
        (:meth:`wake_pollers`); the caller then polls as usual."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pollers.append(fut)
        timer = loop.call_later(wait_s, _resolve, fut)
        try:
            await fut
        finally:
            timer.cancel()
            if fut in self._pollers:
                self._pollers.remove(fut)

    def wake_pollers(self) -> None:
        """Answer every waiting poll now (a completion arrived, or the rank is going)."""
        pollers, self._pollers = self._pollers, []
        for fut in pollers:
            _resolve(fut)

    def poll(self, ack: int | None, epoch: str) -> Completions:
        """Drop what the engine acknowledged (same epoch), return the rest."""
        if ack is None:
            items = [c for _, c in self.completions]
            self.completions.clear()
        else:
            if epoch == self.epoch:
                while self.completions and self.completions[0][0] <= ack:
                    self.completions.popleft()
            items = [c for _, c in self.completions]
        return Completions(items=items, last=self._seq, epoch=self.epoch)

    def has_completion(self, request_id: str) -> bool:
        """Whether an outcome for ``request_id`` waits to be polled (or acknowledged).

        A release that loses the race against its own read's completion finds the
        request here: nothing is left to release, and the completion is its outcome.
        """
        return any(c.request_id == request_id for _, c in self.completions)

    def hold_done(self, o: HoldOutcome) -> None:
        self.complete(Completion(o.request_id, o.kind, o.reason, readers=[
            ReaderReport(r.engine_id, list(r.ranks), r.finished, r.failure) for r in o.readers]))
        self.worker.set_hot(len(self.holds) > 0)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
