"""``cpu_policy.apply`` in this process: every thread gets the policy, one
started meanwhile by a thread of it too, and a refusal is reported, not raised
(the sidecar runs on). Each test puts this process back as it found it."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

from kvsidecar.daemon import cpu_policy


@pytest.fixture(autouse=True)
def restore() -> Iterator[None]:
    yield
    cpu_policy.apply("normal")


def test_every_live_thread_gets_the_policy_and_the_threads_it_starts_inherit() -> None:
    go, seen = threading.Event(), []
    waiter = threading.Thread(target=go.wait)
    waiter.start()
    assert waiter.native_id is not None
    try:
        assert cpu_policy.apply("batch") is None
        assert os.sched_getscheduler(waiter.native_id) == os.SCHED_BATCH
        later = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
        later.start()
        later.join()
        assert seen == [os.SCHED_BATCH]
        assert cpu_policy.apply("normal") is None
        assert os.sched_getscheduler(waiter.native_id) == os.SCHED_OTHER
    finally:
        go.set()
        waiter.join()


def test_a_refusal_is_reported_with_how_many_threads_it_hit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(tid: int, policy: int, param: os.sched_param) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    why = cpu_policy.apply("batch")
    assert why is not None and "failed for" in why and "not permitted" in why


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="one of batch, normal"):
        cpu_policy.apply("fifo")
