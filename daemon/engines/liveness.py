"""Is an engine's process still there? Pure checks, the registry acts on them.

An engine is taken for dead when its pid (where checkable: a pid of this
sidecar's own PID namespace) no longer exists, or when it sent no request
for the engine lease.
"""

from __future__ import annotations

import logging
import os

from kvsidecar.daemon.engine_access import current_peer
from kvsidecar.daemon.engines.rank import EngineRank
from kvsidecar.ipc.protocol import Register

log = logging.getLogger(__name__)


def own_pid_namespace() -> str:
    """This process's PID namespace ('' when unknown)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
    return True


def death(eng: EngineRank, now: float, lease_s: float, by_lease: bool = True) -> str:
    """Why ``eng`` is taken for dead ('' while alive). ``by_lease=False``: by its
    pid only (the event loop was stalled: requests the engine sent meanwhile
    may wait unread in its socket, so its silence proves nothing yet)."""
    if eng.pid_visible and not alive(eng.pid):
        return f"its process (pid {eng.pid}) exited"
    idle = now - eng.last_seen
    if by_lease and idle > lease_s:
        return f"it sent no request for {idle:.1f} s (--engine-lease {lease_s:g} s)"
    return ""


def drains_when_gone(by_pid: bool) -> bool:
    """Whether a rank taken for dead keeps serving its open holds (a drain, see
    :mod:`~kvsidecar.daemon.drain`): only when its process is proven gone
    (``by_pid``). One released by ``--engine-lease`` alone may be alive (stopped,
    frozen, paused), and once continued it learns its registration is gone and
    may reuse the blocks its holds pin: serving them from that memory would hand
    readers other requests' bytes. Its holds end with the registration instead
    (readers' reads fail and are recomputed; the engine hears ``UnknownEngine``)."""
    return by_pid


def pid_visible(req: Register, pid_ns: str, lease_s: float) -> bool:
    """Whether ``req.pid`` can serve as a liveness signal: a pid of this
    sidecar's own PID namespace (``pid_ns``).

    A stated pid that does not exist is not trusted (liveness by requests
    only), except when it is the kernel's own word: the pid ``SO_PEERCRED``
    recorded for the connection that sent the registration. Then the engine
    died before its registration was done (a crash or OOM kill during a
    large allocation), and the next liveness check (within 1 s) releases it,
    rather than holding the memory for the whole --engine-lease and refusing
    the restarted engine's registration of the same id meanwhile."""
    if not req.pid:
        return False
    if not pid_ns or req.pid_ns != pid_ns:
        log.info("engine %r: pid %d is in another PID namespace (%r, ours %r); liveness by "
                 "its requests only (--engine-lease %g s)", req.engine_id, req.pid,
                 req.pid_ns or "unknown", pid_ns, lease_s)
        return False
    if not alive(req.pid):
        peer = current_peer.get()
        if peer is not None and peer.pid == req.pid:
            log.warning("engine %r: its process (pid %d) exited before its registration "
                        "was done; released at the next liveness check", req.engine_id,
                        req.pid)
            return True
        log.warning("engine %r: pid %d does not exist here; liveness by its requests only",
                    req.engine_id, req.pid)
        return False
    return True
