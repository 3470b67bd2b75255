"""D's group read path (daemon/d_side/waiting.py, post_all): a posted read of a
group is completed from its transfers' done callbacks. What ``settle`` raises there
would otherwise be swallowed by asyncio ("Exception in callback") and the read
ended later as if cancelled; it must reach the batch's task instead.

The transfers here are bare futures and ``check_results`` / ``outcome_of``
are replaced: a bug in ``settle`` cannot be caused for real, so this is a
fake of that fault, named as such. The real path is covered end to end by
tests/e2e/test_read_batch.py."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any

import pytest

from kvsidecar.daemon.d_side import waiting as read_batch
from kvsidecar.daemon.d_side.book import ReadBook, ReadState
from kvsidecar.daemon.d_side.job import ReadJob
from kvsidecar.daemon.d_side.waiting import _Renewals, _Waiting

OUTCOME = object()


@pytest.fixture(autouse=True)
def no_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(read_batch, "check_results", lambda *a: None)
    monkeypatch.setattr(read_batch, "outcome_of", lambda *a: OUTCOME)


def _waiting(settle: Any, bugs: list[BaseException], ops: list[asyncio.Future[Any]],
             ended: bool = False) -> _Waiting:
    job = ReadJob(SimpleNamespace(request_id="r1"),  # type: ignore[arg-type]
                  ReadBook(0.0, state=ReadState.ABORTED if ended else ReadState.POSTED))
    w = _Waiting(None, job, None, [], ops, _Renewals(math.inf), None,  # type: ignore[arg-type]
                 settle, bugs)
    for op in ops:
        op.add_done_callback(w.one_done)
    return w


async def _run(settle: Any, ended: bool = False) -> tuple[list[BaseException], list[Any]]:
    loop = asyncio.get_running_loop()
    swallowed: list[Any] = []
    loop.set_exception_handler(lambda _loop, ctx: swallowed.append(ctx))
    bugs: list[BaseException] = []
    ops = [loop.create_future(), loop.create_future()]
    _waiting(settle, bugs, ops, ended)
    ops[0].set_result(None)
    await asyncio.sleep(0)
    ops[1].set_exception(RuntimeError("transfer failed"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    return bugs, swallowed


async def test_settled_once_after_the_last_transfer() -> None:
    calls: list[Any] = []
    bugs, swallowed = await _run(lambda job, got: calls.append(got))
    assert calls == [OUTCOME]
    assert bugs == [] and swallowed == []


async def test_a_read_ended_meanwhile_is_not_settled_again() -> None:
    calls: list[Any] = []
    bugs, swallowed = await _run(lambda job, got: calls.append(got), ended=True)
    assert calls == [] and bugs == [] and swallowed == []


async def test_a_bug_in_settle_reaches_the_batch_not_the_loops_handler() -> None:
    bug = ValueError("settle is broken")

    def settle(job: Any, got: Any) -> None:
        raise bug

    bugs, swallowed = await _run(settle)
    assert bugs == [bug]
    assert swallowed == []


async def test_a_cancelled_transfer_settles_the_read_as_failed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the real check: a cancelled transfer future (nothing cancels them
    today) fails the read through settle, not past the callback."""
    from kvsidecar.daemon.d_side.posting import check_results
    monkeypatch.setattr(read_batch, "check_results",
                        lambda eng, job, metrics, posts, results: check_results(
                            eng, job, None, posts, results, notified=False))
    loop = asyncio.get_running_loop()
    swallowed: list[Any] = []
    loop.set_exception_handler(lambda _loop, ctx: swallowed.append(ctx))
    calls: list[Any] = []
    bugs: list[BaseException] = []
    ops = [loop.create_future()]
    _waiting(lambda job, got: calls.append(got), bugs, ops)
    ops[0].cancel()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(calls) == 1 and isinstance(calls[0], asyncio.CancelledError)
    assert bugs == [] and swallowed == []
