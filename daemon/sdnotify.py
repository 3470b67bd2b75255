"""systemd's notify protocol (``Type=notify``), spoken directly over ``NOTIFY_SOCKET``.

The protocol is one datagram of ``KEY=value`` lines to the unix socket named
in ``$NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace). Twenty
lines of stdlib beat a dependency; outside systemd (no variable) every call
is a no-op, so the daemon runs the same everywhere.

Used for: ``READY=1`` once the engine socket, handshake port and metrics
endpoint listen; ``STATUS=`` one-line summaries; ``WATCHDOG=1`` from the event
loop while the daemon is live (:func:`watchdog_interval` tells how often);
``STOPPING=1`` when draining starts.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        self.address = os.environ.get("NOTIFY_SOCKET", "") if address is None else address
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines (``ready=1`` -> ``READY=1``); True if delivered."""
        if not self.address:
            return False
        msg = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(msg, target)
        except OSError as e:  # systemd gone or socket wrong: log, never crash the daemon
            log.warning("cannot notify systemd at %s: %s", self.address, e)
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval() -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``WatchdogSec``), or None when
    systemd asked for none (or asked another process: ``WATCHDOG_PID``)."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) <= 0 or (pid.isdigit() and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6
