"""What D's read table refuses on acceptance, before any link or planning: a
read's remote block ids name each of P's pages once (P holds each once), and
lie within P's page count once a link to P is made."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from kvsidecar.daemon.d_side.table import ReadTable
from kvsidecar.ipc.layout import attention_layout
from kvsidecar.ipc.protocol import BAD_REQUEST, Read, RemoteEngine, RequestError
from kvsidecar.metrics.registry import Metrics


def _layout(num_blocks: int) -> Any:
    return attention_layout(model="m", num_layers=1, total_kv_heads=1, head_dim=8,
                            block_tokens=16, tp_size=1, num_blocks=num_blocks)


def _table(remote_blocks: int | None) -> tuple[ReadTable, Any, list[Any]]:
    table = ReadTable(ThreadPoolExecutor(1), None, 1.0,  # type: ignore[arg-type]
                      lambda eng, c: None, Metrics())
    started: list[Any] = []
    table._route = lambda eng, job: started.append(job)  # type: ignore[method-assign]
    peer = (None if remote_blocks is None
            else SimpleNamespace(info=SimpleNamespace(layout=_layout(remote_blocks))))
    eng = SimpleNamespace(engine_id="D", tp_rank=0, layout=_layout(8), verify_bytes=False,
                          peers=SimpleNamespace(cached=lambda *_a: peer))
    return table, eng, started


def _read(remote: list[int], rid: str = "r") -> Read:
    return Read(id=1, engine_id="D", request_id=rid, local_block_ids=[[0]],
                remote=RemoteEngine("P", 1, ["127.0.0.1:1"]), remote_block_ids=[remote],
                remote_tokens=["t"])


@pytest.mark.parametrize("remote_blocks", [None, 64])
def test_remote_ids_named_twice_are_refused_on_acceptance(remote_blocks: int | None) -> None:
    table, eng, started = _table(remote_blocks)
    with pytest.raises(RequestError, match="remote block id 0 named twice: a hold names each "
                                           "page once, so a read does too") as e:
        table.accept(eng, _read([0] * 2_000_000))
    assert e.value.code == BAD_REQUEST and not started and table.count("D") == 0
    table.accept(eng, _read([5, 0, 1], "ok"))  # many remote pages for one local: a hit
    assert len(started) == 1


def test_remote_ids_past_a_linked_peers_pages_are_refused_on_acceptance() -> None:
    table, eng, started = _table(16)
    with pytest.raises(RequestError, match=r"remote group 0: block id 16 out of range "
                                           r"\[0, 16\)"):
        table.accept(eng, _read([15, 16]))
    assert not started
    table, eng, started = _table(None)  # not linked yet: the planner checks the range
    table.accept(eng, _read([15, 16]))
    assert len(started) == 1
