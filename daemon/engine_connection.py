"""One engine's connection to the engine socket (:mod:`~kvsidecar.daemon.engine_server`):
its reads (a loop reader callback, up to ``READ_BURST`` messages a turn), its
long-message assembly under the server's budget and deadline, its replies
(sent at once; queued while the kernel takes no more, and reading paused past
``MAX_UNSENT`` of them) and its requests in flight. Event loop thread only.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

from kvsidecar.metrics.log_rate import worth_logging

from ..ipc.protocol import BAD_MESSAGE, UNAVAILABLE, Error, Reply
from ..ipc.seqpacket import (
    Assembler,
    Buffer,
    FramingError,
    MessageTooLong,
    packets,
    peer_closed,
)
from .engine_access import PeerCred
from .message_limit import SizeLimit

__all__ = ["MAX_UNSENT", "READ_BURST", "Connection", "Server"]

log = logging.getLogger(__name__)

#: Unsent reply packets after which the server stops reading that connection.
MAX_UNSENT = 64
#: Packets read per wake-up of one connection, so one busy engine cannot
#: starve the others (level-triggered: the rest is read on the next turn).
READ_BURST = 64


class Server(Protocol):
    """What a connection uses of its server (:class:`~kvsidecar.daemon.engine_server.EngineServer`):
    the shared receive buffer, the budget of long messages, the counters and
    the callbacks for a whole message, an error reply and its own end."""

    _buf: bytearray
    _view: memoryview
    _listener: socket.socket | None
    size_limit: SizeLimit
    burst: Callable[[], AbstractContextManager[None]]
    assembling_bytes: int
    max_assembling_bytes: int
    long_message_timeout_s: float
    messages: int
    bad_messages: int
    refused_assembling: int
    slow_messages: int
    paused_unread: int

    def _message(self, conn: Connection, data: Buffer) -> None: ...
    def _error(self, reply: Error) -> Error: ...
    def _encode(self, reply: Reply) -> bytes: ...
    def _refuse(self, reason: str) -> None: ...
    def _closed(self, conn: Connection) -> None: ...


class Connection:
    """One engine's connection: its reads (a loop reader callback), its
    long-message assembly, its unsent replies and its requests in flight."""

    def __init__(self, server: Server, sock: socket.socket, cred: PeerCred | None,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.sock = sock
        self.fd = sock.fileno()
        self.cred = cred
        self.in_flight = 0
        self.waiting: set[asyncio.Task[None]] = set()  # its waiting polls
        self._loop = loop
        #: loop time of the last whole message (or of the accept)
        self.last_seen = loop.time()
        #: engine ids a Registered or Reserved reply went over this connection
        #: for: while one is live (EngineServer.engine_live), the connection is
        #: an engine's own, never closed for being idle
        self.engines: set[str] = set()
        self._assembler = Assembler(server.size_limit.hard_cap)
        #: what this connection's long message under way counts in server.assembling_bytes
        self._reserved = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._unsent: collections.deque[Buffer] = collections.deque()
        self._reading = False
        self._writing = False
        self._closing = False
        self._closed = False

    def loop_time(self) -> float:
        return self._loop.time()

    @property
    def assembling(self) -> bool:
        """A long message is under way (its own deadline bounds it)."""
        return self._reserved > 0

    def resume(self) -> None:
        if not self._reading and not self._closed:
            self._loop.add_reader(self.fd, self._on_readable)
            self._reading = True

    def pause(self) -> None:
        if self._reading:
            self._loop.remove_reader(self.fd)
            self._reading = False

    def pause_unread(self) -> None:
        """Stop reading: the engine leaves its replies unread (counted once per
        pause; reading resumes when the queue drains, see :meth:`_flush`)."""
        if self._reading:
            self.server.paused_unread += 1
            self.pause()

    def close(self) -> None:
        if self._closed:
            return
        self.pause()
        if self._writing:
            self._loop.remove_writer(self.fd)
            self._writing = False
        self._closed = True
        self._unsent.clear()
        self._end_long()
        self.sock.close()
        for task in list(self.waiting):
            task.cancel()
        self.server._closed(self)

    def _on_readable(self) -> None:
        with self.server.burst():
            self._read_burst()

    def _read_burst(self) -> None:
        """Read and answer up to ``READ_BURST`` queued messages."""
        server = self.server
        view = server._view
        for _ in range(READ_BURST):
            if not self._reading:
                return  # paused (replies piling up) or closed by a message
            try:
                n = self.sock.recv_into(server._buf, 0, socket.MSG_TRUNC)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # ECONNRESET: the engine went away with replies unread
                if e.errno not in (errno.ECONNRESET, errno.EPIPE):
                    log.info("engine socket: a connection failed: %s", e)
                self.close()
                return
            if n == 0 and peer_closed(self.sock):
                self.close()
                return
            assembler = self._assembler
            try:
                message = assembler.feed(view[:n])
            except MessageTooLong as e:
                self._too_long(e)
                return
            except FramingError as e:
                self._end_long()
                server.messages += 1
                server.bad_messages += 1
                self.reply(server._error(Error(BAD_MESSAGE, f"{e}; closing the connection")))
                self.close_after_replies()
                return
            if message is not None:
                if self._reserved:
                    self._end_long()
                server._message(self, message)
            elif (not self._reserved and assembler.assembling
                  and not self._start_long(assembler.announced)):
                return  # refused: the connection is closing

    def _start_long(self, length: int) -> bool:
        """A header announced a long message: count it against the server's budget
        (False: refused, the connection closing) and start its deadline."""
        server = self.server
        if server.assembling_bytes + length > server.max_assembling_bytes:
            self._assembler.reset()
            server.messages += 1
            server.refused_assembling += 1
            server._refuse("assembly_limit")
            if worth_logging(server.refused_assembling):
                log.warning("engine socket: refused a message of %d bytes, long messages "
                            "under way already announce %d bytes, the limit %d (%d refused "
                            "so far)", length, server.assembling_bytes,
                            server.max_assembling_bytes, server.refused_assembling)
            self.reply(server._error(Error(UNAVAILABLE, (
                f"long messages being received already announce {server.assembling_bytes} "
                f"bytes; a message of {length} more is over this sidecar's limit of "
                f"{server.max_assembling_bytes} bytes at once; closing the connection, try "
                "again"))))
            self.close_after_replies()
            return False
        self._reserved = length
        server.assembling_bytes += length
        self._deadline = self._loop.call_later(server.long_message_timeout_s, self._too_slow)
        return True

    def _end_long(self) -> None:
        """The long message under way is whole, refused or gone: give its budget back."""
        self.server.assembling_bytes -= self._reserved
        self._reserved = 0
        self._assembler.reset()
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        """A long message was not whole in time: refused, counted, connection closed."""
        self._deadline = None
        server = self.server
        got, length = self._assembler.received, self._reserved
        self._end_long()
        server.messages += 1
        server.bad_messages += 1
        server.slow_messages += 1
        server._refuse("slow_message")
        if worth_logging(server.slow_messages):
            log.warning("engine socket: a message of %d bytes was not whole %.0f s after its "
                        "header (%d bytes came); closing its connection (%d so far)", length,
                        server.long_message_timeout_s, got, server.slow_messages)
        self.reply(server._error(Error(BAD_MESSAGE, (
            f"a message of {length} bytes did not arrive whole within "
            f"{server.long_message_timeout_s:g} s of its header ({got} bytes came); closing "
            "the connection"))))
        self.close_after_replies()

    def _too_long(self, e: MessageTooLong) -> None:
        """Over twice the limit: refused, counted, and the connection closed, so its
        chunks are never buffered."""
        server = self.server
        server.messages += 1
        server.bad_messages += 1
        too_large = server.size_limit.refuse(e.length)
        self.reply(server._error(Error(BAD_MESSAGE, f"{too_large} (--max-message-bytes); "
                                                    "closing the connection")))
        self.close_after_replies()

    def close_after_replies(self) -> None:
        """Stop reading; close once what is queued was sent (or could not be)."""
        self.pause()
        self._closing = True
        if not self._unsent:
            self.close()

    def reply(self, reply: Reply) -> None:
        if self._closed:
            return  # the engine went away: nobody to tell
        self._unsent.extend(packets(self.server._encode(reply)))
        if not self._writing:
            self._flush()
        elif len(self._unsent) > MAX_UNSENT:
            # Checked here too, not only when a flush is stuck: the kernel takes
            # nothing more while the engine reads nothing, so no flush runs, and
            # the replies to what is read meanwhile would pile up without bound.
            self.pause_unread()

    def _flush(self) -> None:
        unsent = self._unsent
        try:
            while unsent:
                self.sock.send(unsent[0], socket.MSG_NOSIGNAL)
                unsent.popleft()
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # the engine closed its end: its replies have no reader
            self.close()
            return
        if unsent:
            if not self._writing:
                self._loop.add_writer(self.fd, self._flush)
                self._writing = True
            if len(unsent) > MAX_UNSENT:
                self.pause_unread()  # the engine does not read its replies: stop reading it
            return
        if self._writing:
            self._loop.remove_writer(self.fd)
            self._writing = False
        if self._closing:
            self.close()
        elif not self._reading and self.server._listener is not None:
            self.resume()
