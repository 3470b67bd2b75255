"""One slow request (a huge registration, a draining deregister) must not hold up
other engines: each request is answered by its own task."""

from __future__ import annotations

import asyncio

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
