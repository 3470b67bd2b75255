"""One NIXL agent, owned by one thread, driven from an asyncio loop.

*One thread owns the agent.* A NIXL agent created without a listener thread
has no internal lock, and two threads calling into one agent crash. So every
NIXL call (creation and destruction included) happens on :class:`NixlWorker`'s
own thread. The event loop never touches the agent: it puts jobs on a
:class:`queue.Queue` and awaits futures the thread resolves with
``loop.call_soon_threadsafe``, once per round for everything that round
finished (:mod:`~kvsidecar.daemon.transport.jobs`). Off the loop too because
NIXL calls are heavy: on host memory ``transfer()`` performs the whole CMA copy
inline (NIXL releases the GIL meanwhile), and ``add_remote_agent`` and building
descriptor lists for thousands of blocks take milliseconds. Parallel posting
means more agents: a D engine rank may have several workers ("lanes"), each
resetting alone.

*This thread drives progress.* NIXL's own progress thread, as ``nixl_agent``
makes it, polls UCX without pause and burns a core; it is off by default. Each
round runs the queued jobs, then polls every read in flight
(``check_xfer_state``) and ``get_new_notifs`` (which progresses the UCX worker:
peers wiring up to us, notifications arriving, the flush a peer's READ from us
ends with). With ``WorkerOptions.progress_thread_ms`` NIXL's thread runs with a
delay instead: asleep in ``poll()`` until a message arrives, it does that
progress, and ``get_new_notifs`` only takes the notifications it received.
Between the jobs of a round it also polls after a job that took ``busy_s`` or
more, so reads that ended during a long ``transfer()`` leave before the
round's last post. Then it blocks on the queue for a wait
:mod:`~kvsidecar.daemon.transport.poll_policy` chooses; a job,
:meth:`~NixlWorker.set_hot` and :meth:`~NixlWorker.expect_reads` wake it at
once.

*A failed read is reported only once it is dead* (NIXL has no abort): a read
that passes its deadline, ends in an error or fails while posting resets the
agent (:mod:`~kvsidecar.daemon.transport.agent_host`): every handle dropped,
the agent destroyed and created again as ``<name>-g<N>`` with the same memory
registered. Only then do its future and those of the other reads in flight on
that agent fail. The owner learns the new name and metadata through
``on_reset``; reads for links made before it fail with
:class:`~kvsidecar.daemon.transport.errors.NixlAgentReset` without posting.
``stop()`` likewise destroys the agent before it reports reads still stuck at
its deadline and before it returns, so the caller may unmap the memory then.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from kvsidecar.daemon.thread_names import prctl_this_thread
from kvsidecar.daemon.transport.agent_host import (
    AgentFactory,
    AgentHost,
    AgentReset,
    nixl_agent_factory,
)
from kvsidecar.daemon.transport.errors import (
    NixlAgentReset,
    NixlError,
    NixlKilledByReset,
    NixlTimeout,
    wrap,
)
from kvsidecar.daemon.transport.inflight import Inflight, InflightReads
from kvsidecar.daemon.transport.jobs import DEFERRED, Entry, Fut, Job, JobFn, Outbox
from kvsidecar.daemon.transport.merging import MERGE_MAX_READ_BYTES
from kvsidecar.daemon.transport.metadata import peek_agent_name
from kvsidecar.daemon.transport.ops import NotifyOp, ReadOp, TransferStats
from kvsidecar.daemon.transport.poll_policy import PollPacer, PollPolicy
from kvsidecar.daemon.transport.posting import PostQueue
from kvsidecar.daemon.transport.probe import transport_note

log = logging.getLogger(__name__)

__all__ = ["AgentReset", "NixlAgentReset", "NixlError", "NixlKilledByReset", "NixlTimeout",
           "NixlWorker", "NotifyOp", "PollPolicy", "ReadOp", "TransferStats", "WorkerOptions",
           "transport_note"]

#: keep polling in-flight reads while a burst of jobs arrives (a group of posts
#: counts each post; a group is never split)
_MAX_JOBS_PER_ROUND = 64
_PR_SET_TIMERSLACK = 29
#: this thread's timer slack (ns): how late the kernel may end its timed waits
_TIMER_SLACK_NS = 1000


@dataclass(frozen=True)
class WorkerOptions:
    """A :class:`NixlWorker`'s configuration (its callbacks to the owner are
    constructor arguments)."""

    backends: Sequence[str] = ("UCX",)
    backend_params: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: the waits between polls (see poll_policy)
    poll: PollPolicy = field(default_factory=PollPolicy)
    #: take transfer times from NIXL's telemetry (else the worker's clock)
    telemetry: bool = True
    #: how long stop() lets in-flight transfers finish (seconds)
    stop_timeout_s: float = 5.0
    #: makes one notification out of several (see notifications.join); without
    #: it, or for ops whose ``merge`` is below 2, every post is its own transfer
    join_notifs: Callable[[list[bytes]], bytes] | None = None
    max_notif_bytes: int = 16384
    merge_max_read_bytes: int = MERGE_MAX_READ_BYTES
    #: above 0: the real agent runs NIXL's UCX progress thread, woken by UCX
    #: events and at least every this many ms (``--nixl-progress-thread-ms``):
    #: a peer's READ of our memory then needs no poll of ours, so a lease
    #: granted opens no soon window (see expect_reads)
    progress_thread_ms: int = 0
    #: makes the agent; default: real NIXL with backends, backend_params,
    #: telemetry and progress_thread_ms
    agent_factory: AgentFactory | None = None

    def factory(self) -> AgentFactory:
        if self.agent_factory is not None:
            return self.agent_factory
        return nixl_agent_factory(self.backends, self.backend_params, self.telemetry,
                                  self.progress_thread_ms)


def _tight_timers() -> None:
    """Let the calling thread's timed waits end on time (Linux; else nothing):
    Linux ends a timed wait up to the thread's timer slack (50 us by default)
    late, which doubled the worker's 50 us soon poll. Per thread."""
    if not prctl_this_thread(_PR_SET_TIMERSLACK, _TIMER_SLACK_NS):
        log.debug("cannot set the NIXL worker's timer slack")


class NixlWorker:
    """Owns one NIXL agent on one thread; coroutine methods submit jobs to it.

    ``on_notif(remote_agent, message)`` runs on the event loop thread, and so
    does ``on_reset``; ``thread_init`` runs first on the worker thread (a GPU
    sidecar makes its CUDA context current there). Reads must not be given
    arrays that the caller mutates before the read returns (they are turned
    into descriptor lists on the worker thread).
    """

    def __init__(
        self,
        name: str,
        options: WorkerOptions = WorkerOptions(),
        *,
        on_notif: Callable[[str, bytes], None] | None = None,
        on_reset: Callable[[AgentReset], None] | None = None,
        thread_init: Callable[[], None] | None = None,
    ) -> None:
        if not name:
            raise ValueError("agent name must not be empty")
        self._opts = options
        self._public_name = name  # the current agent's name, as the event loop knows it
        self._on_notif = on_notif
        self._on_reset = on_reset
        self._thread_init = thread_init
        #: the agent's generation as the event loop knows it (set by the reset callback)
        self.generation = 0
        #: resets so far
        self.resets = 0
        #: deregistrations that failed at shutdown (logged; counted by the owner)
        self.cleanup_failures = 0
        #: why the agent is down after a reset that could not create it again ('' when
        #: up), for the event loop (readiness); a str store is atomic
        self.down_reason = ""
        #: monotonic time the worker thread last went round its poll loop
        self.heartbeat = time.monotonic()

        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._jobs: queue.Queue[Entry] = queue.Queue()
        self._lock = threading.Lock()  # orders submissions against shutdown
        self._stop_requested = False
        self._closed = False
        self._pacer = PollPacer(options.poll)
        #: the wait the worker thread chose last (seconds); for tests and metrics
        self._poll_wait_s = 0.0
        self._started_fut: Fut | None = None
        self._stopped_fut: Fut | None = None
        #: the job of a checked op, by its type
        self._job_of: dict[type, Callable[[Any], tuple[str, JobFn]]] = {
            ReadOp: self._read_job, NotifyOp: self._notify_job}
        self._posts = PostQueue(
            lambda op: self._job_of[type(op)](op), self._put,
            join_notifs=options.join_notifs, max_notif_bytes=options.max_notif_bytes,
            merge_max_read_bytes=options.merge_max_read_bytes)

        # Owned by the worker thread only.
        self._out = Outbox()
        self._host = AgentHost(name, options.factory(), self._out.notif)
        self._reads = InflightReads(self._host, self._out, telemetry=options.telemetry,
                                    on_posted=self._pacer.posted)

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

    @property
    def poll_wait_s(self) -> float:
        """How long the worker thread last chose to wait for work (seconds)."""
        return self._poll_wait_s

    async def start(self) -> None:
        """Create the thread and, on it, the agent; raise NixlError if NIXL fails."""
        if self._thread is not None:
            raise RuntimeError("NixlWorker.start() called twice")
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._started_fut = loop.create_future()
        self._stopped_fut = loop.create_future()
        self._thread = threading.Thread(
            target=self._run, name=f"nixl-{self._public_name}", daemon=True
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
        fn = functools.partial(self._host.register, list(regions), mem_type, dev_id)
        reg_id: int = await self._submit(f"register {len(regions)} {mem_type} regions",
                                         _ignoring_fut(fn))
        return reg_id

    async def deregister(self, reg_id: int) -> None:
        await self._submit(f"deregister registration {reg_id}",
                           _ignoring_fut(functools.partial(self._host.deregister, reg_id)),
                           agentless=True)

    async def metadata(self) -> bytes:
        """This agent's metadata, including the regions registered so far."""
        md: bytes = await self._submit("get agent metadata", _ignoring_fut(self._host.metadata))
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
        fn = functools.partial(self._host.add_remote, bytes(metadata), self._reads.busy)
        got: tuple[str, int] = await self._submit(what, _ignoring_fut(fn), remote=peek)
        return got

    async def remove_remote(self, agent: str) -> None:
        await self.remove_remote_soon(agent)

    def remove_remote_soon(self, agent: str) -> Fut:
        """:meth:`remove_remote`, queued before this returns (raises NixlError if
        the worker stopped): an owner unloading one agent from several workers
        queues every removal in one step, so nothing it checked just before (no
        new link loads that agent) can change in between."""
        fn = functools.partial(self._host.remove_remote, agent, self._reads.busy)
        return self._submit(f"remove remote agent {agent!r}", _ignoring_fut(fn),
                            remote=agent, agentless=True)

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

        :meth:`post_soon` of a :class:`ReadOp` (that never merges), awaited.
        With zero descriptors only the notification (if any) is sent.
        ``mem_type``/``dev_id`` describe the local memory (``DRAM``/``VRAM``
        and the CUDA ordinal), ``remote_mem_type``/``remote_dev_id`` the
        peer's as its handshake advertised them (default: the same). A read
        still in progress ``timeout_s`` after posting fails with NixlTimeout,
        and a read that ends in an error fails with NixlError, each only after
        the agent was reset (see the module docstring): a failed read never
        leaves a transfer writing into memory the caller believes is free.
        ``generation`` is the agent generation the caller linked
        ``remote_agent`` in; a read for an older generation fails with
        NixlAgentReset without posting anything.
        """
        stats = await self.post_soon(ReadOp(
            remote_agent, local_addr, remote_addr, length, notif, mem_type, dev_id,
            remote_dev_id, timeout_s, generation, remote_mem_type))
        return cast(TransferStats, stats)

    async def notify(self, remote_agent: str, message: bytes) -> None:
        """Send a bare notification (:meth:`post_soon` of a :class:`NotifyOp`, awaited)."""
        await self.post_soon(NotifyOp(remote_agent, message))

    def post_soon(self, op: ReadOp | NotifyOp) -> asyncio.Future[TransferStats | None]:
        """Post a read or a notification; the returned future resolves to the
        read's :class:`TransferStats` (None for a notification) or its error.
        Every op posted in one event-loop iteration reaches the thread as ONE
        queue entry right after it, each still its own transfer and failure,
        except ops with ``merge`` of 2 or more to one agent, which travel as one
        transfer (see :mod:`~kvsidecar.daemon.transport.posting`). Bad
        arguments fail the future with ValueError/TypeError; raises NixlError
        if the worker was never started. Event loop thread only."""
        loop = self._loop
        if loop is None:
            raise NixlError("post: worker not started", remote=op.remote_agent)
        return self._posts.post(loop, op)

    def set_hot(self, hot: bool) -> None:
        """Blocks are held: poll notifications from ``hot_s`` escalating to
        ``hot_max_s`` even with no reads in flight (thread-safe). ``False`` (nothing
        held any more) also ends an :meth:`expect_reads` window: nobody reads
        memory that is not held."""
        if self._pacer.set_hot(hot):
            self._jobs.put(None)  # leave the idle wait now, not up to idle_max_s later

    def expect_reads(self, for_s: float, *, soon: bool = True) -> None:
        """A peer is about to read our memory (it claimed or renewed a lease): poll
        every ``hot_s`` for the next ``for_s`` seconds (thread-safe). Its first
        transfer wires up, and over UCX/TCP its bytes flow, only as we progress.
        ``soon``: its read is imminent and worth polling every ``soon_s``
        for until its notification came (the owner says no when many reads are
        under way: see :meth:`PollPacer.imminent`). With NIXL's progress thread
        (``progress_thread_ms``) that thread answers the read as its messages
        come, so no soon window opens: polling is then only for notifications."""
        soon = soon and self._opts.progress_thread_ms <= 0
        if self._pacer.expect_reads(for_s, soon=soon):
            self._jobs.put(None)  # wake it from a longer wait

    def progressed(self) -> Fut:
        """A future that resolves once the worker has gone round its loop after this
        call: notifications NIXL had for us by then are delivered first (they and
        the result leave the thread together, notifications before callbacks of
        the future run). With NIXL's progress thread, "had" means that thread
        had taken them off the wire: one that arrived just before may still be
        unread by it. Fails with NixlError if the worker stopped."""
        return self._submit("progress", _do_nothing, agentless=True)

    # -- submission ------------------------------------------------------------------------------

    def _submit(self, what: str, fn: JobFn, *, remote: str | None = None,
                agentless: bool = False) -> Fut:
        loop = self._loop
        if loop is None:
            raise NixlError(f"{what}: worker not started", remote=remote)
        fut: Fut = loop.create_future()
        if not self._put((Job(fn, fut, what, remote, agentless),)):
            raise NixlError(f"{what}: worker stopped", remote=remote)
        return fut

    def _put(self, jobs: tuple[Job, ...]) -> bool:
        """Queue ``jobs`` as one entry; False (nothing queued) if the worker stopped."""
        with self._lock:
            if self._stop_requested or self._closed:
                return False
            self._jobs.put(jobs)
        return True

    def _read_job(self, op: ReadOp) -> tuple[str, JobFn]:
        """A checked read's job (what it is, and the function the thread runs)."""
        return (f"read of {len(op.length)} descriptors from remote agent {op.remote_agent!r}",
                functools.partial(self._do_read, op))

    def _notify_job(self, op: NotifyOp) -> tuple[str, JobFn]:
        return (f"notify remote agent {op.remote_agent!r}",
                functools.partial(self._do_notify, op.remote_agent, bytes(op.message)))

    # -- worker thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        _tight_timers()
        try:
            if self._thread_init is not None:
                self._thread_init()
            self._host.create()
        except BaseException as exc:  # a failed start must still resolve start()
            with self._lock:
                self._closed = True
            err = NixlError(f"could not create NIXL agent {self._host.name!r} with backends "
                            f"{list(self._opts.backends)}: {type(exc).__name__}: {exc}")
            self._post(self._resolve_start, err)
            self._post(self._resolve_stopped)
            return
        log.info(
            "NIXL agent %r up on thread %s: backends %s; %s",
            self._host.name, threading.current_thread().name, ",".join(self._opts.backends),
            transport_note(),
        )
        self._post(self._resolve_start, None)
        try:
            self._serve()
        except BaseException:  # only a bug in this module gets here; still shut down cleanly
            log.exception("NIXL worker %r loop failed", self._host.name)
        finally:
            self._shutdown()

    def _serve(self) -> None:
        wait = 0.0
        active = True
        while not self._stop_requested:
            # Read by /healthz and the poll-lag gauge from other threads: a float
            # store is atomic, and a stale value only makes the thread look slower.
            self.heartbeat = time.monotonic()
            grants = self._pacer.grants
            if self._drain_jobs():
                active = True
            if self._progress():
                active = True
                self._pacer.notified(grants)
            wait = self._pacer.next_wait(wait, active=active, inflight=len(self._reads.reads))
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

    def _run_job(self, job: Job) -> None:
        if self._stop_requested:
            self._out.fail(job.fut, NixlError(f"{job.what}: worker stopped", remote=job.remote))
            return
        if job.fut.cancelled():
            return
        if self._host.agent is None and not job.agentless:
            self._out.fail(job.fut, NixlError(
                f"{job.what}: this engine's NIXL agent is down since "
                f"{time.monotonic() - self._host.down_since:.1f} s (it could not be created "
                f"again after a reset: {self._host.down}); retrying", remote=job.remote))
            return
        t0 = time.perf_counter()
        try:
            result = job.fn(job.fut)
        except (NixlError, ValueError, TypeError) as exc:
            self._out.fail(job.fut, exc)
        except Exception as exc:
            self._out.fail(job.fut, wrap(job.what, exc, job.remote))
        else:
            if result is not DEFERRED:
                self._out.done(job.fut, result)
        if ((self._reads.reads or self._out.futs)
                and time.perf_counter() - t0 >= self._opts.poll.busy_s):
            # After a long job (on host memory transfer() copies inline) reads
            # posted before it may have ended: their completions leave now, not
            # after the round's last post. Short jobs leave it to the round's
            # end: each hand-over wakes the loop.
            if self._reads.reads:
                self._reads.poll()
            self._flush()

    def _progress(self) -> int:
        """Poll reads and notifications; returns how many notifications arrived."""
        if self._reads.reads:
            self._reads.poll()
        if self._reads.doomed:
            self._reset_agent()
        if self._host.agent is None:  # a reset that could not create the agent again
            if self._host.retry_due():
                reset = self._host.retry()
                self.down_reason = self._host.down
                if reset is not None:
                    self._post(self._reset_done, reset)
            return 0
        try:
            return self._host.take_notifs()
        except Exception:
            log.exception("NIXL agent %r: get_new_notifs failed", self._host.name)
            return 0

    def _reset_agent(self) -> None:
        """Destroy the agent (killing every transfer on it), create it again, then fail
        the reads that doomed it and every other read that was in flight on it."""
        doomed, others = self._reads.take_all()
        reason = str(doomed[0][1])
        self._flush()  # what finished before the reset goes out first
        reset = self._host.reset(reason, len(doomed) + len(others),
                                 functools.partial(self._reads.drop,
                                                   [r for r, _ in doomed] + others))
        self.down_reason = self._host.down
        if reset is None:
            err = NixlKilledByReset(f"read from a remote agent failed: the agent was reset "
                                    f"because another read failed ({reason})")
            self._fail_reads(doomed, others, lambda r: err)
            return
        self._post(self._reset_done, reset)
        self._fail_reads(doomed, others, lambda r: NixlKilledByReset(
            f"read from remote agent {r.remote!r} failed: the agent was reset because "
            f"another read failed ({reason})", remote=r.remote))

    def _fail_reads(self, doomed: list[tuple[Inflight, BaseException]], others: list[Inflight],
                    killed: Callable[[Inflight], BaseException]) -> None:
        for r, e in doomed:
            self._out.fail(r.fut, e)
        for r in others:
            self._out.fail(r.fut, killed(r))

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
                self._out.fail(job.fut, NixlError(f"{job.what}: worker stopped",
                                                  remote=job.remote))
        self._flush()
        deadline = time.monotonic() + self._opts.stop_timeout_s
        while self._host.agent is not None and self._reads.reads and time.monotonic() < deadline:
            self._progress()
            self._flush()
            if self._reads.reads:
                time.sleep(self._opts.poll.busy_s)
        doomed, stuck = self._reads.take_all()
        if stuck or doomed or self._reads.stuck_handles:
            log.warning("NIXL agent %r: %d read(s) still in flight at shutdown; destroying the "
                        "agent before reporting them", self._host.name, len(stuck) + len(doomed))
        elif self._host.agent is not None:
            self.cleanup_failures += self._host.deregister_all()
        # The agent is destroyed here, on its own thread, before any stuck read is
        # reported and before stop() returns: only then may the memory be unmapped.
        if self._host.agent is not None:
            self._reads.drop(stuck + [r for r, _ in doomed])
            self._host.destroy()
        self._fail_reads(doomed, stuck, lambda r: NixlError(
            f"read from remote agent {r.remote!r}: worker stopped before it finished",
            remote=r.remote))
        self._flush()
        log.info("NIXL agent %r stopped", self._host.name)
        self._post(self._resolve_stopped)

    # -- jobs (worker thread) --------------------------------------------------------------------

    def _do_read(self, op: ReadOp, fut: Fut) -> object:
        self._host.check_target(op.remote_agent, op.generation, "read")
        return self._reads.post(op, fut)

    def _do_notify(self, agent: str, message: bytes, _fut: Fut) -> None:
        self._host.check_target(agent, None, "notify")
        self._host.agent.send_notif(agent, message)

    # -- hand-over to the event loop -------------------------------------------------------------

    def _flush(self) -> None:
        taken = self._out.take()
        if taken is not None:
            self._post(self._deliver, *taken)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            log.debug("NIXL worker %r: event loop closed, dropping results", self._host.name)

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

    def _deliver(self, futs: list[tuple[Fut, object, BaseException | None]],
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
                log.debug("NIXL agent %r: dropping notification from %r", self._public_name,
                          agent)
                continue
            try:
                cb(agent, msg)
            except Exception:
                log.exception("on_notif callback failed for a message from %r", agent)


def _ignoring_fut(fn: Callable[[], object]) -> JobFn:
    """A job of ``fn``, which does not need the job's future."""
    def job(_fut: Fut) -> object:
        return fn()
    return job


def _do_nothing(_fut: Fut) -> None:
    """The job behind progressed(): the round it runs in does the progress."""
