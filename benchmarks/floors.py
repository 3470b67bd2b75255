"""Latency floors of the hops a small read makes, measured bare in the same run.

A 1-block read crosses, besides NIXL itself: the engine channel (the read
message in, the completion out through a waiting poll: one AF_UNIX round trip
in all), the peer channel (D's lease claim to P and its grant: one ZMQ round
trip over tcp with CURVE) and, in each sidecar, a hand-off between the event
loop and the NIXL worker thread (the post going in, the completion coming
out). Each function here times that hop with nothing else in the way: two
processes (or a loop and a thread) echoing 64 bytes, blocking, no sidecar
code. The difference between a sidecar hop and its floor is what the sidecar
adds there; the floors themselves are what no sidecar on this machine can go
below without changing the architecture (fewer hops), not the code.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import queue
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from kvsidecar.ipc.protocol import decode_reply_unchecked as _decode
from kvsidecar.ipc.protocol import encode_request as _encode

T = TypeVar("T")

__all__ = ["MinimalCaller", "expect", "loop_thread_rtts", "unix_cpu", "unix_rtts",
           "zmq_curve_rtts"]


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed, as the daemon runs."""
    try:
        import uvloop

        return uvloop.new_event_loop()  # type: ignore[no-any-return]
    except ImportError:
        return asyncio.new_event_loop()

_MSG = b"x" * 64
_WARM = 20


def _unix_echo(path: str, n: int, ready: Any, delay_s: float = 0.0) -> None:
    """Echo ``n`` packets, each after ``delay_s`` (spun, not slept: a sleep's
    granularity is coarser than the delays)."""
    from kvsidecar.ipc.seqpacket import new_socket

    listener = new_socket()
    listener.bind(path)
    listener.listen()
    ready.set()
    conn, _ = listener.accept()
    for _ in range(n):
        data = conn.recv(65536)
        if delay_s:
            until = time.perf_counter() + delay_s
            while time.perf_counter() < until:
                pass
        conn.send(data)
    conn.close()
    listener.close()


@contextlib.contextmanager
def _unix_echo_peer(n: int, delay_s: float = 0.0) -> Iterator[socket.socket]:
    """A connection to an AF_UNIX SEQPACKET echo in another process that answers
    ``n`` packets, each after ``delay_s``."""
    from kvsidecar.ipc.seqpacket import new_socket

    d = tempfile.mkdtemp(prefix="kvs-floor-unix-")
    path = f"{d}/echo.sock"
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_unix_echo, args=(path, n, ready, delay_s))
    proc.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the AF_UNIX echo process did not start")
        sock = new_socket()
        try:
            sock.connect(path)
            yield sock
        finally:
            sock.close()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        shutil.rmtree(d, ignore_errors=True)


def unix_cpu(n: int, delay_s: float = 0.0,
             between: Callable[[], object] | None = None) -> tuple[float, float]:
    """Client CPU seconds and wall seconds per bare blocking round trip over
    AF_UNIX SEQPACKET (the engine channel's transport) to an echo in another
    process that answers after ``delay_s``: the floor of any engine call. With a
    delay the client's thread sleeps and is woken, as while the daemon works;
    on a shared host that wake-up costs CPU of its own.

    ``between`` (untimed) runs before each round trip: what the engine does
    between two calls (fill its blocks, sleep) leaves the caches cold, and a
    call after it pays for that (an 8 MiB memset before each makes a bare round
    trip here cost 17 µs instead of 6), so a call measured after such work is
    compared with a round trip measured after the same work."""
    with _unix_echo_peer(n + _WARM, delay_s) as sock:
        for _ in range(_WARM):
            sock.send(_MSG)
            sock.recv(65536)
        cpu = wall = 0.0
        for _ in range(n):
            if between is not None:
                between()
            c0, w0 = time.process_time(), time.perf_counter()
            sock.send(_MSG)
            sock.recv(65536)
            cpu += time.process_time() - c0
            wall += time.perf_counter() - w0
        return cpu / n, wall / n


class MinimalCaller:
    """The least a Python caller of the engine channel can do per call: encode
    the request it built, send it, receive the reply into a fixed buffer and
    decode it, on a connection of its own to a real sidecar. No client: no
    checks of its input, no timeout, no reconnection, no error mapping. A
    client call measured alike, minus this, is what the client itself costs;
    this, minus the bare round trip (:func:`unix_cpu`), is what msgspec and the
    sidecar's answer cost."""

    def __init__(self, path: str) -> None:
        from kvsidecar.ipc.seqpacket import RECV_BYTES, new_socket

        self.sock = new_socket()
        try:
            self.sock.connect(path)
        except BaseException:
            self.sock.close()
            raise
        self.buf = bytearray(RECV_BYTES)
        self.view = memoryview(self.buf)

    def __call__(self, req: Any) -> Any:
        self.sock.send(_encode(req), socket.MSG_NOSIGNAL)
        n = self.sock.recv_into(self.buf, 0, socket.MSG_TRUNC)
        return _decode(self.view[:n])

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> MinimalCaller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def expect(reply: Any, kind: type[T]) -> T:
    """``reply``, checked (after the timing) to be a ``kind``."""
    if not isinstance(reply, kind):
        raise RuntimeError(f"expected {kind.__name__}, got {reply!r}")
    return reply


def unix_rtts(n: int, *, idle_s: float = 0.0) -> list[float]:
    """Seconds per round trip over AF_UNIX SEQPACKET (the engine channel's
    transport) to an echo in another process, both sides blocking; each
    after ``idle_s`` of nothing (as a read's messages come, between reads)."""
    with _unix_echo_peer(n + _WARM) as sock:
        out = []
        for i in range(n + _WARM):
            if idle_s:
                time.sleep(idle_s)
            t0 = time.perf_counter()
            sock.send(_MSG)
            sock.recv(65536)
            if i >= _WARM:
                out.append(time.perf_counter() - t0)
        return out


def _zmq_echo(port_out: Any, n: int, server_secret: bytes, on_loop: bool) -> None:
    import zmq

    from kvsidecar.ipc.loop_socket import LoopSocket

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.curve_server = True
    sock.curve_secretkey = server_secret
    port_out.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    if not on_loop:
        for _ in range(n):
            sock.send_multipart(sock.recv_multipart())
        sock.close(linger=1000)
        return

    async def serve() -> None:
        ls = LoopSocket(sock)
        for _ in range(n):
            await ls.send_multipart(await ls.recv_multipart())
        ls.close(linger=1000)

    loop = _new_loop()
    loop.run_until_complete(serve())
    loop.close()


def zmq_curve_rtts(n: int, *, on_loop: bool = False, idle_s: float = 0.0) -> list[float]:
    """Seconds per DEALER -> ROUTER round trip over tcp on loopback with CURVE
    (the peer channel's transport and security), to an echo in another process:
    both sides blocking, or (``on_loop``) both served by an event loop through
    :class:`~kvsidecar.ipc.loop_socket.LoopSocket` as the sidecars' peer channel
    is, so each message also wakes a sleeping loop. ``idle_s``: each round
    trip after that long of nothing, as a read's lease claim comes; on this
    host a round trip after 10 ms idle took four times one back to back."""
    import zmq

    from kvsidecar.ipc.loop_socket import LoopSocket

    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    proc = ctx.Process(target=_zmq_echo, args=(port_q, n + _WARM, server_secret, on_loop))
    proc.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.curve_serverkey = server_public
        sock.curve_publickey = client_public
        sock.curve_secretkey = client_secret
        sock.connect(f"tcp://127.0.0.1:{port_q.get(timeout=60)}")
        out: list[float] = []
        if not on_loop:
            for i in range(n + _WARM):
                if idle_s:
                    time.sleep(idle_s)
                t0 = time.perf_counter()
                sock.send(_MSG)
                sock.recv()
                if i >= _WARM:
                    out.append(time.perf_counter() - t0)
            return out

        async def ping() -> None:
            ls = LoopSocket(sock)
            for i in range(n + _WARM):
                if idle_s:
                    await asyncio.sleep(idle_s)
                t0 = time.perf_counter()
                await ls.send(_MSG)
                await ls.recv_multipart()
                if i >= _WARM:
                    out.append(time.perf_counter() - t0)

        loop = _new_loop()
        try:
            loop.run_until_complete(ping())
        finally:
            loop.close()
        return out
    finally:
        sock.close(linger=0)
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def loop_thread_rtts(n: int) -> list[float]:
    """Seconds from an event loop handing a job to a thread waiting on a
    :class:`queue.Queue` (as the NIXL worker does) until the loop runs the
    thread's ``call_soon_threadsafe`` answer: the floor of a post going to the
    worker and its completion coming back (uvloop when installed, as the daemon)."""
    loop = _new_loop()
    jobs: queue.Queue[asyncio.Future[None] | None] = queue.Queue()

    def worker() -> None:
        while True:
            fut = jobs.get()
            if fut is None:
                return
            loop.call_soon_threadsafe(fut.set_result, None)

    async def run() -> list[float]:
        out = []
        for i in range(n + _WARM):
            fut = loop.create_future()
            t0 = time.perf_counter()
            jobs.put(fut)
            await fut
            if i >= _WARM:
                out.append(time.perf_counter() - t0)
        return out

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        return loop.run_until_complete(run())
    finally:
        jobs.put(None)
        thread.join(5)
        loop.close()
