"""The NIXL agent of one worker, and what must be made again with it.

:class:`AgentHost` creates the agent through an injectable
:data:`AgentFactory` (a callable making an agent of a given name: real NIXL by
:func:`nixl_agent_factory`, a fake one in tests), keeps the registrations
(to register them again on a new agent) and the remote agents loaded into it,
destroys it, and creates it again as ``<name>-g<N>`` of the next generation.
Every method runs on the worker thread that owns the agent (see
:mod:`~kvsidecar.daemon.transport.worker`).

Why destroy: NIXL has no abort. Releasing the handle of a READ in flight, or
removing the remote agent, does not stop its bytes; destroying the reading
agent does (its UCX worker and endpoints go, and with them every way a byte
reaches our memory). The agent goes when its last Python reference does
(transfer handles hold one), so the caller drops the handles first.

Before it is destroyed the agent is progressed for a short while
(:meth:`AgentHost.drain`): UCX aborts the process when a worker is destroyed
while an endpoint to a peer that just died still has work queued, and the
error handling that purges it runs only from progress.

A new agent that cannot be created (e.g. UCX finds no usable device while the
link is down) leaves the host *down*: :attr:`AgentHost.down` says why, and
:meth:`AgentHost.retry_due` says when to try again (backing off).
"""

from __future__ import annotations

import gc
import importlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsidecar.daemon.transport.errors import NixlAgentReset, NixlError
from kvsidecar.daemon.transport.metadata import peek_agent_name

log = logging.getLogger(__name__)

__all__ = ["AgentFactory", "AgentHost", "AgentReset", "available_plugins", "nixl_agent_factory"]

#: makes a NIXL agent (``nixl._api.nixl_agent`` or a stand-in) of the given name
AgentFactory = Callable[[str], Any]

#: After a reset whose agent could not be created again, retry after these many
#: seconds, doubling up to the cap: a link that comes back brings the worker back.
RECREATE_FIRST_S = 0.5
RECREATE_MAX_S = 5.0
DRAIN_BEFORE_DESTROY_S = 0.2  # progress before an agent is destroyed (see drain)


@dataclass(frozen=True)
class AgentReset:
    """What ``on_reset`` is told after the agent was destroyed and created again."""

    generation: int
    agent_name: str
    metadata: bytes
    reason: str
    reads_failed: int
    teardown_s: float


def available_plugins() -> list[str]:
    """The NIXL backend plugins this installation can create (``UCX``, ...), as
    NIXL's own plugin manager finds them (``NIXL_PLUGIN_DIR``, the wheel's
    plugin directory, static plugins): asked of a bare agent, no backend made."""
    bindings = importlib.import_module("nixl._bindings")
    agent = bindings.nixlAgent(f"kvsidecar-plugins-{os.getpid()}", bindings.nixlAgentConfig())
    return sorted(str(p) for p in agent.getAvailPlugins())


def nixl_agent_factory(backends: Sequence[str] = ("UCX",),
                       backend_params: Mapping[str, Mapping[str, str]] | None = None,
                       telemetry: bool = True, progress_thread_ms: int = 0) -> AgentFactory:
    """Real NIXL agents with ``backends`` and no listener thread.

    ``progress_thread_ms`` 0: no NIXL progress thread (the worker thread
    progresses the agent; see the worker). Above 0: NIXL's UCX progress
    thread, which sleeps in ``poll()`` on the UCX workers' event fds and so
    progresses only when a peer's message arrives, and at least every that
    many milliseconds (NIXL's guard against a missed wake-up). The Python
    ``nixl_agent`` always starts it with a zero delay, a thread that spins a
    core, so the agent is made again through the binding with the delay set;
    a binding without those fields raises ``NixlError``."""
    params = {k: dict(v) for k, v in (backend_params or {}).items()}
    names = tuple(backends)

    def make(name: str) -> Any:
        api = importlib.import_module("nixl._api")
        threaded = progress_thread_ms > 0
        conf = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            capture_telemetry=telemetry and not threaded,  # else two share a telemetry file
            backends=[],
        )
        agent = api.nixl_agent(name, conf)
        if threaded:
            # Before any backend exists (a backend reads the agent's config when
            # created), and the bare agent gone first: two of one name never overlap.
            agent.agent = None
            agent.agent = _agent_with_progress_thread(api, name, telemetry, progress_thread_ms)
        for backend in names:
            agent.create_backend(backend, dict(params.get(backend, {})))
        return agent

    return make


def _agent_with_progress_thread(api: Any, name: str, telemetry: bool, delay_ms: int) -> Any:
    """A bare binding agent whose backends get a progress thread woken by UCX
    events and at least every ``delay_ms`` (what ``nixl_agent`` would make
    with ``enable_prog_thread=True``, but with the delay set)."""
    try:
        bind = api.nixlBind
        cfg = bind.nixlAgentConfig()
        cfg.useProgThread = True
        cfg.useListenThread = False
        cfg.syncMode = bind.NIXL_THREAD_SYNC_NONE  # one thread calls the agent: ours
        cfg.pthrDelay = delay_ms * 1000  # microseconds; NIXL rounds it up to whole ms
        cfg.lthrDelay = 100000
        cfg.captureTelemetry = telemetry
        return bind.nixlAgent(name, cfg)
    except AttributeError as exc:
        raise NixlError(f"this NIXL build's binding cannot set the progress thread's delay "
                        f"({exc}); run without --nixl-progress-thread-ms") from None


class AgentHost:
    """One worker's agent across resets; worker thread only.

    ``on_notif(agent, message)`` gets the notifications :meth:`take_notifs`
    and :meth:`drain` take from the agent.
    """

    def __init__(self, base_name: str, factory: AgentFactory,
                 on_notif: Callable[[str, bytes], None]) -> None:
        self.base_name = base_name
        self.name = base_name  # the current agent's name
        self.gen = 0
        self.agent: Any = None
        self._factory = factory
        self._on_notif = on_notif
        self._regs: dict[int, Any] = {}
        self._reg_specs: dict[int, tuple[list[tuple[int, int]], str, int]] = {}
        self._reg_ids = itertools.count(1)
        self._remotes: dict[str, bytes] = {}
        #: why the agent is down after a reset that could not create it again ('' when up)
        self.down = ""
        self.down_since = 0.0
        self.tries = 0
        self._retry_at = 0.0
        self._retry_wait = RECREATE_FIRST_S
        #: the reset still to be told once the agent is up: reason, reads failed, teardown s
        self._pending: tuple[str, int, float] = ("", 0, 0.0)

    def create(self) -> None:
        self.agent = self._factory(self.name)

    # -- registrations -----------------------------------------------------------------------

    def register(self, regions: list[tuple[int, int]], mem_type: str, dev_id: int) -> int:
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
        descs = self.agent.get_reg_descs(arr, mem_type)
        if descs is None:
            raise NixlError(f"NIXL rejected the registration list (mem_type={mem_type!r})")
        self.agent.register_memory(descs)
        return descs

    def deregister(self, reg_id: int) -> None:
        if self.agent is None and reg_id in self._reg_specs:
            # Down after a reset: nothing is registered now; forget it so that the
            # next agent does not register memory the owner is about to unmap.
            del self._reg_specs[reg_id]
            return
        descs = self._regs.get(reg_id)
        if descs is None:
            raise NixlError(f"unknown registration id {reg_id}")
        self.agent.deregister_memory(descs)
        del self._regs[reg_id]
        del self._reg_specs[reg_id]

    def deregister_all(self) -> int:
        """Deregister everything (at shutdown); returns how many failed (logged)."""
        failed = 0
        for reg_id, descs in list(self._regs.items()):
            try:
                self.agent.deregister_memory(descs)
            except Exception:
                failed += 1
                log.warning("NIXL agent %r: deregistering %d failed", self.name, reg_id,
                            exc_info=True)
        return failed

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    # -- remote agents -----------------------------------------------------------------------

    def check_target(self, remote: str, generation: int | None, what: str) -> None:
        """Raise unless a transfer to ``remote``, linked in ``generation``, may post."""
        if generation is not None and generation != self.gen:
            raise NixlAgentReset(f"{what}: remote agent {remote!r} was linked by generation "
                                 f"{generation} of this agent, now {self.gen}; link again",
                                 remote=remote)
        if remote not in self._remotes:
            raise NixlError(f"{what}: unknown remote agent {remote!r}", remote=remote)

    def add_remote(self, metadata: bytes, busy: Callable[[str], int]) -> tuple[str, int]:
        """Load a peer's metadata; returns its name and this agent's generation.
        Identical metadata is a no-op; changed metadata for a known name
        replaces the old (NIXL would merge old and new regions), which needs
        ``busy(name)`` (reads in flight to it) to be 0."""
        name = peek_agent_name(metadata)
        if name is not None:
            known = self._remotes.get(name)
            if known == metadata:
                return name, self.gen
            if known is not None:
                _check_idle(name, "replace the metadata of", busy)
                self.agent.remove_remote_agent(name)
                del self._remotes[name]
        loaded = self._load(metadata)
        known = self._remotes.get(loaded)
        if known is not None and known != metadata:
            # Could not read the name up front, so NIXL merged old and new regions.
            _check_idle(loaded, "replace the metadata of", busy)
            self.agent.remove_remote_agent(loaded)
            loaded = self._load(metadata)
        self._remotes[loaded] = metadata
        return loaded, self.gen

    def _load(self, metadata: bytes) -> str:
        got = self.agent.add_remote_agent(metadata)
        return got.decode() if isinstance(got, bytes) else str(got)  # NIXL returns bytes

    def remove_remote(self, agent: str, busy: Callable[[str], int]) -> None:
        if agent not in self._remotes:
            return  # already gone (removed, replaced, or its agent generation reset)
        _check_idle(agent, "remove", busy)
        self.agent.remove_remote_agent(agent)
        self._remotes.pop(agent, None)

    # -- notifications -----------------------------------------------------------------------

    def take_notifs(self) -> int:
        """Progress the agent once and pass on what notifications it has;
        returns how many (NIXL's errors propagate). With NIXL's progress
        thread (``--nixl-progress-thread-ms``) NIXL does not progress here:
        this takes what that thread received."""
        n = 0
        for agent, msgs in self.agent.get_new_notifs().items():
            for msg in msgs:
                self._on_notif(str(agent), bytes(msg))
                n += 1
        return n

    def drain(self) -> None:
        """Progress the agent for a short while before it is destroyed (see the
        module docstring); notifications that arrive meanwhile are kept. With
        NIXL's progress thread that thread progresses it meanwhile, woken by
        UCX's events and at least once (its guard wake-up is at most 0.1 s:
        ``options.MAX_PROGRESS_MS``)."""
        end = time.monotonic() + DRAIN_BEFORE_DESTROY_S
        while True:
            try:
                self.take_notifs()
            except Exception:
                log.debug("NIXL agent %r: progress before teardown failed", self.name,
                          exc_info=True)
                return
            if time.monotonic() >= end:
                return
            time.sleep(0.001)

    # -- lifetime ----------------------------------------------------------------------------

    def destroy(self) -> None:
        """Drain and drop the agent; the caller released and dropped every
        transfer handle first."""
        self.drain()
        self._regs.clear()
        self._remotes.clear()
        self.agent = None
        gc.collect()  # in case a reference cycle holds a handle

    def create_again(self) -> bytes:
        """A fresh agent of the next generation with every registration made again;
        returns its metadata. On failure nothing of the attempt is kept."""
        self.gen += 1
        self.name = f"{self.base_name}-g{self.gen}"
        try:
            self.create()
            for reg_id, (regions, mem_type, dev_id) in self._reg_specs.items():
                self._regs[reg_id] = self._register_descs(regions, mem_type, dev_id)
            return self.metadata()
        except BaseException:
            self._regs.clear()
            self.agent = None
            gc.collect()
            raise

    def reset(self, reason: str, reads_failed: int,
              drop_handles: Callable[[], None]) -> AgentReset | None:
        """Destroy the agent, once ``drop_handles`` released and dropped every
        transfer handle on it, and create it again: what to tell the owner, or
        None when it could not be created (down; :meth:`retry` later)."""
        t0 = time.perf_counter()
        old = self.name
        drop_handles()
        self.destroy()
        try:
            md = self.create_again()
        except Exception as exc:
            # The old agent is gone (nothing writes any more, so the reads can be
            # reported). Without a new one the worker serves nothing but stays up
            # and tries again; until then jobs fail naming why, and the owner
            # reports the engine not ready.
            log.exception("NIXL agent %r: could not be created again after a reset; "
                          "retrying", old)
            self.down = f"{type(exc).__name__}: {exc}"
            self.down_since = time.monotonic()
            self._retry_wait = RECREATE_FIRST_S
            self._retry_at = self.down_since + self._retry_wait
            self.tries = 1
            self._pending = (reason, reads_failed, time.perf_counter() - t0)
            return None
        teardown = time.perf_counter() - t0
        log.warning("NIXL agent %r reset as %r in %.3f s (%s); %d read(s) in flight on it "
                    "failed with it", old, self.name, teardown, reason, reads_failed)
        return AgentReset(self.gen, self.name, md, reason, reads_failed, teardown)

    def retry_due(self) -> bool:
        return bool(self.down) and time.monotonic() >= self._retry_at

    def retry(self) -> AgentReset | None:
        """Another try at creating the agent a reset could not create again:
        the reset to tell the owner now, or None (still down)."""
        try:
            md = self.create_again()
        except Exception as exc:
            self.tries += 1
            self.down = f"{type(exc).__name__}: {exc}"
            self._retry_wait = min(self._retry_wait * 2, RECREATE_MAX_S)
            self._retry_at = time.monotonic() + self._retry_wait
            if self.tries <= 10 or self.tries % 100 == 0:
                log.warning("NIXL agent %r still down after %d tries (%s); next try in %.1f s",
                            self.base_name, self.tries, self.down, self._retry_wait)
            return None
        log.warning("NIXL agent %r created again as %r after %.1f s down (%d tries)",
                    self.base_name, self.name, time.monotonic() - self.down_since, self.tries)
        self.down = ""
        reason, n, teardown = self._pending
        return AgentReset(self.gen, self.name, md, reason, n, teardown)


def _check_idle(agent: str, action: str, busy: Callable[[str], int]) -> None:
    n = busy(agent)
    if n:
        raise NixlError(f"cannot {action} remote agent {agent!r}: {n} reads in flight",
                        remote=agent)

