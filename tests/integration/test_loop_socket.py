"""LoopSocket: a plain ZMQ socket driven by the event loop's reader callback.

The hazards it must get right are the ZMQ_FD's edge-like signal: a message
that arrives while the socket is busy sending, replies that pile up while
nobody receives, a close while a task waits, and a full send queue.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from kvsidecar.ipc.loop_socket import LoopSocket

_n = itertools.count()
_made: list[LoopSocket] = []

Ctx = zmq.Context[Any]


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    """A context whose LoopSockets are all closed (linger 0) before it ends."""
    c: Ctx = zmq.Context()
    yield c
    while _made:
        _made.pop().close(0)
    c.term()


def _socket(ctx: Ctx, kind: int) -> LoopSocket:
    sock = LoopSocket.of(ctx, kind)
    _made.append(sock)
    return sock


def _pair(ctx: Ctx, transport: str = "inproc") -> tuple[LoopSocket, LoopSocket]:
    server = _socket(ctx, zmq.ROUTER)
    if transport == "inproc":
        server.sock.bind(f"inproc://loop-socket-{next(_n)}")
    else:
        server.sock.bind("tcp://127.0.0.1:*")
    client = _socket(ctx, zmq.DEALER)
    client.sock.connect(server.sock.getsockopt_string(zmq.LAST_ENDPOINT))
    return server, client


async def test_round_trips_both_ways(ctx: Ctx) -> None:
    server, client = _pair(ctx)
    for i in range(200):
        await client.send(b"ping %d" % i)
        who, body = await asyncio.wait_for(server.recv_multipart(), 2)
        assert body == b"ping %d" % i
        await server.send_multipart([who, b"pong %d" % i])
        assert await asyncio.wait_for(client.recv_multipart(), 2) == [b"pong %d" % i]


async def test_a_parked_receiver_wakes_for_a_message_that_lands_during_a_send(ctx: Ctx) -> None:
    """The client parks a receive, then sends many requests; the server answers
    each at once. Replies that arrive while the client is inside ``send``
    must still wake the parked receiver (the send consumed the fd signal)."""
    server, client = _pair(ctx)
    got: list[bytes] = []

    async def receive(n: int) -> None:
        while len(got) < n:
            got.extend(await client.recv_multipart())

    async def echo(n: int) -> None:
        for _ in range(n):
            who, body = await server.recv_multipart()
            await server.send_multipart([who, body])

    n = 500
    reader = asyncio.ensure_future(receive(n))
    echoer = asyncio.ensure_future(echo(n))
    await asyncio.sleep(0)
    for i in range(n):
        await client.send(b"%d" % i)
        if i % 7 == 0:
            await asyncio.sleep(0)
    await asyncio.wait_for(asyncio.gather(reader, echoer), 5)
    assert got == [b"%d" % i for i in range(n)]


async def test_a_reply_signalled_just_before_a_send_still_wakes_the_receiver(ctx: Ctx) -> None:
    """Deterministic form of the hazard: the reply lands (its fd signal is
    pending) and the socket then sends before the loop runs its callback; the
    send may consume the signal, so the wrapper re-checks ZMQ_EVENTS (this
    test fails without that re-check)."""
    for transport in ("inproc", "tcp"):
        server, client = _pair(ctx, transport)
        await client.send(b"hello")
        who, _ = await asyncio.wait_for(server.recv_multipart(), 2)
        for i in range(20):
            parked = asyncio.ensure_future(client.recv_multipart())
            await asyncio.sleep(0.005)  # parked; the loop is idle
            server.sock.send_multipart([who, b"reply %d" % i])  # no loop turn after this
            time.sleep(0.002)  # the reply reaches the client's pipe
            await client.send(b"more %d" % i)  # a send before the fd callback ran
            assert await asyncio.wait_for(parked, 1) == [b"reply %d" % i], transport
            await asyncio.wait_for(server.recv_multipart(), 2)


async def test_messages_queued_while_nobody_receives_are_all_delivered(ctx: Ctx) -> None:
    server, client = _pair(ctx)
    for i in range(50):
        await client.send(b"%d" % i)
    await asyncio.sleep(0.05)  # the fd fired with no receiver parked
    bodies = [(await asyncio.wait_for(server.recv_multipart(), 2))[1] for _ in range(50)]
    assert bodies == [b"%d" % i for i in range(50)]


async def test_close_wakes_a_parked_receiver_with_enotsock(ctx: Ctx) -> None:
    server, _ = _pair(ctx)
    waiting = asyncio.ensure_future(server.recv_multipart())
    await asyncio.sleep(0.01)
    server.close(0)
    with pytest.raises(zmq.ZMQError) as e:
        await asyncio.wait_for(waiting, 2)
    assert e.value.errno == zmq.ENOTSOCK
    with pytest.raises(zmq.ZMQError):
        await server.send_multipart([b"x", b"y"])


async def test_a_second_concurrent_receiver_is_refused(ctx: Ctx) -> None:
    server, client = _pair(ctx)
    first = asyncio.ensure_future(server.recv_multipart())
    await asyncio.sleep(0.01)
    with pytest.raises(RuntimeError, match="already receiving"):
        await server.recv_multipart()
    await client.send(b"one")
    assert (await asyncio.wait_for(first, 2))[1] == b"one"


async def test_a_full_send_queue_waits_instead_of_dropping(ctx: Ctx) -> None:
    """DEALER at its send high-water mark: ``send`` waits for room (POLLOUT),
    and every message arrives once the peer reads."""
    addr = f"inproc://loop-socket-{next(_n)}"
    server = _socket(ctx, zmq.ROUTER)
    server.sock.setsockopt(zmq.RCVHWM, 4)
    server.sock.bind(addr)
    client = _socket(ctx, zmq.DEALER)
    client.sock.setsockopt(zmq.SNDHWM, 4)
    client.sock.connect(addr)
    n = 100
    sending = asyncio.ensure_future(asyncio.gather(*(client.send(b"%d" % i) for i in range(n))))
    await asyncio.sleep(0.05)
    assert not sending.done()  # blocked on the high-water mark, not dropped
    bodies = []
    for _ in range(n):
        bodies.append(int((await asyncio.wait_for(server.recv_multipart(), 2))[1]))
    await asyncio.wait_for(sending, 2)
    assert sorted(bodies) == list(range(n))


async def test_shares_an_asyncio_context() -> None:
    """Sockets made from a ``zmq.asyncio`` context live in that context (CURVE's
    ZAP handler is bound there)."""
    actx = zmq.asyncio.Context()
    server, client = _pair(actx)
    try:
        assert server.sock.context.underlying == actx.underlying
        await client.send(b"hi")
        assert (await asyncio.wait_for(server.recv_multipart(), 2))[1] == b"hi"
    finally:
        while _made:
            _made.pop().close(0)
        actx.term()
