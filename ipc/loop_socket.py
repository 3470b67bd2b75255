"""A plain ZMQ socket driven by the running event loop, without ``zmq.asyncio``.

Why: ``zmq.asyncio`` wraps every send and receive in futures, timers and
poller bookkeeping. Measured here (uvloop, DEALER/ROUTER ping-pong over ipc,
2 cores, one run): a round trip cost the client 260 µs of CPU and 490 µs p50
through ``zmq.asyncio``, against 127 µs and 240 µs for the same sockets
driven by one ``loop.add_reader`` callback. The sidecar's latency is a chain
of such hops (engine → D → P → D → engine), so each hop's cost counts twice.

How: every call first tries the operation with ``NOBLOCK``; only when libzmq
says ``EAGAIN`` does it park one future, which the reader callback on the
socket's ``ZMQ_FD`` resolves. That descriptor is edge-like: it signals that
``ZMQ_EVENTS`` may have changed, and any libzmq call on the socket (a send
included) may consume the signal. So the callback always reads
``ZMQ_EVENTS`` (which re-arms it), and every send re-checks ``POLLIN`` for a
parked receiver, or a message that arrived during the send would wait for
the next unrelated wake-up.

One task receives from a socket at a time (each socket here has exactly one
reader task); any number may send. Not thread-safe, like the socket itself:
the loop's thread owns it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Literal, overload

import zmq

Frames = Sequence[Any]


class LoopSocket:
    """``sock`` (a blocking-API :class:`zmq.Socket`) served by the running loop.

    Options, binding and connecting go to :attr:`sock` directly; only the
    I/O that may have to wait goes through this wrapper.
    """

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._fd = int(sock.getsockopt(zmq.FD))
        self._reader: asyncio.Future[None] | None = None
        self._senders: list[asyncio.Future[None]] = []
        self._closed = False
        self._loop.add_reader(self._fd, self._on_fd)

    @classmethod
    def of(cls, ctx: zmq.Context[Any], kind: int) -> LoopSocket:
        """A new socket of ``kind`` in ``ctx`` (an asyncio context is shadowed, so
        CURVE's ZAP handler in that context still sees it)."""
        base: zmq.Context[Any] = (zmq.Context.shadow(ctx.underlying)
                                  if type(ctx) is not zmq.Context else ctx)
        return cls(base.socket(kind))

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, linger: int | None = None) -> None:
        """Close the socket; a parked receiver or sender gets ``ENOTSOCK``."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        self.sock.close(linger=linger)
        err = zmq.ZMQError(zmq.ENOTSOCK)
        for fut in [self._reader, *self._senders]:
            if fut is not None and not fut.done():
                fut.set_exception(err)
        self._reader = None
        self._senders.clear()

    def _on_fd(self) -> None:
        try:
            events = self._events()
        except zmq.ZMQError:
            return  # closed under us: close() already woke everyone
        self._wake(events)

    def _events(self) -> int:
        """``ZMQ_EVENTS``; reading it also re-arms the descriptor."""
        return int(self.sock.getsockopt(zmq.EVENTS))

    def _wake(self, events: int) -> None:
        if events & zmq.POLLIN and self._reader is not None and not self._reader.done():
            self._reader.set_result(None)
        if events & zmq.POLLOUT and self._senders:
            senders, self._senders = self._senders, []
            for fut in senders:
                if not fut.done():
                    fut.set_result(None)

    def _after_send(self) -> None:
        """A send may have swallowed the descriptor's signal for an arrived message."""
        if self._reader is not None:
            self._wake(self._events())

    def _check_open(self) -> None:
        if self._closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)

    @overload
    async def recv_multipart(self, copy: Literal[True] = True) -> list[bytes]: ...

    @overload
    async def recv_multipart(self, copy: Literal[False]) -> list[zmq.Frame]: ...

    async def recv_multipart(self, copy: bool = True) -> list[bytes] | list[zmq.Frame]:
        while True:
            self._check_open()
            try:
                out: list[bytes] | list[zmq.Frame] = self.sock.recv_multipart(
                    zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                pass
            else:
                if self._senders:  # the receive may have swallowed a POLLOUT signal
                    self._wake(self._events())
                return out
            if self._reader is not None:
                raise RuntimeError("another task is already receiving on this socket")
            fut = self._reader = self._loop.create_future()
            try:
                await fut
            finally:
                if self._reader is fut:
                    self._reader = None

    async def send_multipart(self, frames: Frames, copy: bool = True) -> None:
        while True:
            self._check_open()
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
                break
            except zmq.Again:
                pass
            fut = self._loop.create_future()
            self._senders.append(fut)
            await fut
        self._after_send()

    async def send(self, frame: Any) -> None:
        await self.send_multipart([frame])
