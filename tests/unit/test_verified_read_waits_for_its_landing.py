"""A verified read hashed as it lands (daemon/d_side/waiting.py, post_and_wait):
its landing task hashes each part once that part's transfer ended, a few loop
iterations after it. When the read ends without comparing (aborted after its
transfers, or a part failed), the landing task may still be starting hashes of
the parts that ended. The read's task must not end before it did: an engine's
drop waits for the read's task, then for its hashing (Hashing.drain), then
unmaps its memory; a hash started after that drain read unmapped memory.

The transfers, the post and the landing are fakes here (bare futures, the
functions around them replaced): the race cannot be caused on demand for real."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvsidecar.daemon.d_side import waiting
from kvsidecar.daemon.d_side.addresses import PostList
from kvsidecar.daemon.d_side.book import ReadBook, ReadState
from kvsidecar.daemon.d_side.job import Attempt, ReadJob

OUTCOME = object()
E = np.empty(0, np.int64)


def _setup(monkeypatch: pytest.MonkeyPatch, landed: asyncio.Future[bytes],
           ops: list[asyncio.Future[Any]], *, fail: bool) -> Attempt:
    post = PostList(0, E, E, E)
    shape = waiting._Shape(None, ([post, post], [0, 0]), ([0, 1], [(E, E, E)] * 2), False)
    monkeypatch.setattr(waiting, "_shape", lambda *a: shape)
    monkeypatch.setattr(waiting, "post_read", lambda *a, **k: (ops, b"", {}, {}))
    monkeypatch.setattr(waiting, "ask_digests", lambda *a: [])
    monkeypatch.setattr(waiting, "landing", lambda *a: landed)

    def check(*a: Any, **k: Any) -> None:
        if fail:
            raise RuntimeError("part 1 of the transfer failed")

    monkeypatch.setattr(waiting, "check_results", check)
    monkeypatch.setattr(waiting, "outcome_of", lambda *a: OUTCOME)
    book = ReadBook(0.0, state=ReadState.POSTED)
    if not fail:
        book.abort("the engine deregistered")
    job = ReadJob(SimpleNamespace(request_id="r1"), book)  # type: ignore[arg-type]
    job.verify = SimpleNamespace(chunk_bytes=1 << 20)  # type: ignore[assignment]
    eng = SimpleNamespace(lanes=[SimpleNamespace(generation=0)], staging=None, engine_id="E")
    return Attempt(eng, job, None, timeout_s=math.inf)  # type: ignore[arg-type]


@pytest.mark.parametrize("fail", [False, True], ids=["aborted", "a-part-failed"])
async def test_the_read_ends_only_after_its_landing_hashes(monkeypatch: pytest.MonkeyPatch,
                                                           fail: bool) -> None:
    loop = asyncio.get_running_loop()
    landed: asyncio.Future[bytes] = loop.create_future()
    ops: list[asyncio.Future[Any]] = [loop.create_future(), loop.create_future()]
    a = _setup(monkeypatch, landed, ops, fail=fail)
    task = asyncio.ensure_future(waiting.post_and_wait(a, None, [PostList(0, E, E, E)],  # type: ignore[arg-type]
                                                       [None], [None]))
    for op in ops:
        op.set_result(None)
    for _ in range(20):
        await asyncio.sleep(0)
    assert not task.done(), "the read ended while its landing task could still start hashes"
    landed.set_result(b"")
    if fail:
        with pytest.raises(RuntimeError, match="part 1"):
            await task
    else:
        assert await task is OUTCOME
