"""Messages over an ``AF_UNIX`` ``SOCK_SEQPACKET`` socket: the engine channel's framing.

Why this socket: the kernel keeps message boundaries (one ``send`` is one
``recv``), so a message costs the engine one system call each way and no
I/O thread. Measured on the development host: a bare pyzmq DEALER round
trip cost its client 105 µs of CPU (the ZMQ I/O thread included), a bare
SEQPACKET round trip 13.5 µs.

Framing: a message of up to :data:`MAX_PACKET` bytes is one packet, exactly
the msgpack bytes of :mod:`~kvsidecar.ipc.protocol`. A longer one is sent as
a header packet, ``b"\\xc1KVL"`` and its length (u64, little endian),
followed by packets of up to :data:`MAX_PACKET` bytes that together are the
message. Why chunks: a packet must fit the sender's socket buffer
(``net.core.wmem_default`` is 208 KiB on stock kernels and an unprivileged
process can raise it only to twice ``wmem_max``), while registrations and
batches may be larger. ``0xc1`` is the one byte msgpack never uses, so no
valid message starts like a header.

This module is pure framing plus the receiving side's state machine; the
sockets belong to the client (:mod:`kvsidecar.ipc.client`) and the server
(:mod:`kvsidecar.daemon.engine_server`).
"""

from __future__ import annotations

import select
import socket
import struct
from typing import Final, TypeAlias

__all__ = ["MAX_PACKET", "RECV_BYTES", "Assembler", "BlockingChannel", "FramingError",
           "MessageTooLong",
           "new_socket", "packets", "peer_closed"]

#: The largest packet either side sends (well under the smallest default socket buffer).
MAX_PACKET: Final = 64 << 10
#: Receive buffers: one packet, and one byte to tell a longer (truncated) packet.
RECV_BYTES: Final = MAX_PACKET + 1
_LONG: Final = struct.Struct("<4sQ")
_LONG_MAGIC: Final = b"\xc1KVL"

Buffer: TypeAlias = bytes | bytearray | memoryview


class FramingError(ValueError):
    """Packets that break the framing (a chunk past the announced length, an
    over-long packet); the connection cannot be trusted to be in step again."""


class MessageTooLong(ValueError):
    """A header announced a message longer than the receiver accepts."""

    def __init__(self, length: int, cap: int) -> None:
        super().__init__(f"a message of {length} bytes was announced; at most {cap} "
                         "bytes are accepted")
        self.length = length


def new_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)


def packets(data: bytes) -> list[Buffer]:
    """The packets that carry ``data``: itself when it fits one packet."""
    if len(data) <= MAX_PACKET:
        return [data]
    view = memoryview(data)
    out: list[Buffer] = [_LONG.pack(_LONG_MAGIC, len(data))]
    out += [view[i:i + MAX_PACKET] for i in range(0, len(data), MAX_PACKET)]
    return out


def peer_closed(sock: socket.socket) -> bool:
    """After a receive of 0 bytes: the end of the connection (True), or an
    empty packet (False)? SEQPACKET reports both as 0; only the end sets
    ``POLLRDHUP``. A rare path, so a poll object per call is fine."""
    p = select.poll()
    p.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP)
    return bool(p.poll(0))


class Assembler:
    """Turns received packets back into messages (one per connection).

    :meth:`feed` returns the complete message, or None while a long message
    is still arriving. A single-packet message is returned as the packet
    itself (a view into the caller's receive buffer: use it before the next
    receive); a long one is gathered into one bytearray, returned whole.
    ``cap`` bounds what a header may announce (:class:`MessageTooLong`), so a
    peer cannot make the receiver hold more than that per connection. Why one
    bytearray, not a list of chunks: a peer may send a long message in
    1-byte packets, and a bytes object and a list slot per packet (41 bytes
    each) would make the announced length cost 41 times its size.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._parts = bytearray()
        #: The length of the long message being received (0: none). A plain
        #: attribute: the client reads it on every reply, before it decodes one
        #: packet without calling :meth:`feed`.
        self.announced = 0

    @property
    def assembling(self) -> bool:
        return self.announced > 0

    @property
    def received(self) -> int:
        """How many of its bytes have arrived."""
        return len(self._parts)

    def feed(self, packet: memoryview) -> Buffer | None:
        if len(packet) > MAX_PACKET:
            self.reset()
            raise FramingError(f"a packet of more than {MAX_PACKET} bytes (longer messages "
                               "are sent in chunks after a header)")
        if self.announced:
            if len(self._parts) + len(packet) > self.announced:
                self.reset()
                raise FramingError("the chunks of a long message ran past its announced length")
            self._parts += packet
            if len(self._parts) < self.announced:
                return None
            message = self._parts
            self.reset()
            return message
        if len(packet) == _LONG.size and bytes(packet[:4]) == _LONG_MAGIC:
            (_, length) = _LONG.unpack(packet)
            if length > self.cap:
                raise MessageTooLong(length, self.cap)
            if length <= MAX_PACKET:
                raise FramingError(f"a long-message header for {length} bytes, which fit "
                                   "one packet")
            self.announced = length
            return None
        return packet

    def reset(self) -> None:
        """Drop a long message under way (its connection ended or was refused)."""
        self._parts = bytearray()
        self.announced = 0


class BlockingChannel:
    """A bare blocking connection to an engine socket: whole messages in and
    out, nothing decoded. For tools, tests and the benchmark's floor; the
    clients in :mod:`kvsidecar.ipc.client` have their own."""

    def __init__(self, path: str, timeout_s: float = 10.0) -> None:
        self.sock = new_socket()
        self.sock.settimeout(timeout_s)
        try:
            self.sock.connect(path)
        except BaseException:
            self.sock.close()
            raise
        self._buf = bytearray(RECV_BYTES)
        self._assembler = Assembler(1 << 40)

    def send(self, data: bytes) -> None:
        for packet in packets(data):
            self.sock.send(packet, socket.MSG_NOSIGNAL)

    def recv(self) -> bytes:
        """The next message; EOFError when the other end closed, TimeoutError
        after the timeout."""
        view = memoryview(self._buf)
        while True:
            n = self.sock.recv_into(self._buf, 0, socket.MSG_TRUNC)
            if n == 0 and peer_closed(self.sock):
                raise EOFError("the other end closed the connection")
            message = self._assembler.feed(view[:n])
            if message is not None:
                return bytes(message)

    def readable(self, timeout_s: float) -> bool:
        """Whether a message (or the end) arrives within ``timeout_s``."""
        p = select.poll()
        p.register(self.sock.fileno(), select.POLLIN)
        return bool(p.poll(int(timeout_s * 1000)))

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> BlockingChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_timeval: Final = struct.Struct("@ll")


def set_timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Bound a blocking socket's sends and receives (``SO_SNDTIMEO``/``SO_RCVTIMEO``)
    to ``timeout_s``; a zero timeval means "block forever", so the shortest is 1 µs.
    (A blocking ``connect`` to a listener whose backlog is full waits for room
    up to the send timeout, where a Python timeout fails it at once.)"""
    usec = max(1, int(timeout_s * 1e6))
    tv = _timeval.pack(usec // 1_000_000, usec % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
