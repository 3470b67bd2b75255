"""One registered engine rank: its memory, its NIXL agent, its queue of completions.

Each engine rank gets its own NIXL worker (agent + thread). An agent's
metadata then never changes after registration, so a peer that loaded it once
never reads with a stale copy, and notifications arrive at the agent of the
engine they are for.

With ``--post-lanes N`` a D engine rank has N workers ("lanes"), the engine's
memory registered in each: lane 0 is :attr:`EngineRank.worker`, the agent
peers know (handshake, notifications in and out, holds); the others only post
READs (see :func:`~kvsidecar.daemon.reads.lane_of`). Why: on host memory
``transfer()`` is the CMA copy itself, so one worker thread copies a hetero
read's P ranks one after the other while the other core idles.

Memory comes in both ownership directions: *attach* maps regions the engine
created; *allocate* creates them here and hands references back (the
direction GPU memory needs, since memory belongs to the process that
registers it). Either way the sizes are checked against the layout before
NIXL sees an address.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from kvsidecar.daemon import memory_kinds
from kvsidecar.daemon.holds import HoldBook, HoldOutcome
from kvsidecar.daemon.memory_kinds import Gpu, MemoryContext
from kvsidecar.daemon.peers.links import PeerLinks
from kvsidecar.daemon.peers.messages import HandshakeInfo
from kvsidecar.daemon.staging import StagingPool
from kvsidecar.daemon.transport.worker import NixlWorker
from kvsidecar.ipc.layout import Layout
from kvsidecar.ipc.protocol import (
    BAD_REQUEST,
    Completion,
    Completions,
    ReaderReport,
    RegionRef,
    RequestError,
)
from kvsidecar.ipc.regions import Region
from kvsidecar.metrics.registry import Metrics

log = logging.getLogger(__name__)


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
    hold_timeout_s: float
    notif_grace_s: float
    hold_lease_s: float = 10.0
    hold_max_life_s: float = 600.0
    max_early_notifications: int = 4096
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
    #: off, auto or always (settings.staging; off for GPU memory)
    staging_mode: str = "off"
    #: post reads during their claim over links P confirmed this recently (seconds;
    #: settings.post_during_claim_s, 0 = claim first)
    post_during_claim_s: float = 2.0
    #: sidecar-owned host memory for staged reads (None: never staged)
    staging: StagingPool | None = None
    #: every worker that posts reads, lane 0 (``worker``) first; set from ``worker``
    #: when left empty (one lane)
    lanes: list[NixlWorker] = field(default_factory=list)
    #: verify the bytes of every read (settings.verify_bytes); a read may ask alone
    verify_bytes: bool = False
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
        self.holds = HoldBook(default_timeout_s=self.hold_timeout_s, grace_s=self.notif_grace_s,
                              on_done=self.hold_done, lease_s=self.hold_lease_s,
                              max_life_s=self.hold_max_life_s,
                              max_early=self.max_early_notifications,
                              # one member's early claims never refuse another's
                              max_early_per_member=max(1, self.max_early_notifications // 4))

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


def map_regions(engine_id: str, layout: Layout, mode: str, refs: list[RegionRef],
                shm_prefix: str = "kvs", owner_uid: int | None = None,
                memory: str = "shm", gpu: Gpu | None = None,
                reserved: Region | None = None, allow_unsealed_shm: bool = False,
                ) -> tuple[list[Region], bool]:
    """Map (attach) or create (allocate) the engine's regions; (regions, owned).

    Allocated host segments are named ``<shm_prefix>-<engine id>-...``, so a
    restarted sidecar can find (and remove) exactly its own leftovers.

    Attach mode maps only what the engine could have mapped itself: shared
    memory named ``ENGINE_SHM_PREFIX...``, owned by the registering engine's
    uid (``owner_uid``, from its socket credentials), each exactly one layout
    region long (GPU memory: as the attach policy allows). The sidecar may run
    as a more privileged user than its engines; without these checks an engine
    could have it map, and expose to peers, another tenant's memory. POSIX shm
    (either mode) only with ``allow_unsealed_shm``: it cannot be sealed against
    truncation. Each kind is served by an entry of
    :mod:`kvsidecar.daemon.memory_kinds`.
    """
    ctx = MemoryContext(engine_id, shm_prefix, owner_uid, gpu, reserved, allow_unsealed_shm)
    if mode == "allocate":
        if refs:
            raise RequestError(BAD_REQUEST, "allocate mode takes no region references")
        return memory_kinds.allocate(memory, layout.num_regions, layout.region_bytes, ctx), True
    if len(refs) != layout.num_regions:
        raise RequestError(BAD_REQUEST, f"layout has {layout.num_regions} regions, "
                                        f"{len(refs)} region references were sent")
    return memory_kinds.attach(refs, layout, ctx), False


def release_regions(regions: list[Region], owned: bool) -> int:
    """Unmap (and, if this sidecar created them, unlink) an engine's regions.

    Blocking (hundreds of ms per GB to give the pages back): call it off the
    event loop. Failures are logged and returned as a count (the caller
    counts them in its metrics), never raised: the engine is gone either way.
    """
    failures = 0
    for r in regions:
        try:
            r.close()
            if owned:
                r.unlink()
        except Exception as e:
            log.warning("releasing region %r failed: %s", r.name, e)
            failures += 1
    return failures


def shm_prefix_for(socket_path: str) -> str:
    """``kvs-<8 hex>``: the name prefix of the segments one sidecar allocates,
    derived from its (absolute) socket path. Two sidecars never serve the same
    socket at once, so the prefix tells this sidecar's segments from every
    other's, across its own restarts."""
    digest = hashlib.sha256(os.path.abspath(socket_path).encode()).hexdigest()[:8]
    return f"kvs-{digest}"


def remove_stale_segments(prefix: str, shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink the segments a previous run of this sidecar left (``<prefix>-*``).

    Only call it once this sidecar owns its socket (no other live sidecar can
    then use the same prefix). Returns the names removed.
    """
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in sorted(names):
        if name.startswith(prefix + "-"):
            try:
                os.unlink(os.path.join(shm_dir, name))
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("cannot remove stale shared memory %s: %s", name, e)
                continue
            removed.append(name)
    return removed
