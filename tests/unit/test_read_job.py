"""D's read record (daemon/d_side/job.py): an abort request does what the read's
book says (cancel before posting, through the batch's drop or the read's task;
nothing once posted), and each exception reaches the retry policy as the
failure it is."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from kvsidecar.daemon.d_side.book import Failure, ReadBook, ReadState
from kvsidecar.daemon.d_side.job import PartialReadError, ReadJob, failure_of
from kvsidecar.daemon.leases import LeaseLost, LeaseRefused
from kvsidecar.daemon.transport.worker import (
    NixlAgentReset,
    NixlError,
    NixlKilledByReset,
    NixlTimeout,
)
from kvsidecar.ipc.hold_token import TokenError


def _job(state: ReadState) -> ReadJob:
    return ReadJob(SimpleNamespace(request_id="r1"),  # type: ignore[arg-type]
                   ReadBook(0.0, state=state))


class _Task:
    def __init__(self) -> None:
        self.cancelled = 0

    def cancel(self) -> None:
        self.cancelled += 1


@pytest.mark.parametrize("state", list(ReadState))
def test_abort_cancels_only_what_posted_nothing(state: ReadState) -> None:
    unposted = state in (ReadState.ACCEPTED, ReadState.LINKING, ReadState.PLANNING)
    alone = _job(state)
    task = _Task()
    alone.task = task  # type: ignore[assignment]
    alone.abort("released")
    assert task.cancelled == (1 if unposted else 0)
    in_batch = _job(state)
    dropped: list[Any] = []
    in_batch.task = _Task()  # type: ignore[assignment]
    in_batch.on_abort = dropped.append
    in_batch.abort("released")
    assert dropped == ([in_batch] if unposted else [])
    assert in_batch.task.cancelled == 0  # type: ignore[union-attr]  # the batch's task runs on
    assert alone.abort_reason == "released"  # noted in every state; the first stands


def test_the_jobs_view_of_its_book() -> None:
    job = _job(ReadState.POSTED)
    assert job.posted and not job.ended and not job.notified and job.accepted_at == 0.0
    job.book.notify()
    assert job.notified
    assert _job(ReadState.RECEIVED).ended


@pytest.mark.parametrize("error,failure", [
    (PartialReadError("x"), Failure.PARTIAL),
    (LeaseRefused("x", answered=True), Failure.REFUSED),
    (LeaseRefused("x", answered=True, stale_link=True), Failure.REFUSED_STALE_LINK),
    (TokenError("x"), Failure.TOKEN),
    (NixlTimeout("x"), Failure.TIMEOUT),
    (NixlAgentReset("x"), Failure.RESET),
    (NixlKilledByReset("x"), Failure.RESET),
    (NixlError("x"), Failure.TRANSFER),
    (LeaseLost("x"), Failure.OTHER),
    (RuntimeError("x"), Failure.OTHER),
    (asyncio.CancelledError(), Failure.OTHER),
])
def test_failure_of(error: BaseException, failure: Failure) -> None:
    assert failure_of(error) is failure
