"""One uid's share of a local socket's connections: the per-uid cap that the
engine socket (:mod:`~kvsidecar.daemon.engine_server`) and the fd socket
(:mod:`~kvsidecar.daemon.fd_server`) both apply.

Where the access policy admits uids besides the sidecar's own
(``--allow-uid``, ``--allow-gid``), one of them could otherwise take every
slot of a socket and lock the other uids' engines out. :func:`uid_cap` is
the share (``--max-engine-connections-per-uid``, at most three quarters of
the socket's total); :class:`UidLimit` checks a new connection against it,
lets the uid make room from its own idle connections (each server knows
what idle means for its connections), and words, counts and logs a
refusal. Pure but for the log line: the servers own the sockets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Final

from kvsidecar.metrics.log_rate import worth_logging

from .engine_access import AccessPolicy, PeerCred

__all__ = ["DEFAULT_MAX_CONNECTIONS_PER_UID", "UidLimit", "uid_cap"]

log = logging.getLogger(__name__)

#: Connections one uid may hold where several uids are admitted (see uid_cap).
DEFAULT_MAX_CONNECTIONS_PER_UID: Final = 64
_OPTION: Final = "--max-engine-connections-per-uid"


def uid_cap(access: AccessPolicy, per_uid: int, total: int) -> int | None:
    """The most connections one uid may hold; None: only ``total`` bounds it.

    Where ``access`` admits anyone besides the daemon's own uid (an
    ``--allow-uid``/``--allow-gid``), every admitted uid, the daemon's own and
    root included, may hold ``per_uid``, and never more than three quarters of
    ``total``: one of them must not take every slot and lock the others'
    engines out, also when a low fd limit shrank ``total`` to ``per_uid`` or
    below. None where only the daemon's own uid is admitted (there is nobody
    to lock out: a cap would only shrink the total).
    """
    if per_uid < 1:
        raise ValueError(f"per_uid must be >= 1, got {per_uid}")
    if not access.shared:
        return None
    return max(1, min(per_uid, total - total // 4))


class UidLimit:
    """The per-uid cap of one socket (``what``: its name in logs, ``target``:
    what a refused peer is told it holds connections to, ``advice``: what it
    should do). ``refused`` counts the connections refused over it."""

    def __init__(self, access: AccessPolicy, per_uid: int, total: int, *, what: str,
                 target: str, advice: str) -> None:
        #: the most connections one uid may hold (None: the socket's total alone)
        self.cap = uid_cap(access, per_uid, total)
        #: what sets the cap, for a refusal: the option, or the socket's total
        #: where three quarters of it bind first (raising the option changes nothing)
        self.bound = (_OPTION if self.cap is None or self.cap >= per_uid
                      else f"three quarters of its {total}; {_OPTION} is {per_uid}")
        self.what = what
        self.target = target
        self.advice = advice
        self.refused = 0

    def room(self, uid: int, held: Iterable[int], make_room: Callable[[int], bool]) -> bool:
        """Whether ``uid`` may open one more connection, ``held`` being the uids of
        the open ones: under its cap, or at it once ``make_room(uid)`` closed one
        of that uid's own idle connections (True if it did). Counted from the
        open connections: accepting is rare, and they are bounded."""
        cap = self.cap
        if cap is None or sum(u == uid for u in held) < cap:
            return True
        return make_room(uid)

    def refusal(self, cred: PeerCred) -> str:
        """Count and log a connection of ``cred`` refused over its uid's cap; what
        it is told."""
        self.refused += 1
        if worth_logging(self.refused):
            log.warning("%s: refused a connection of uid %d (pid %d): it holds %s, the limit "
                        "per uid (%s; %d refused so far)", self.what, cred.uid, cred.pid,
                        self.cap, self.bound, self.refused)
        return (f"uid {cred.uid} already holds {self.cap} connections to {self.target}, the "
                f"limit per uid ({self.bound}); {self.advice}")

    def full(self, uid: int) -> str:
        """For a log line when ``uid``'s own idle connection made room for a new one."""
        return f"uid {uid} holds {self.cap} connections (its limit)"
