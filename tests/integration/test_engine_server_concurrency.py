"""One slow request (a huge registration, a draining deregister) must not hold up
other engines: a request that waits goes on in its own task."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest

from kvsidecar.daemon.engine_server import EngineServer
from kvsidecar.ipc.client import AsyncSidecarClient
from kvsidecar.ipc.protocol import Completions, Deregister, Ok, Ping, Pong, Reply, Request


class SlowDeregisterHandler:
    """Test double of the daemon's handler: Deregister waits for a gate."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.order: list[str] = []

    async def handle(self, req: Request) -> Reply:
        self.order.append(type(req).__name__)
        if isinstance(req, Deregister):
            await self.gate.wait()
            return Ok()
        if isinstance(req, Ping):
            return Pong(version=1)
        return Completions(items=[])


async def test_slow_request_does_not_block_others(tmp_path) -> None:
    handler = SlowDeregisterHandler()
    server = EngineServer(str(tmp_path / "s.sock"), handler)
    await server.start()
    try:
        async with AsyncSidecarClient(server.socket_path) as slow, \
                AsyncSidecarClient(server.socket_path) as fast:
            pending = asyncio.ensure_future(slow.deregister("big"))
            while "Deregister" not in handler.order:  # it reached the handler and waits
                await asyncio.sleep(0.005)
            assert (await fast.ping()).version == 1  # answered while Deregister waits
            assert await fast.poll("x") == []
            assert not pending.done()
            handler.gate.set()
            await asyncio.wait_for(pending, 5)
        assert handler.order == ["Deregister", "Ping", "Poll"]
    finally:
        await server.stop()


class AwaitingHandler:
    """Handlers that wait in each way a coroutine can: a bare yield, a future that
    fails, an executor, a sleep."""

    async def handle(self, req: Request) -> Reply:
        if isinstance(req, Ping):
            await asyncio.sleep(0)  # a bare yield
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()
            loop.call_soon(fut.set_exception, ValueError("from a future"))
            with pytest.raises(ValueError, match="from a future"):
                await fut  # its exception reaches the handler
            await loop.run_in_executor(None, lambda: None)
            await asyncio.sleep(0.01)
            return Pong(version=1)
        return Completions(items=[])


async def test_handlers_that_wait_are_carried_on_like_tasks(tmp_path) -> None:
    """A request's first step runs without a task; one that waits goes on in a
    task from where it stopped, whatever it waits on, answered in any order with
    the ones that never wait."""
    server = EngineServer(str(tmp_path / "s.sock"), AwaitingHandler())
    await server.start()
    try:
        async with AsyncSidecarClient(server.socket_path) as c:
            out = await asyncio.gather(*(c.ping() if i % 2 else c.poll("x")
                                         for i in range(20)))
        assert [isinstance(o, Pong) for o in out] == [bool(i % 2) for i in range(20)]
    finally:
        await server.stop()


async def test_cancelling_a_carried_on_request_cancels_what_it_waits_for() -> None:
    from kvsidecar.daemon.eager import carry_on

    seen: list[str] = []
    inner: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def handler() -> None:
        try:
            await inner
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    coro = handler()
    task = asyncio.ensure_future(carry_on(coro, coro.send(None)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled"] and inner.cancelled()


class BurstHandler:
    """Records, for each request, which burst (entry of the server's ``burst``
    context) it was handled in; None: outside any."""

    def __init__(self) -> None:
        self.bursts = 0
        self.current: int | None = None
        self.seen: list[int | None] = []

    @contextlib.contextmanager
    def burst(self) -> Iterator[None]:
        self.bursts += 1
        self.current = self.bursts
        try:
            yield
        finally:
            self.current = None

    async def handle(self, req: Request) -> Reply:
        self.seen.append(self.current)
        return Pong(version=1)


async def test_messages_queued_together_are_handled_in_one_burst(tmp_path) -> None:
    """Messages one wake-up reads from a connection are all handled inside one
    entry of ``burst`` (the sidecar gathers their reads there): the client sends
    five before the server's loop can run, then one more after their replies."""
    handler = BurstHandler()
    server = EngineServer(str(tmp_path / "s.sock"), handler, burst=handler.burst)
    await server.start()
    try:
        async with AsyncSidecarClient(server.socket_path) as c:
            await c.ping()  # connected
            assert handler.seen == [1]
            out = await asyncio.gather(*(c.ping() for _ in range(5)))
            assert len(out) == 5
            await c.ping()
        assert handler.seen == [1, 2, 2, 2, 2, 2, 3]
    finally:
        await server.stop()
