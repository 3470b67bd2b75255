"""One NIXL agent, owned by one thread, driven from an asyncio loop.

Threading discipline
--------------------
*Why one thread.* A NIXL agent created without a listener thread runs in
``NIXL_THREAD_SYNC_NONE`` mode: it has no internal lock, and two threads calling
into one agent segfaulted. A synchronising mode would add a lock per call and
still let two threads progress the same UCX worker. Instead every NIXL call
(agent creation and destruction included) happens on :class:`NixlWorker`'s own
thread. The event loop never touches the agent: coroutines put jobs on a
:class:`queue.Queue` and await asyncio futures that the thread resolves with
``loop.call_soon_threadsafe`` (once per round, for everything that round
finished). :meth:`NixlWorker.post_soon` puts the reads and notifications of
one loop iteration (a batch of reads) on the queue as one entry: one put and
one wake-up of the thread instead of one per read.

*Several workers per engine rank ("lanes", ``--post-lanes``).* One thread
owns one agent, so parallel posting means more agents: a D engine rank may
have N workers, its memory registered in each. On host memory
``transfer()`` is the CMA copy, so posts of different P ranks on different
lanes copy on different cores. Each lane resets alone (the rule below holds
per lane); the owner treats any lane's reset like lane 0's for its links.

*Why not on the loop.* On host memory UCX reads through CMA
(``process_vm_readv``) and ``transfer()`` performs the whole copy inline: a
256 MiB read blocks its caller for about 50 ms. ``register_memory``,
``add_remote_agent`` (10-17 ms with UCX peer error handling) and building
descriptor lists for thousands of blocks are heavy too. NIXL releases the GIL
during the copy (a 64 MiB read on this thread leaves a 1 ms loop tick on
time), so here they cost the loop next to nothing.

*Why no progress thread.* NIXL's own progress thread polls UCX with a zero
delay (the Python wrapper hard-wires ``pthrDelay = 0``) and burns a whole core
even when nothing happens. It is disabled; this thread drives progress itself:
``check_xfer_state`` progresses outgoing transfers and ``get_new_notifs``
progresses the UCX worker (peers wiring up to us, notifications arriving). Both
cost about a microsecond.

*How progress is driven.* Each round runs the queued jobs, then polls: every
in-flight handle, then ``get_new_notifs``. Between the jobs of a round it also
polls the in-flight handles and hands finished results to the loop after a
job that took ``busy_poll_s`` or more: a large read's ``transfer()`` copies
for milliseconds, and reads that ended meanwhile should not wait for the
round's last post.
Then it blocks on the job queue for a wait that depends on what may arrive
(:meth:`NixlWorker.poll_wait_s` says which it chose last):

- a completion is imminent: ``soon_poll_s`` (50 us) for at most
  ``soon_window_s`` (5 ms) after this worker posted a read that did not finish
  inside ``transfer()`` (while at most ``soon_max_reads`` transfers are in
  flight), or after the owner granted a reader a lease
  (:meth:`NixlWorker.expect_reads`) until the next notification arrives. Why
  the target side too: NIXL ends every transfer with an
  endpoint flush, and over UCX with CMA for the bytes and tcp for control
  (notifications) that flush completes only once the *peer's* worker answers
  it. Measured on a 16 KiB read with a notification, the reader polling
  without pause: done in about 90 us against a peer progressing every 1 ms
  about half the time, 48 ms against one progressing every 50 ms; the
  sidecar's 1-block read spent 0.7-0.9 ms from post to done while P polled
  every ``hot_poll_s``;
- reads in flight: ``busy_poll_s`` (0.2 ms; their completion is the decode
  engine's latency);
- a reader holds a lease on our blocks (:meth:`NixlWorker.expect_reads`, told
  by the owner when a peer claims or renews one): ``hot_poll_s`` (1 ms). Over
  UCX/TCP a peer's READ is served by *our* progress and its first transfer
  wires up only when we progress, so this rate is the reader's speed;
- otherwise the wait escalates: it starts at ``hot_poll_s`` (blocks held,
  :meth:`NixlWorker.set_hot`) or ``idle_poll_s`` and doubles with every round
  in which nothing happened, up to ``hot_max_s`` (50 ms: a held block waits
  only for notifications, which arrive under a lease anyway; this cap is for a
  peer that reads without one) or ``idle_max_s`` (0.5 s: nothing is expected;
  the cap only bounds how late UCX sees a peer go away).

Anything that happens (a job, a wake-up, a notification) starts the escalation
again from its floor. A submitted job, ``set_hot(True)`` and ``expect_reads``
wake the thread at once through the queue, so outbound work never waits for a
tick and the event loop, which learns of inbound work first (a hold, a lease
claim), switches the worker to tight polling before the peer posts its read.
The trade-off is latency against CPU, and the cost is the wake-ups, not NIXL
(an idle ``get_new_notifs`` is about 1.5 us): on a 2-vCPU VM one timed wake-up
costs 100-150 us of CPU, so a worker ticking every 5 ms used 2-3 % of a core,
every 1 ms about 8 %; at the 0.5 s idle cap it is 2 wake-ups a second.
Destroying an agent after long sleeps is safe because the agent is progressed
for a while first (see ``_drain``). ``benchmarks/nixl_worker_idle.py``
measures the idle and hot figures.

*Notifications are lazy.* NIXL sends the notification attached to a READ only
when the initiator observes the transfer as DONE, so every handle is polled to
completion even if the awaiting coroutine was cancelled, and only then
released.

*A failed read is reported only once it is dead.* NIXL has no abort: releasing
the handle of a READ in flight, or removing the remote agent, does not stop the
bytes (measured over UCX/TCP: 380 of 384 MiB landed after both). Destroying the
reading agent does (its UCX worker and endpoints go, and with them every way a
byte reaches our memory on host DRAM: TCP receives are driven by that worker,
CMA copies happen inline in ``transfer()``). So a read that passes its deadline,
ends in an error state or fails while posting *resets* the agent: every handle
is dropped, the agent is destroyed and a fresh one (named ``<name>-g<N>``) is
created with the same memory registered again. Only then do the read's future
and those of the other reads in flight on that agent fail (they died with it).
The owner learns the new name and metadata through ``on_reset`` (peers must
link and handshake again); reads submitted for links made before the reset fail
with :class:`~kvsidecar.daemon.transport.errors.NixlAgentReset` before anything
is posted. Shutdown does the same with reads still stuck at its deadline: the
agent is destroyed before any of them is reported and before ``stop()``
returns, so the caller may unmap the memory afterwards.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import importlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from kvsidecar.daemon.thread_names import prctl_this_thread
from kvsidecar.daemon.transport.errors import (
    NixlAgentReset,
    NixlError,
    NixlKilledByReset,
    NixlTimeout,
    wrap,
)
from kvsidecar.daemon.transport.merging import group_posts
from kvsidecar.daemon.transport.metadata import peek_agent_name
from kvsidecar.daemon.transport.probe import transport_note

log = logging.getLogger(__name__)

__all__ = ["AgentReset", "NixlAgentReset", "NixlError", "NixlKilledByReset", "NixlTimeout",
           "NixlWorker", "NotifyOp", "PollPolicy", "ReadOp", "TransferStats", "transport_note"]

#: keep polling in-flight reads while a burst of jobs arrives (a group of posts
#: counts each post; a group is never split)
_MAX_JOBS_PER_ROUND = 64
#: After a reset whose agent could not be created again (e.g. UCX finds no usable
#: network device while the link is down), retry after these many seconds,
#: doubling up to the cap: a link that comes back brings the worker back.
_RECREATE_FIRST_S = 0.5
_RECREATE_MAX_S = 5.0
_STOP_WAIT_S = 5.0  # how long stop() lets in-flight transfers finish
_DRAIN_BEFORE_DESTROY_S = 0.2  # progress before an agent is destroyed (see _drain)
#: A read of more than this many bytes never merges with others into one transfer
#: (see merging.py). Merging saves about 0.4 ms per transfer (a post and a
#: notification) and delays a read's completion by the bytes merged after it; past
#: about 2 MiB (0.45 ms on the wire here, 4.7 GB/s) it delays more than it saves,
#: and holds back the scatter of a staged read, which can run beside the next
#: read's copy. Small reads (the sustained figure's 256 KiB) merge as before.
MERGE_MAX_READ_BYTES = 2 << 20


@dataclass(frozen=True)
class TransferStats:
    """What one finished read cost.

    ``bytes`` and ``descriptors`` are what was asked for; ``post_us`` is the time
    spent posting (``transfer()``, which on host memory includes the CMA copy)
    and ``xfer_us`` the time from the post to the moment the worker saw DONE.
    Both come from NIXL's telemetry when ``telemetry`` is true, else from the
    worker's own clock. A read that travelled in one transfer with others
    (see :mod:`~kvsidecar.daemon.transport.merging`) keeps its own ``bytes``
    and ``descriptors`` and shares the transfer's times; ``reads`` is how many
    reads that transfer carried and ``first`` is true for one of them only
    (count transfers by it).
    """

    bytes: int
    descriptors: int
    post_us: float
    xfer_us: float
    telemetry: bool = False
    reads: int = 1
    first: bool = True


@dataclass(frozen=True)
class PollPolicy:
    """How long the worker waits for work before polling NIXL again (seconds).

    Fixed while reads are in flight (``busy_s``) or expected (``hot_s``: a
    reader holds a lease); otherwise a wait that starts at a floor (``hot_s``
    with blocks held, ``idle_s`` without) and doubles with every round in which
    nothing happened, up to a cap (``hot_max_s`` / ``idle_max_s``). Pure, so
    the escalation is tested without threads or clocks.
    """

    busy_s: float = 0.0002
    hot_s: float = 0.001
    hot_max_s: float = 0.05
    idle_s: float = 0.005
    idle_max_s: float = 0.5
    #: the wait while a transfer's completion is imminent (``soon``, see NixlWorker)
    soon_s: float = 0.00005
    #: how long such a window lasts at most after it opened (seconds)
    soon_window_s: float = 0.005

    def __post_init__(self) -> None:
        if min(self.busy_s, self.hot_s, self.idle_s, self.soon_s) <= 0:
            raise ValueError("poll intervals must be positive")
        if self.hot_max_s < self.hot_s or self.idle_max_s < self.idle_s:
            raise ValueError("a poll cap must not be below its floor")

    def next_wait(self, last: float, *, active: bool, inflight: bool, reads_expected: bool,
                  hot: bool, soon: bool = False) -> float:
        """The wait after a round that waited ``last``; ``active``: something
        happened in it (a job, a wake-up, a notification); ``soon``: a
        completion is imminent (a read of ours posted, or one of a reader we
        just granted a lease, within ``soon_window_s``)."""
        if soon:
            return self.soon_s
        if inflight:
            return self.busy_s
        if reads_expected:
            return self.hot_s
        floor, cap = (self.hot_s, self.hot_max_s) if hot else (self.idle_s, self.idle_max_s)
        if active:
            return floor
        return min(cap, max(floor, last * 2))


# -- the worker ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class AgentReset:
    """What ``on_reset`` is told after the agent was destroyed and created again."""

    generation: int
    agent_name: str
    metadata: bytes
    reason: str
    reads_failed: int
    teardown_s: float


_DEFERRED = object()  # a job's result when its future is resolved later (in-flight reads)

_Fut = asyncio.Future[Any]
_JobFn = Callable[[_Fut], object]


@dataclass
class _Job:
    fn: _JobFn
    fut: _Fut
    what: str
    remote: str | None


#: what the job queue carries: the jobs of one submission (one put, one wake-up of
#: the thread), or None, which only wakes it
_Entry = tuple[_Job, ...] | None


@dataclass(frozen=True)
class ReadOp:
    """One read for :meth:`NixlWorker.post_soon`: the arguments of :meth:`NixlWorker.read`."""

    remote_agent: str
    local_addr: npt.NDArray[np.int64]
    remote_addr: npt.NDArray[np.int64]
    length: npt.NDArray[np.int64]
    notif: bytes | None = None
    mem_type: str = "DRAM"
    dev_id: int = 0
    remote_dev_id: int | None = None
    timeout_s: float | None = None
    generation: int | None = None
    remote_mem_type: str | None = None
    #: the most reads the peer accepts named in one notification (its handshake's
    #: ``notif_batch_reads``): 2 or more lets this read share one transfer with
    #: other reads of the same flush to that agent; 0 never
    merge: int = 0


@dataclass(frozen=True)
class NotifyOp:
    """One bare notification for :meth:`NixlWorker.post_soon` (``merge`` as for
    ReadOp: notifications of one flush to that agent go as one)."""

    remote_agent: str
    message: bytes
    merge: int = 0


@dataclass
class _Inflight:
    handle: Any
    fut: _Fut
    remote: str
    nbytes: int
    ndesc: int
    t0: float
    t_post: float
    deadline: float | None = None
    timed_out: bool = False


def _share(futs: list[_Fut], parts: list[tuple[int, int]] | None, merged: _Fut) -> None:
    """Hand a merged transfer's outcome to each read in it (loop thread): its
    own bytes and descriptors, the shared times; a failure fails them all."""
    exc = None if merged.cancelled() else merged.exception()
    for i, fut in enumerate(futs):
        if fut.done():
            continue
        if merged.cancelled():
            fut.cancel()
        elif exc is not None:
            fut.set_exception(exc)
        elif parts is None:
            fut.set_result(None)
        else:
            nbytes, ndesc = parts[i]
            got: TransferStats = merged.result()
            # Built directly: dataclasses.replace per read cost several us.
            fut.set_result(TransferStats(nbytes, ndesc, got.post_us, got.xfer_us,
                                         got.telemetry, len(futs), i == 0))


_PR_SET_TIMERSLACK = 29
#: this thread's timer slack (ns): how late the kernel may end its timed waits
_TIMER_SLACK_NS = 1000


def _tight_timers() -> None:
    """Let the calling thread's timed waits end on time (Linux; else nothing).

    Why: Linux ends a timed wait up to the thread's timer slack late, 50 us by
    default, so the worker's 50 us soon poll took 110 us (p50, measured here);
    with 1 us slack it takes 60 us, at ~11 us of CPU per wake-up either way.
    Only this thread's slack changes (prctl applies per thread)."""
    if not prctl_this_thread(_PR_SET_TIMERSLACK, _TIMER_SLACK_NS):
        log.debug("cannot set the NIXL worker's timer slack")


_uadd = np.add.reduce  # the ufunc: ndarray.sum() goes through a Python wrapper


def _as_int64(a: npt.ArrayLike) -> npt.NDArray[np.int64]:
    return np.ascontiguousarray(a, dtype=np.int64)


class NixlWorker:
    """Owns one NIXL agent on one thread; coroutine methods submit jobs to it.

    ``on_notif(remote_agent, message)`` runs on the event loop thread. Reads
    must not be given arrays that the caller mutates before the read returns
    (they are turned into descriptor lists on the worker thread).
    """

    def __init__(
        self,
        name: str,
        *,
        backends: Sequence[str] = ("UCX",),
        on_notif: Callable[[str, bytes], None] | None = None,
        on_reset: Callable[[AgentReset], None] | None = None,
        idle_poll_s: float = 0.005,
        busy_poll_s: float = 0.0002,
        hot_poll_s: float = 0.001,
        idle_max_s: float = 0.5,
        hot_max_s: float = 0.05,
        soon_poll_s: float = 0.00005,
        soon_window_s: float = 0.005,
        soon_max_reads: int = 2,
        backend_params: Mapping[str, Mapping[str, str]] | None = None,
        telemetry: bool = True,
        stop_timeout_s: float = _STOP_WAIT_S,
        thread_init: Callable[[], None] | None = None,
        join_notifs: Callable[[list[bytes]], bytes] | None = None,
        max_notif_bytes: int = 16384,
        merge_max_read_bytes: int = MERGE_MAX_READ_BYTES,
    ) -> None:
        """``join_notifs`` makes one notification out of several (see
        :func:`kvsidecar.daemon.notifications.join`); without it, or for ops
        whose ``merge`` is below 2, every post is its own transfer."""
        if not name:
            raise ValueError("agent name must not be empty")
        self._base_name = name
        self._name = name  # the current agent's name, on the worker thread
        self._public_name = name  # the same, as the event loop knows it
        self._on_reset = on_reset
        #: the agent's generation as the event loop knows it (set by the reset callback)
        self.generation = 0
        #: resets so far and the last one's teardown time (for metrics and the README)
        self.resets = 0
        #: deregistrations that failed at shutdown (logged; counted by the owner)
        self.cleanup_failures = 0
        self._backends = tuple(backends)
        self._backend_params = {k: dict(v) for k, v in (backend_params or {}).items()}
        self._on_notif = on_notif
        self._policy = PollPolicy(busy_poll_s, hot_poll_s, hot_max_s, idle_poll_s, idle_max_s,
                                  soon_poll_s, soon_window_s)
        self._telemetry = telemetry
        self._stop_timeout_s = stop_timeout_s
        #: runs first on the worker thread: a GPU sidecar makes its CUDA context
        #: current there, before the agent registers VRAM or transfers
        self._thread_init = thread_init
        self._join_notifs = join_notifs
        self._max_notif_bytes = max_notif_bytes
        self._merge_max_read_bytes = merge_max_read_bytes

        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._jobs: queue.Queue[_Entry] = queue.Queue()
        #: posts of this loop iteration, put on the queue as one entry by _post_soon_now
        self._soon: list[tuple[ReadOp | NotifyOp, _Fut]] = []
        #: the job of a post already checked (_check_read), by its type
        self._job_of: dict[type, Callable[[Any], tuple[str, _JobFn]]] = {
            ReadOp: self._read_job, NotifyOp: self._prepare_notify}
        self._lock = threading.Lock()  # orders submissions against shutdown
        self._stop_requested = False
        self._closed = False
        self._hot = False
        #: poll at hot_poll_s until this monotonic time (a reader holds a lease)
        self._reads_expected_until = 0.0
        #: poll at soon_poll_s until this monotonic time or the next notification,
        #: whichever comes first (see expect_reads)
        self._soon_until = 0.0
        #: leases granted (counted on the loop thread, read by the worker's rounds)
        self._grants = 0
        #: when this worker last posted a read that did not finish inside transfer()
        self._last_post = 0.0
        #: the soon window applies while at most this many reads are awaited
        #: (see _completion_imminent)
        self._soon_max = soon_max_reads
        #: the wait the worker thread chose last (seconds); for tests and metrics
        self._poll_wait_s = 0.0
        #: monotonic time the worker thread last went round its poll loop
        self.heartbeat = time.monotonic()
        self._started_fut: _Fut | None = None
        self._stopped_fut: _Fut | None = None

        # Owned by the worker thread only.
        self._agent: Any = None
        self._inflight: list[_Inflight] = []
        self._inflight_by_agent: dict[str, int] = {}
        self._remotes: dict[str, bytes] = {}
        self._regs: dict[int, Any] = {}
        self._reg_specs: dict[int, tuple[list[tuple[int, int]], str, int]] = {}
        self._gen = 0  # the worker thread's generation
        self._doomed: list[tuple[_Inflight, BaseException]] = []
        self._pending_reset: tuple[str, int, float] = ("", 0, 0.0)
        #: why the agent is down after a reset that could not create it again ('' when up)
        self._down = ""
        self._down_since = 0.0
        self._recreate_at = 0.0
        self._recreate_wait = _RECREATE_FIRST_S
        self._recreate_tries = 0
        #: the same as _down, for the event loop (readiness); a str store is atomic
        self.down_reason = ""
        self._reg_ids = itertools.count(1)
        self._out_futs: list[tuple[_Fut, object, BaseException | None]] = []
        self._out_notifs: list[tuple[str, bytes]] = []
        self._stuck_handles: list[Any] = []

    # -- public API (event loop side) ------------------------------------------------------------

    @property
    def agent_name(self) -> str:
        """The current agent's name (it changes with every reset)."""
        return self._public_name

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._closed

    @property
    def native_thread_id(self) -> int | None:
        """The worker thread's kernel id, for per-thread CPU accounting (/proc/.../task)."""
        return None if self._thread is None else self._thread.native_id

    async def start(self) -> None:
        """Create the thread and, on it, the agent; raise NixlError if NIXL fails."""
        if self._thread is not None:
            raise RuntimeError("NixlWorker.start() called twice")
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._started_fut = loop.create_future()
        self._stopped_fut = loop.create_future()
        self._thread = threading.Thread(
            target=self._run, name=f"nixl-{self._name}", daemon=True
        )
        self._thread.start()
        await self._started_fut

    async def stop(self) -> None:
        """Fail queued jobs, let in-flight reads finish (bounded), free everything, join."""
        if self._thread is None or self._stopped_fut is None:
            return
        with self._lock:
            self._stop_requested = True
        self._jobs.put(None)
        await asyncio.shield(self._stopped_fut)
        self._thread.join(timeout=1.0)

    async def register(
        self, regions: Sequence[tuple[int, int]], mem_type: str = "DRAM", dev_id: int = 0
    ) -> int:
        """Register (addr, nbytes) regions as one registration; returns its id."""
        if len(regions) == 0:
            raise ValueError("register() needs at least one region")
        for addr, nbytes in regions:
            if addr <= 0 or nbytes <= 0:
                raise ValueError(f"bad region (addr={addr:#x}, nbytes={nbytes})")
        fn = functools.partial(self._do_register, list(regions), mem_type, dev_id)
        reg_id: int = await self._submit(f"register {len(regions)} {mem_type} regions", fn)
        return reg_id

    async def deregister(self, reg_id: int) -> None:
        await self._submit(
            f"deregister registration {reg_id}", functools.partial(self._do_deregister, reg_id)
        )

    async def metadata(self) -> bytes:
        """This agent's metadata, including the regions registered so far."""
        md: bytes = await self._submit("get agent metadata", self._do_metadata)
        return md

    async def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name.

        Identical metadata is a no-op. Changed metadata for a known name removes
        the old entry first, since NIXL would otherwise keep the stale regions;
        that needs no reads to the peer in flight.
        """
        name, _ = await self.add_remote_at(metadata)
        return name

    async def add_remote_at(self, metadata: bytes) -> tuple[str, int]:
        """:meth:`add_remote`, also returning the generation of this agent the
        metadata was loaded into, as the worker thread saw it when it loaded.

        Why not read :attr:`generation` around the call: the job may run after
        a reset the event loop has not heard of yet (or before one it has), and
        a link labelled with the wrong generation either fails every read over
        it with :class:`NixlAgentReset` or lets a read post over a gone agent.
        """
        if not metadata:
            raise ValueError("empty metadata")
        peek = peek_agent_name(metadata)
        what = f"add remote agent {peek!r}" if peek else "add remote agent"
        got: tuple[str, int] = await self._submit(
            what, functools.partial(self._do_add_remote, bytes(metadata)), remote=peek
        )
        return got

    async def remove_remote(self, agent: str) -> None:
        await self.remove_remote_soon(agent)

    def remove_remote_soon(self, agent: str) -> _Fut:
        """:meth:`remove_remote`, queued before this returns (raises NixlError if
        the worker stopped): an owner unloading one agent from several workers
        queues every removal in one step, so nothing it checked just before (no
        new link loads that agent) can change in between."""
        return self._submit(
            f"remove remote agent {agent!r}",
            functools.partial(self._do_remove_remote, agent),
            remote=agent,
        )

    async def read(
        self,
        remote_agent: str,
        local_addr: npt.NDArray[np.int64],
        remote_addr: npt.NDArray[np.int64],
        length: npt.NDArray[np.int64],
        notif: bytes | None = None,
        mem_type: str = "DRAM",
        dev_id: int = 0,
        remote_dev_id: int | None = None,
        timeout_s: float | None = None,
        generation: int | None = None,
        remote_mem_type: str | None = None,
    ) -> TransferStats:
        """READ ``length[i]`` bytes from ``remote_addr[i]`` on the peer into ``local_addr[i]``.

        With zero descriptors only the notification (if any) is sent.
        ``mem_type``/``dev_id`` describe the local memory (``DRAM``/``VRAM``
        and the CUDA ordinal), ``remote_mem_type``/``remote_dev_id`` the
        peer's as its handshake advertised them (default: the same). A read still in progress
        ``timeout_s`` after posting fails with NixlTimeout, and a read that ends
        in an error fails with NixlError, each only after the agent was reset
        (see the module docstring): a failed read never leaves a transfer
        writing into memory the caller believes is free. ``generation`` is the
        agent generation the caller linked ``remote_agent`` in; a read for an
        older generation fails with NixlAgentReset without posting anything.
        """
        op = ReadOp(remote_agent, local_addr, remote_addr, length, notif, mem_type, dev_id,
                    remote_dev_id, timeout_s, generation, remote_mem_type)
        what, fn = self._prepare_read(op)
        stats: TransferStats = await self._submit(what, fn, remote=remote_agent)
        return stats

    async def notify(self, remote_agent: str, message: bytes) -> None:
        what, fn = self._prepare_notify(NotifyOp(remote_agent, message))
        await self._submit(what, fn, remote=remote_agent)

    def post_soon(self, op: ReadOp | NotifyOp) -> asyncio.Future[TransferStats | None]:
        """:meth:`read` or :meth:`notify` without a coroutine: the returned future
        resolves as theirs would. Every op posted this way in one event-loop
        iteration reaches the thread as ONE queue entry (one put, one wake-up)
        right after it; the thread still posts each op on its own, so each keeps
        its own transfer, notification, future and failure (a bad op, or one
        whose transfer fails, fails only its own future; a read whose failure
        resets the agent fails those in flight with it, as with :meth:`read`).
        Must be called on the event loop thread.

        Exception: reads (and notifications) with ``merge`` of 2 or more to the
        same agent in one flush travel as ONE transfer carrying one joined
        notification (see :mod:`~kvsidecar.daemon.transport.merging`); each
        still gets its own future, and if that transfer fails, every read in it
        fails with the same error."""
        loop = self._loop
        if loop is None:
            raise NixlError("post: worker not started", remote=op.remote_agent)
        fut: _Fut = loop.create_future()
        if not self._soon:
            loop.call_soon(self._post_soon_now)
        self._soon.append((op, fut))
        return fut

    def _post_soon_now(self) -> None:
        ops, self._soon = self._soon, []
        valid: list[tuple[ReadOp | NotifyOp, _Fut]] = []
        for op, fut in ops:
            if fut.done():  # cancelled before it was handed over
                continue
            if isinstance(op, ReadOp):
                try:
                    self._check_read(op)  # its job is made below, unless merged
                except (ValueError, TypeError) as exc:
                    fut.set_exception(exc)
                    continue
            valid.append((op, fut))
        jobs: list[_Job] = []
        for group in self._group(valid):
            if len(group) == 1:
                op, fut = valid[group[0]]
                what, fn = self._job_of[type(op)](op)
                jobs.append(_Job(fn, fut, what, op.remote_agent))
            else:
                jobs.append(self._merged_job([valid[i] for i in group]))
        if not jobs:
            return
        with self._lock:
            stopped = self._stop_requested or self._closed
            if not stopped:
                self._jobs.put(tuple(jobs))
        if stopped:
            for job in jobs:
                job.fut.set_exception(NixlError(f"{job.what}: worker stopped",
                                                remote=job.remote))

    def _group(self, valid: Sequence[tuple[ReadOp | NotifyOp, _Fut]]) -> list[list[int]]:
        """Which valid posts of this flush share a transfer (index groups)."""
        if self._join_notifs is None or len(valid) < 2:
            return [[i] for i in range(len(valid))]
        keys: list[tuple[object, ...] | None] = []
        sizes: list[int] = []
        nbytes: list[int] = []
        for op, _ in valid:
            if isinstance(op, ReadOp):
                key: tuple[object, ...] | None = (
                    "read", op.remote_agent, op.generation, op.mem_type, op.dev_id,
                    op.remote_dev_id, op.remote_mem_type) if len(op.length) else None
                sizes.append(len(op.notif or b""))
                nbytes.append(int(_uadd(_as_int64(op.length))) if key is not None else 0)
            else:
                key = ("notify", op.remote_agent)
                sizes.append(len(op.message))
                nbytes.append(0)
            keys.append(key if op.merge >= 2 else None)
        return group_posts(keys, [op.merge for op, _ in valid], sizes,
                           self._max_notif_bytes - 16, nbytes,
                           self._merge_max_read_bytes)

    def _merged_job(self, members: list[tuple[ReadOp | NotifyOp, _Fut]]) -> _Job:
        """One job for posts :meth:`_group` put together: one transfer (or one
        notification) whose outcome every member's future gets."""
        assert self._loop is not None and self._join_notifs is not None
        ops = [op for op, _ in members]
        first = ops[0]
        futs = [fut for _, fut in members]
        fut: _Fut = self._loop.create_future()
        if isinstance(first, NotifyOp):
            msgs = [op.message for op in ops if isinstance(op, NotifyOp)]
            what, fn = self._prepare_notify(NotifyOp(first.remote_agent,
                                                     self._join_notifs(msgs)))
            fut.add_done_callback(functools.partial(_share, futs, None))
        else:
            reads = [op for op in ops if isinstance(op, ReadOp)]
            notes = [op.notif for op in reads if op.notif]
            timeouts = [op.timeout_s for op in reads if op.timeout_s is not None]
            merged = replace(
                first, local_addr=np.concatenate([_as_int64(op.local_addr) for op in reads]),
                remote_addr=np.concatenate([_as_int64(op.remote_addr) for op in reads]),
                length=np.concatenate([_as_int64(op.length) for op in reads]),
                notif=self._join_notifs(notes) if notes else None,
                timeout_s=min(timeouts) if timeouts else None)
            what, fn = self._read_job(merged)
            what = f"{what} ({len(reads)} reads in one transfer)"
            parts = [(int(_uadd(_as_int64(op.length))), len(op.length)) for op in reads]
            fut.add_done_callback(functools.partial(_share, futs, parts))
        return _Job(fn, fut, what, first.remote_agent)

    def _prepare_read(self, op: ReadOp) -> tuple[str, _JobFn]:
        """Check a read's arguments (raises ValueError/TypeError) and make its job."""
        self._check_read(op)
        return self._read_job(op)

    @staticmethod
    def _check_read(op: ReadOp) -> None:
        """Raise ValueError/TypeError for arguments no read can have."""
        n = len(op.local_addr)
        for label, arr in (("local_addr", op.local_addr), ("remote_addr", op.remote_addr),
                           ("length", op.length)):
            if (arr.ndim if isinstance(arr, np.ndarray) else np.ndim(arr)) != 1:
                raise ValueError(f"{label} must be one-dimensional")
            if len(arr) != n:
                raise ValueError(
                    f"local_addr, remote_addr and length differ in length "
                    f"({n}, {len(op.remote_addr)}, {len(op.length)})"
                )
        if op.notif is not None and not isinstance(op.notif, bytes):
            raise TypeError("notif must be bytes")

    def _read_job(self, op: ReadOp) -> tuple[str, _JobFn]:
        """A checked read's job (what it is, and the function the thread runs)."""
        fn = functools.partial(
            self._do_read, op.remote_agent, op.local_addr, op.remote_addr, op.length, op.notif,
            op.mem_type, op.dev_id, op.dev_id if op.remote_dev_id is None else op.remote_dev_id,
            op.timeout_s, op.generation,
            op.mem_type if op.remote_mem_type is None else op.remote_mem_type,
        )
        return f"read of {len(op.length)} descriptors from remote agent {op.remote_agent!r}", fn

    def _prepare_notify(self, op: NotifyOp) -> tuple[str, _JobFn]:
        return (f"notify remote agent {op.remote_agent!r}",
                functools.partial(self._do_notify, op.remote_agent, bytes(op.message)))

    def set_hot(self, hot: bool) -> None:
        """Blocks are held: poll notifications from ``hot_poll_s`` escalating to
        ``hot_max_s`` even with no reads in flight (thread-safe). ``False`` (nothing
        held any more) also ends an :meth:`expect_reads` window: nobody reads
        memory that is not held."""
        was = self._hot
        self._hot = bool(hot)
        if not self._hot:
            self._reads_expected_until = 0.0
            self._soon_until = 0.0
        elif not was:
            self._jobs.put(None)  # leave the idle wait now, not up to idle_max_s later

    def expect_reads(self, for_s: float, *, soon: bool = True) -> None:
        """A peer is about to read our memory (it claimed or renewed a lease): poll
        every ``hot_poll_s`` for the next ``for_s`` seconds (thread-safe). Its first
        transfer wires up, and over UCX/TCP its bytes flow, only as we progress.
        ``soon``: its read is imminent and worth polling every ``soon_poll_s``
        for (the owner says no when many reads are under way: see
        :meth:`_completion_imminent`)."""
        now = time.monotonic()
        expected = now < self._reads_expected_until
        if now + for_s > self._reads_expected_until:
            self._reads_expected_until = now + for_s
        if not soon:
            if not expected:
                # Wake it from a longer wait (blocks held and nothing happening
                # escalates it to hot_max_s, 50 ms): the reader's transfers end
                # only once we answer their closing flush, so it must be on
                # hot_poll_s when they come. Measured (hetero 2->1, 8 reads, P's
                # worker 40 ms asleep after granting them): every READ of the
                # burst stayed PROC until P woke.
                self._jobs.put(None)
            return
        # The reader posts the moment our grant reaches it, and over UCX (CMA for
        # the bytes, tcp for control) its READ with a notification completes only
        # after OUR worker answers the endpoint flush NIXL ends every transfer
        # with: poll every soon_poll_s until its notification came (or
        # soon_window_s passed). Measured: the 1-block read's post -> done went
        # from ~0.9 ms (our 1 ms hot poll) to ~0.1 ms.
        self._grants += 1
        soon_already = now < self._soon_until
        self._soon_until = now + self._policy.soon_window_s
        if not soon_already:
            # Wake it from a longer wait; inside an open window it polls every
            # soon_poll_s anyway (a batch of claims would otherwise wake it per claim).
            self._jobs.put(None)

    def progressed(self) -> _Fut:
        """A future that resolves once the worker has gone round its loop after this
        call: notifications NIXL had for us by then are delivered first (they and
        the result leave the thread together, notifications before callbacks of
        the future run). Fails with NixlError if the worker stopped."""
        return self._submit("progress", functools.partial(self._do_nothing))

    @property
    def poll_wait_s(self) -> float:
        """How long the worker thread last chose to wait for work (seconds)."""
        return self._poll_wait_s

    # -- submission ------------------------------------------------------------------------------

    def _submit(self, what: str, fn: _JobFn, *, remote: str | None = None) -> _Fut:
        loop = self._loop
        if loop is None:
            raise NixlError(f"{what}: worker not started", remote=remote)
        fut: _Fut = loop.create_future()
        with self._lock:
            if self._stop_requested or self._closed:
                raise NixlError(f"{what}: worker stopped", remote=remote)
            self._jobs.put((_Job(fn, fut, what, remote),))
        return fut

    # -- worker thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        _tight_timers()
        try:
            if self._thread_init is not None:
                self._thread_init()
            self._agent = self._create_agent()
        except BaseException as exc:  # a failed start must still resolve start()
            with self._lock:
                self._closed = True
            err = NixlError(f"could not create NIXL agent {self._name!r} with backends "
                            f"{list(self._backends)}: {type(exc).__name__}: {exc}")
            self._post(self._resolve_start, err)
            self._post(self._resolve_stopped)
            return
        log.info(
            "NIXL agent %r up on thread %s: backends %s; %s",
            self._name, threading.current_thread().name, ",".join(self._backends),
            transport_note(),
        )
        self._post(self._resolve_start, None)
        try:
            self._serve()
        except BaseException:  # only a bug in this module gets here; still shut down cleanly
            log.exception("NIXL worker %r loop failed", self._name)
        finally:
            self._shutdown()

    def _create_agent(self) -> Any:
        api = importlib.import_module("nixl._api")
        conf = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            capture_telemetry=self._telemetry,
            backends=[],
        )
        agent = api.nixl_agent(self._name, conf)
        for backend in self._backends:
            agent.create_backend(backend, dict(self._backend_params.get(backend, {})))
        return agent

    def _serve(self) -> None:
        wait = 0.0
        active = True
        while not self._stop_requested:
            # Read by /healthz and the poll-lag gauge from other threads: a float
            # store is atomic, and a stale value only makes the thread look slower.
            self.heartbeat = time.monotonic()
            grants = self._grants
            if self._drain_jobs():
                active = True
            if self._progress():
                active = True
                # A notification came: the read a grant opened the window for has most
                # likely finished. Closing at the first one keeps a busy target (reads
                # notifying all the time) off the 50 us poll; a read still under way
                # then completes at the rate its state asks for (hot_poll_s).
                if self._grants == grants:  # else a grant came during the round: keep it
                    self._soon_until = 0.0
                    if self._grants != grants:  # one came just now after all
                        self._soon_until = time.monotonic() + self._policy.soon_window_s
            now = time.monotonic()
            wait = self._policy.next_wait(
                wait, active=active, inflight=bool(self._inflight), hot=self._hot,
                reads_expected=now < self._reads_expected_until,
                soon=self._completion_imminent(now))
            self._poll_wait_s = wait  # set before the results leave: tests read it then
            self._flush()
            active = False
            try:
                entry = self._jobs.get(timeout=wait)
            except queue.Empty:
                continue
            active = True  # a job or a wake-up: start escalating again from the floor
            for job in entry or ():
                self._run_job(job)

    def _completion_imminent(self, now: float) -> bool:
        """Whether a completion is imminent: a lease granted within the soon
        window and no notification since, or a read of ours posted within it
        with at most ``soon_max_reads`` transfers in flight.

        Why the bounds (and why the owner opens a lease's window only with few
        holds): a first version (window extended by every grant, closed only once
        as many notifications as grants had come; no bound on D) never closed
        under load (64 reads in flight, one per engine message; merged
        notifications count once), and the wake-ups cost more than they saved:
        P's CPU per read 0.28-0.33 -> 0.45-0.50 ms, 1,800-2,000 -> 1,050-1,400
        reads/s. A busy worker goes round often anyway."""
        if now < self._soon_until:
            return True
        return (0 < len(self._inflight) <= self._soon_max
                and now - self._last_post < self._policy.soon_window_s)

    def _drain_jobs(self) -> int:
        """Run queued jobs, about _MAX_JOBS_PER_ROUND at most (a group is run
        whole); returns how many entries were taken."""
        n = jobs = 0
        while jobs < _MAX_JOBS_PER_ROUND:
            try:
                entry = self._jobs.get_nowait()
            except queue.Empty:
                return n
            n += 1
            jobs += len(entry) if entry else 1
            for job in entry or ():
                self._run_job(job)
        return n

    def _run_job(self, job: _Job) -> None:
        if self._stop_requested:
            self._fail(job.fut, NixlError(f"{job.what}: worker stopped", remote=job.remote))
            return
        if job.fut.cancelled():
            return
        if self._agent is None and getattr(job.fn, "func", None) not in self._agentless:
            self._fail(job.fut, NixlError(
                f"{job.what}: this engine's NIXL agent is down since "
                f"{time.monotonic() - self._down_since:.1f} s (it could not be created again "
                f"after a reset: {self._down}); retrying", remote=job.remote))
            return
        t0 = time.perf_counter()
        try:
            result = job.fn(job.fut)
        except (NixlError, ValueError, TypeError) as exc:
            self._fail(job.fut, exc)
        except Exception as exc:
            self._fail(job.fut, wrap(job.what, exc, job.remote))
        else:
            if result is not _DEFERRED:
                self._out_futs.append((job.fut, result, None))
        if ((self._inflight or self._out_futs)
                and time.perf_counter() - t0 >= self._policy.busy_s):
            # Between the jobs of one round too, after a long one: on host memory
            # transfer() copies inline (a few ms for a large read), so this read
            # is DONE now and those posted before it may have ended meanwhile;
            # their completions leave now, not after the round's last post (2->1
            # hetero: a staged read's scatter then runs beside the next read's
            # copy instead of after all of them). Short jobs (small reads) leave
            # it to the round's end: each hand-over wakes the loop.
            if self._inflight:
                self._poll_reads()
            self._flush()

    @property
    def _agentless(self) -> tuple[Callable[..., object], ...]:
        """Jobs that also work while the agent is down: they only forget things."""
        return (self._do_deregister, self._do_remove_remote, self._do_nothing)

    def _progress(self) -> int:
        """Poll reads and notifications; returns how many notifications arrived."""
        if self._inflight:
            self._poll_reads()
        if self._doomed:
            self._reset_agent()
        if self._agent is None:  # a reset that could not create the agent again
            if self._down and time.monotonic() >= self._recreate_at:
                self._recreate()
            return 0
        try:
            return self._take_notifs()
        except Exception:
            log.exception("NIXL agent %r: get_new_notifs failed", self._name)
            return 0

    def _take_notifs(self) -> int:
        """Progress the agent once and queue what notifications it has for the
        event loop; returns how many (NIXL's errors propagate)."""
        n = 0
        for agent, msgs in self._agent.get_new_notifs().items():
            for msg in msgs:
                self._out_notifs.append((str(agent), bytes(msg)))
                n += 1
        return n

    def _poll_reads(self) -> None:
        still: list[_Inflight] = []
        for r in self._inflight:
            try:
                state = self._agent.check_xfer_state(r.handle)
            except Exception as exc:
                self._doomed.append((r, wrap(f"read from remote agent {r.remote!r}", exc,
                                             r.remote)))
                continue
            if state == "PROC":
                if r.deadline is not None and time.perf_counter() > r.deadline:
                    waited = time.perf_counter() - r.t0
                    r.timed_out = True
                    self._doomed.append((r, NixlTimeout(
                        f"read from remote agent {r.remote!r} timed out after {waited:.1f} s "
                        "(the peer is stalled or unreachable; the agent was reset so that "
                        "nothing of it can land any more)", remote=r.remote)))
                    continue
                still.append(r)
            elif state == "DONE":
                self._finish_read(r, self._stats(r), None)
            else:
                self._doomed.append((r, NixlError(
                    f"read from remote agent {r.remote!r} failed: transfer state {state}",
                    remote=r.remote)))
        self._inflight = still

    def _reset_agent(self) -> None:
        """Destroy the agent (killing every transfer on it), create it again, then fail
        the reads that doomed it and every other read that was in flight on it."""
        t0 = time.perf_counter()
        doomed, self._doomed = self._doomed, []
        others, self._inflight = self._inflight, []
        old = self._name
        reason = str(doomed[0][1])
        self._flush()  # what finished before the reset goes out first
        self._destroy_agent([r for r, _ in doomed] + others)
        try:
            md = self._create_again()
        except Exception as exc:
            # The old agent is gone (nothing writes any more, so the reads can be
            # reported). Without a new one this worker serves nothing but stays up
            # and tries again (_progress); until then jobs fail naming why, and
            # the owner reports the engine not ready.
            log.exception("NIXL agent %r: could not be created again after a reset; "
                          "retrying", old)
            self._down = self.down_reason = f"{type(exc).__name__}: {exc}"
            self._down_since = time.monotonic()
            self._recreate_wait = _RECREATE_FIRST_S
            self._recreate_at = self._down_since + self._recreate_wait
            self._recreate_tries = 1
            self._pending_reset = (reason, len(doomed) + len(others), time.perf_counter() - t0)
            err = NixlKilledByReset(f"read from a remote agent failed: the agent was reset "
                                    f"because another read failed ({reason})")
            for r, e in doomed:
                self._fail(r.fut, e)
            for r in others:
                self._fail(r.fut, err)
            return
        teardown = time.perf_counter() - t0
        n = len(doomed) + len(others)
        log.warning("NIXL agent %r reset as %r in %.3f s (%s); %d read(s) in flight on it "
                    "failed with it", old, self._name, teardown, reason, n)
        self._post(self._reset_done, AgentReset(self._gen, self._name, md, reason, n, teardown))
        for r, e in doomed:
            self._fail(r.fut, e)
        for r in others:
            self._fail(r.fut, NixlKilledByReset(
                f"read from remote agent {r.remote!r} failed: the agent was reset because "
                f"another read failed ({reason})", remote=r.remote))

    def _create_again(self) -> bytes:
        """A fresh agent of the next generation with every registration made again;
        returns its metadata. On failure nothing of the attempt is kept."""
        self._gen += 1
        self._name = f"{self._base_name}-g{self._gen}"
        try:
            self._agent = self._create_agent()
            for reg_id, (regions, mem_type, dev_id) in self._reg_specs.items():
                self._regs[reg_id] = self._register_descs(regions, mem_type, dev_id)
            return bytes(self._agent.get_agent_metadata())
        except BaseException:
            self._regs.clear()
            self._agent = None
            gc.collect()
            raise

    def _recreate(self) -> None:
        """Another try at creating the agent that a reset could not create again."""
        try:
            md = self._create_again()
        except Exception as exc:
            self._recreate_tries += 1
            self._down = self.down_reason = f"{type(exc).__name__}: {exc}"
            self._recreate_wait = min(self._recreate_wait * 2, _RECREATE_MAX_S)
            self._recreate_at = time.monotonic() + self._recreate_wait
            if self._recreate_tries <= 10 or self._recreate_tries % 100 == 0:
                log.warning("NIXL agent %r still down after %d tries (%s); next try in %.1f s",
                            self._base_name, self._recreate_tries, self._down,
                            self._recreate_wait)
            return
        reason, n, teardown = self._pending_reset
        down_s = time.monotonic() - self._down_since
        self._down = self.down_reason = ""
        log.warning("NIXL agent %r created again as %r after %.1f s down (%d tries)",
                    self._base_name, self._name, down_s, self._recreate_tries)
        self._post(self._reset_done, AgentReset(self._gen, self._name, md, reason, n, teardown))

    def _destroy_agent(self, reads: list[_Inflight]) -> None:
        """Drop every handle and the agent itself, on this thread: NIXL's agent goes
        when the last Python reference (handles hold one) goes."""
        for r in reads:
            try:
                self._agent.release_xfer_handle(r.handle)
            except Exception:
                log.debug("NIXL agent %r: releasing a handle before teardown failed",
                          self._name, exc_info=True)
            r.handle = None
        self._stuck_handles.clear()
        self._drain()
        self._regs.clear()
        self._remotes.clear()
        self._inflight_by_agent.clear()
        self._agent = None
        gc.collect()  # in case a reference cycle holds a handle

    def _drain(self) -> None:
        """Progress the agent for a short while before it is destroyed.

        UCX 1.23 aborts the whole process (``arbiter.c:36``,
        ``ucs_arbiter_group_is_empty``) when a worker is destroyed while an
        endpoint to a peer that just died still has work queued: the error
        handling that purges it runs only from progress. Measured on the
        dead-peer test: 4 of 10 runs aborted without this, 0 of 24 with
        200 ms of progress first. Notifications that arrive meanwhile are kept.
        """
        end = time.monotonic() + _DRAIN_BEFORE_DESTROY_S
        while True:
            try:
                self._take_notifs()
            except Exception:
                log.debug("NIXL agent %r: progress before teardown failed", self._name,
                          exc_info=True)
                return
            if time.monotonic() >= end:
                return
            time.sleep(0.001)

    def _finish_read(self, r: _Inflight, stats: TransferStats | None,
                     exc: BaseException | None) -> None:
        self._release(r.handle, r.remote)
        left = self._inflight_by_agent.get(r.remote, 1) - 1
        if left > 0:
            self._inflight_by_agent[r.remote] = left
        else:
            self._inflight_by_agent.pop(r.remote, None)
        if exc is not None:
            self._fail(r.fut, exc)
        else:
            self._out_futs.append((r.fut, stats, None))

    def _release(self, handle: Any, remote: str) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            # NIXL refuses to free a handle it cannot cancel; keep it referenced so its
            # finalizer does not run (and fail again) at an arbitrary point.
            log.warning("NIXL agent %r: could not release a handle to %r", self._name, remote,
                        exc_info=True)
            self._stuck_handles.append(handle)

    def _stats(self, r: _Inflight) -> TransferStats:
        if self._telemetry:
            try:
                tel = self._agent.get_xfer_telemetry(r.handle)
                return TransferStats(int(tel.totalBytes), r.ndesc, float(tel.postDuration),
                                     float(tel.xferDuration), True)
            except Exception:
                log.debug("no telemetry for a read from %r", r.remote, exc_info=True)
        done = time.perf_counter()
        return TransferStats(r.nbytes, r.ndesc, (r.t_post - r.t0) * 1e6, (done - r.t0) * 1e6)

    def _fail(self, fut: _Fut, exc: BaseException) -> None:
        self._out_futs.append((fut, None, exc))

    def _flush(self) -> None:
        if not self._out_futs and not self._out_notifs:
            return
        futs, self._out_futs = self._out_futs, []
        notifs, self._out_notifs = self._out_notifs, []
        self._post(self._deliver, futs, notifs)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            log.debug("NIXL worker %r: event loop closed, dropping results", self._name)

    def _shutdown(self) -> None:
        with self._lock:
            self._stop_requested = True
            self._closed = True
        while True:
            try:
                entry = self._jobs.get_nowait()
            except queue.Empty:
                break
            for job in entry or ():
                self._fail(job.fut, NixlError(f"{job.what}: worker stopped", remote=job.remote))
        self._flush()
        deadline = time.monotonic() + self._stop_timeout_s
        while self._agent is not None and self._inflight and time.monotonic() < deadline:
            self._progress()
            self._flush()
            if self._inflight:
                time.sleep(self._policy.busy_s)
        stuck, self._inflight = self._inflight, []
        doomed, self._doomed = self._doomed, []
        if self._agent is not None and not stuck and not doomed and not self._stuck_handles:
            for reg_id, descs in list(self._regs.items()):
                try:
                    self._agent.deregister_memory(descs)
                except Exception:
                    self.cleanup_failures += 1
                    log.warning("NIXL agent %r: deregistering %d failed", self._name, reg_id,
                                exc_info=True)
        elif stuck or doomed or self._stuck_handles:
            log.warning("NIXL agent %r: %d read(s) still in flight at shutdown; destroying the "
                        "agent before reporting them", self._name, len(stuck) + len(doomed))
        # The agent is destroyed here, on its own thread, before any stuck read is
        # reported and before stop() returns: only then may the memory be unmapped.
        if self._agent is not None:
            self._destroy_agent(stuck + [r for r, _ in doomed])
        for r, e in doomed:
            self._fail(r.fut, e)
        for r in stuck:
            self._fail(r.fut, NixlError(
                f"read from remote agent {r.remote!r}: worker stopped before it finished",
                remote=r.remote))
        self._flush()
        log.info("NIXL agent %r stopped", self._name)
        self._post(self._resolve_stopped)

    # -- jobs (worker thread) --------------------------------------------------------------------

    def _do_register(self, regions: list[tuple[int, int]], mem_type: str, dev_id: int,
                     _fut: _Fut) -> int:
        descs = self._register_descs(regions, mem_type, dev_id)
        reg_id = next(self._reg_ids)
        self._regs[reg_id] = descs
        self._reg_specs[reg_id] = (regions, mem_type, dev_id)  # to register again on reset
        return reg_id

    def _register_descs(self, regions: list[tuple[int, int]], mem_type: str,
                        dev_id: int) -> Any:
        arr = np.empty((len(regions), 3), dtype=np.int64)
        arr[:, :2] = np.asarray(regions, dtype=np.int64)
        arr[:, 2] = dev_id
        descs = self._agent.get_reg_descs(arr, mem_type)
        if descs is None:
            raise NixlError(f"NIXL rejected the registration list (mem_type={mem_type!r})")
        self._agent.register_memory(descs)
        return descs

    def _do_deregister(self, reg_id: int, _fut: _Fut) -> None:
        if self._agent is None and reg_id in self._reg_specs:
            # Down after a reset: nothing is registered now; forget it so that the
            # next agent does not register memory the owner is about to unmap.
            del self._reg_specs[reg_id]
            return
        descs = self._regs.get(reg_id)
        if descs is None:
            raise NixlError(f"unknown registration id {reg_id}")
        self._agent.deregister_memory(descs)
        del self._regs[reg_id]
        del self._reg_specs[reg_id]

    def _do_nothing(self, _fut: _Fut) -> None:
        """The job behind progressed(): the round it runs in does the progress."""

    def _do_metadata(self, _fut: _Fut) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def _do_add_remote(self, metadata: bytes, _fut: _Fut) -> tuple[str, int]:
        name = peek_agent_name(metadata)
        if name is not None:
            known = self._remotes.get(name)
            if known == metadata:
                return name, self._gen
            if known is not None:
                self._check_idle(name, "replace the metadata of")
                self._agent.remove_remote_agent(name)
                del self._remotes[name]
        loaded = self._load(metadata)
        known = self._remotes.get(loaded)
        if known is not None and known != metadata:
            # Could not read the name up front, so NIXL merged old and new regions.
            self._check_idle(loaded, "replace the metadata of")
            self._agent.remove_remote_agent(loaded)
            loaded = self._load(metadata)
        self._remotes[loaded] = metadata
        return loaded, self._gen

    def _load(self, metadata: bytes) -> str:
        got = self._agent.add_remote_agent(metadata)
        return got.decode() if isinstance(got, bytes) else str(got)  # NIXL returns bytes

    def _check_idle(self, agent: str, action: str) -> None:
        n = self._inflight_by_agent.get(agent, 0)
        if n:
            raise NixlError(f"cannot {action} remote agent {agent!r}: {n} reads in flight",
                            remote=agent)

    def _do_remove_remote(self, agent: str, _fut: _Fut) -> None:
        if agent not in self._remotes:
            return  # already gone (removed, replaced, or its agent generation reset)
        self._check_idle(agent, "remove")
        self._agent.remove_remote_agent(agent)
        self._remotes.pop(agent, None)

    def _do_notify(self, agent: str, message: bytes, _fut: _Fut) -> None:
        if agent not in self._remotes:
            raise NixlError(f"notify: unknown remote agent {agent!r}", remote=agent)
        self._agent.send_notif(agent, message)

    def _do_read(
        self,
        remote: str,
        local_addr: npt.ArrayLike,
        remote_addr: npt.ArrayLike,
        length: npt.ArrayLike,
        notif: bytes | None,
        mem_type: str,
        dev_id: int,
        remote_dev_id: int,
        timeout_s: float | None,
        generation: int | None,
        remote_mem_type: str,
        fut: _Fut,
    ) -> object:
        if generation is not None and generation != self._gen:
            raise NixlAgentReset(f"read: remote agent {remote!r} was linked by generation "
                                 f"{generation} of this agent, now {self._gen}; link again",
                                 remote=remote)
        if remote not in self._remotes:
            raise NixlError(f"read: unknown remote agent {remote!r}", remote=remote)
        lens = _as_int64(length)
        n = len(lens)
        if n == 0:
            if notif:
                self._agent.send_notif(remote, notif)
            return TransferStats(0, 0, 0.0, 0.0)
        local = np.empty((n, 3), dtype=np.int64)
        local[:, 0] = _as_int64(local_addr)
        local[:, 1] = lens
        local[:, 2] = dev_id
        far = local.copy()
        far[:, 0] = _as_int64(remote_addr)
        far[:, 2] = remote_dev_id
        local_descs = self._agent.get_xfer_descs(local, mem_type)
        remote_descs = self._agent.get_xfer_descs(far, remote_mem_type)
        if local_descs is None or remote_descs is None:
            raise NixlError(f"read from remote agent {remote!r}: NIXL rejected the descriptor "
                            f"lists (local {mem_type!r}, remote {remote_mem_type!r})",
                            remote=remote)
        t0 = time.perf_counter()
        try:
            handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, remote,
                                                 notif or b"")
        except Exception as exc:
            raise wrap(f"read of {n} descriptors from remote agent {remote!r}: "
                        "initialize_xfer", exc, remote) from exc
        r = _Inflight(handle, fut, remote, int(lens.sum()), n, t0, t0,
                      None if timeout_s is None else t0 + timeout_s)
        self._inflight_by_agent[remote] = self._inflight_by_agent.get(remote, 0) + 1
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            # Part of it may be posted: dead only once the agent is reset.
            self._doomed.append((r, wrap(f"read from remote agent {remote!r}", exc, remote)))
            return _DEFERRED
        r.t_post = time.perf_counter()
        if state == "DONE":
            self._finish_read(r, self._stats(r), None)
        elif state == "PROC":
            self._inflight.append(r)  # polled to DONE by _progress, right after this job
            self._last_post = time.monotonic()  # its DONE is imminent: poll at soon_poll_s
        else:
            self._doomed.append((r, NixlError(
                f"read from remote agent {remote!r} failed: transfer() returned {state}",
                remote=remote)))
        return _DEFERRED

    # -- event loop side callbacks ---------------------------------------------------------------

    def _resolve_start(self, exc: BaseException | None) -> None:
        fut = self._started_fut
        if fut is None or fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    def _reset_done(self, reset: AgentReset) -> None:
        self.generation = reset.generation
        self._public_name = reset.agent_name
        self.resets += 1
        if self._on_reset is not None:
            try:
                self._on_reset(reset)
            except Exception:
                log.exception("on_reset callback failed for agent %r", reset.agent_name)

    def _resolve_stopped(self) -> None:
        if self._stopped_fut is not None and not self._stopped_fut.done():
            self._stopped_fut.set_result(None)

    def _deliver(self, futs: list[tuple[_Fut, object, BaseException | None]],
                 notifs: list[tuple[str, bytes]]) -> None:
        for fut, result, exc in futs:
            if fut.done():  # cancelled by its awaiter
                continue
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)
        cb = self._on_notif
        for agent, msg in notifs:
            if cb is None:
                log.debug("NIXL agent %r: dropping notification from %r", self._name, agent)
                continue
            try:
                cb(agent, msg)
            except Exception:
                log.exception("on_notif callback failed for a message from %r", agent)
