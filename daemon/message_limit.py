"""Message size limits that are counted, not only enforced.

Two levels: the documented limit, enforced here with one error reply that
says so, and a hard cap (:data:`HARD_FACTOR` times the limit) past which a
message is not even buffered. On the engine socket (plain Unix SEQPACKET, see
:mod:`~kvsidecar.daemon.engine_server`) a message announced over the cap is
refused, counted, answered and its connection closed. On the ZMQ peer socket
the cap is libzmq's, for this reason:

libzmq's ``ZMQ_MAXMSGSIZE`` drops the connection of a peer whose frame is
larger, before any byte of it reaches the application, and says nothing about
why: libzmq 4.3.5's decoder fails with ``EMSGSIZE`` and the socket monitor sees
only ``EVENT_DISCONNECTED``, the very event an ordinary close produces
(measured; no handshake-failure event fires once the handshake is done). Such
a drop cannot be counted or told to the sender.

So the documented limit is enforced here, by the application, and libzmq's cap
is set :data:`HARD_FACTOR` times higher, as the memory backstop: a frame over
the limit but under the cap is received, refused with one error reply, counted
(``kvsidecar_refused_total{reason="too_large"}``) and logged; only a frame over
the cap is dropped uncounted, with its connection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence, Sized

from kvsidecar.metrics.log_rate import worth_logging

__all__ = ["HARD_FACTOR", "SizeLimit"]

log = logging.getLogger(__name__)

#: libzmq's cap as a multiple of the enforced limit.
HARD_FACTOR = 2


class SizeLimit:
    """The enforced limit of one socket (``channel`` names it in logs and metrics)."""

    def __init__(self, channel: str, limit: int,
                 on_refuse: Callable[[str], None] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"message size limit must be >= 1, got {limit}")
        self.channel = channel
        self.limit = limit
        self.refused = 0
        self._on_refuse = on_refuse

    @property
    def hard_cap(self) -> int:
        """The most bytes of one message ever buffered."""
        return self.limit * HARD_FACTOR

    @property
    def zmq_cap(self) -> int:
        """What to set as ``ZMQ_MAXMSGSIZE``."""
        return self.hard_cap

    def check(self, frames: Sequence[Sized]) -> str | None:
        """None when every frame fits; else the error message, counted and logged."""
        size = max((len(f) for f in frames), default=0)
        if size <= self.limit:
            return None
        return self.refuse(size)

    def refuse(self, size: int) -> str:
        """Count and log a message of ``size`` bytes refused; the error message."""
        self.refused += 1
        if self._on_refuse is not None:
            self._on_refuse("too_large")
        if worth_logging(self.refused):
            log.warning("%s socket: refused a message of %d bytes, over the limit of %d "
                        "(%d refused so far)", self.channel, size, self.limit, self.refused)
        return (f"message of {size} bytes is over this sidecar's limit of {self.limit} bytes "
                f"on the {self.channel} socket")
