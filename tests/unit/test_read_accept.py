"""What D's read table refuses on acceptance, before any link or planning: a
read's remote block ids name each of P's pages once (P holds each once; their
range is the planner's, against P's layout), and one engine rank reads a
remote request once at a time."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from kvsidecar.daemon.d_side.table import ReadTable
from kvsidecar.ipc.layout import attention_layout
from kvsidecar.ipc.protocol import (
    BAD_REQUEST,
    Completion,
    Read,
    RemoteEngine,
    RequestError,
)
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


def test_a_second_read_of_a_hold_by_the_same_engine_waits_for_the_first_to_end() -> None:
    """P counts a reading rank's notification once: while one read of a remote
    request is in progress, another read of it by the same engine (another local
    request id) is refused, not started, or the first one's notification could
    end the hold under the second's transfer. Once the first ends it may go."""
    table, eng, started = _table(None)
    first = Read(id=1, engine_id="D", request_id="a", local_block_ids=[[0]],
                 remote=RemoteEngine("P", 1, ["127.0.0.1:1"]), remote_block_ids=[[3]],
                 remote_tokens=["t"], remote_request_id="p-req")
    table.accept(eng, first)
    again = Read(id=2, engine_id="D", request_id="b", local_block_ids=[[1]],
                 remote=RemoteEngine("P", 1, ["127.0.0.1:1"]), remote_block_ids=[[3]],
                 remote_tokens=["t"], remote_request_id="p-req")
    with pytest.raises(RequestError, match="already reading request 'p-req' of engine 'P' "
                                           r"\(read 'a'\)") as e:
        table.accept(eng, again)
    assert e.value.code == BAD_REQUEST and len(started) == 1
    table.accept(eng, Read(id=3, engine_id="D", request_id="c", local_block_ids=[[2]],
                           remote=RemoteEngine("P", 1, ["127.0.0.1:1"]),
                           remote_block_ids=[[3]], remote_tokens=["t"],
                           remote_request_id="other"))  # another request: fine
    eng.peers.release = lambda links: None
    table._finish(eng, started[0], Completion("a", "received"))
    table.accept(eng, again)
    assert len(started) == 3
