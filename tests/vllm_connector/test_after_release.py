"""A vLLM worker that starts again under the same engine id while its sidecar is
still releasing the previous registration (its reads may still land in the old
memory, so the sidecar refuses the id ``unavailable`` meanwhile) waits for it,
bounded, instead of failing its start as an unsupported config."""

from __future__ import annotations

import os

import pytest

if os.environ.get("KVSIDECAR_REQUIRE_VLLM"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm==0.33.0)")

from kvsidecar.daemon.engines.table import releasing_reason
from kvsidecar.integrations.vllm.worker import after_release
from kvsidecar.ipc.client import Unavailable
from kvsidecar.ipc.protocol import RELEASING, UNAVAILABLE


def _refusals(*errors: Exception) -> tuple[list[int], object]:
    calls: list[int] = []

    def call() -> str:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return "registered"

    return calls, call


def test_the_workers_marker_is_what_the_sidecar_says() -> None:
    assert RELEASING in releasing_reason("e", "gone")


def test_a_registration_refused_while_releasing_is_made_again_until_it_succeeds() -> None:
    releasing = Unavailable(UNAVAILABLE, releasing_reason("e", "its engine is gone"))
    calls, call = _refusals(releasing, releasing)
    assert after_release(call, "test", wait_s=5, pause_s=0.01) == "registered"  # type: ignore[arg-type]
    assert len(calls) == 3


def test_other_refusals_and_a_release_that_outlasts_the_wait_are_raised() -> None:
    other = Unavailable(UNAVAILABLE, "over the limit of reservations")
    calls, call = _refusals(other)
    with pytest.raises(Unavailable, match="limit"):
        after_release(call, "test", wait_s=5, pause_s=0.01)  # type: ignore[arg-type]
    assert len(calls) == 1
    releasing = Unavailable(UNAVAILABLE, releasing_reason("e", "its engine is gone"))
    calls, call = _refusals(*[releasing] * 100)
    with pytest.raises(Unavailable, match=RELEASING):
        after_release(call, "test", wait_s=0.5, pause_s=0.01)  # type: ignore[arg-type]
    assert 1 < len(calls) < 100
