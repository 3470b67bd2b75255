"""An engine's keepalive: its liveness told to its sidecar independently of its work.

The sidecar takes an engine rank that sends nothing for ``--engine-lease``
seconds for dead and releases it (docs/failure-handling.md, "Engines that
die"). An engine that only talks to its sidecar from its own steps (vLLM's
workers: no step while no request is waiting) would be released while idle. :class:`Keepalive`
is a daemon thread of the engine process, on its own connection, that pings
the sidecar naming the engine's ranks (``Ping.engines``, protocol minor 9)
every third of the sidecar's lease (``Pong.engine_lease_s``): an idle engine
stays registered for any length of time, and one whose process died stops
pinging and is released by the lease (or sooner by its pid) as before.

Each answer also says whether the ranks are still registered there: a rank
missing from it (the sidecar restarted, or released it) is reported in
:attr:`Keepalive.missing` until the owner, in its own thread, has made it
good (re-registered) and called :meth:`Keepalive.clear`. The thread never
touches the owner's state and never raises: a sidecar that is down or stuck
only delays the next answer (each ping waits at most ``timeout_s``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from .client import SidecarClient, SidecarError
from .protocol import Pong

__all__ = ["DEFAULT_PERIOD_S", "Keepalive", "period_for"]

log = logging.getLogger(__name__)

DEFAULT_PERIOD_S = 10.0
"""Between pings when the sidecar does not say its lease (a sidecar before minor 9)."""
MIN_PERIOD_S = 0.05


def period_for(engine_lease_s: float) -> float:
    """Pings every third of the lease: two may be lost before the lease runs out."""
    if engine_lease_s <= 0:
        return DEFAULT_PERIOD_S
    return max(MIN_PERIOD_S, engine_lease_s / 3)


class Keepalive:
    """Pings ``socket_path`` naming ``engines`` from a daemon thread until :meth:`close`."""

    def __init__(self, socket_path: str, engines: Sequence[str], *, timeout_s: float = 5.0,
                 client: Callable[[str, float], SidecarClient] = SidecarClient) -> None:
        self.engines = tuple(engines)
        self._client = client(socket_path, timeout_s)
        self._stop = threading.Event()
        self._sleep = threading.Event()
        self._lock = threading.Lock()
        self._missing: frozenset[str] = frozenset()
        self._thread = threading.Thread(target=self._run, name="kvsidecar-keepalive",
                                        daemon=True)
        #: seconds between pings (from the sidecar's first answer)
        self.period_s = DEFAULT_PERIOD_S
        #: answers received (a test watches it move)
        self.answers = 0

    def start(self) -> Keepalive:
        self._thread.start()
        return self

    @property
    def missing(self) -> frozenset[str]:
        """The ranks the sidecar's latest answer did not list (registered no more)."""
        return self._missing

    def clear(self, engine_id: str) -> None:
        """The owner re-registered ``engine_id``: it is not missing any more."""
        with self._lock:
            self._missing = self._missing - {engine_id}

    def ping_now(self) -> None:
        """Ping at once rather than at the next period (the owner suspects a restart)."""
        self._sleep.set()

    def close(self) -> None:
        self._stop.set()
        self._sleep.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self._client.timeout_s + 1.0)
        self._client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pong = self._client.ping(self.engines)
            except SidecarError as e:
                log.debug("kvsidecar keepalive: no answer (%s); trying again", e)
            except Exception:  # never let the thread die: it is the engine's liveness
                log.exception("kvsidecar keepalive: ping failed; trying again")
            else:
                self._answered(pong)
            if self._sleep.wait(self.period_s):
                self._sleep.clear()

    def _answered(self, pong: Pong) -> None:
        self.period_s = period_for(pong.engine_lease_s)
        listed = set(pong.engines)
        gone = frozenset(e for e in self.engines if e not in listed)
        with self._lock:
            new = gone - self._missing
            self._missing = gone
            self.answers += 1
        if new:
            log.warning("kvsidecar keepalive: the sidecar no longer lists %s (it restarted or "
                        "released them)", sorted(new))
