"""handlers: every engine request type has exactly one handler in the table, and a
stopping sidecar refuses the requests that would start new work (counted)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from kvsidecar.daemon.handlers import Handlers
from kvsidecar.daemon.state import DaemonState
from kvsidecar.ipc.protocol import (
    REQUEST_TYPES,
    UNAVAILABLE,
    Hold,
    Ping,
    Pong,
    Read,
    Register,
    RequestError,
    Reserve,
)
from kvsidecar.metrics.registry import Metrics


def _handlers(stopping: bool) -> tuple[Handlers, Metrics]:
    async def never(_req: Any) -> Any:
        raise AssertionError("a refused request reached its handler")

    metrics = Metrics()
    ctx = SimpleNamespace(
        registry=SimpleNamespace(register=never, reserve=never), metrics=metrics,
        state=DaemonState(stopping=stopping), table=SimpleNamespace(ranks={}),
        settings=SimpleNamespace(engine_lease_s=5.0))
    return Handlers(cast(Any, ctx)), metrics


def test_every_request_type_has_its_handler() -> None:
    handlers, _ = _handlers(stopping=False)
    assert set(handlers.table) == set(REQUEST_TYPES)


@pytest.mark.parametrize("req", [
    Register(id=1, engine_id="e", tp_rank=0, layout=cast(Any, None), mode="allocate"),
    Read(id=1, engine_id="e", request_id="r", local_block_ids=[0], remote=cast(Any, None),
         remote_block_ids=[0]),
    Hold(id=1, engine_id="e", request_id="r", block_ids=[0]),
    Reserve(id=1, engine_id="e", nbytes=4096),
], ids=lambda r: type(r).__name__)
def test_a_stopping_sidecar_refuses_new_work(req: Any) -> None:
    handlers, metrics = _handlers(stopping=True)
    with pytest.raises(RequestError) as e:
        asyncio.run(handlers.handle(req))
    assert e.value.code == UNAVAILABLE
    op = type(req).__name__.lower()
    assert _count(metrics, op, UNAVAILABLE) == 1


def test_a_stopping_sidecar_still_answers_pings() -> None:
    handlers, metrics = _handlers(stopping=True)
    assert isinstance(asyncio.run(handlers.handle(Ping(id=1))), Pong)
    assert _count(metrics, "ping", "") == 1


def _count(m: Metrics, op: str, error: str) -> float:
    v = m.registry.get_sample_value("kvsidecar_engine_requests_total", {"op": op, "error": error})
    return 0.0 if v is None else v
