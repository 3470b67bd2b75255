"""How a worker's :class:`~kvsidecar.integrations.vllm.transfers.Transfers`
reads what a poll returns, against a fake client (``PollingClient``: it only
answers ``poll_nowait`` with what the real client returns in a race that real
sidecars produce only now and then).

The race: D's sidecar is killed with a read sent without waiting still unread
in its socket; the client sends it again, with a new parked poll, to the
restarted sidecar, which refuses both ``unknown_engine``. When the client
takes the read's refusal before the poll's, the poll returns the refusal as a
``failed`` completion and no error: that completion alone must tell the
worker the registration is gone (``test_sidecar_errors`` runs the real
restart, with the read taken and with it unread).
"""

from __future__ import annotations

import logging
import os
from typing import cast

import pytest

if os.environ.get("KVSIDECAR_REQUIRE_VLLM"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm==0.33.0)")

from kvsidecar.integrations.vllm.layout import VllmLayout
from kvsidecar.integrations.vllm.messages import KvSidecarMetadata, ReadJob
from kvsidecar.integrations.vllm.settings import Settings
from kvsidecar.integrations.vllm.transfers import Transfers
from kvsidecar.ipc.client import ReadSpec, SidecarClient
from kvsidecar.ipc.errors import BadRequest, UnknownEngine
from kvsidecar.ipc.posted_requests import refusal_code, refusal_reason
from kvsidecar.ipc.protocol import UNKNOWN_ENGINE, Completion, Error

pytestmark = pytest.mark.vllm


class PollingClient:
    """A fake :class:`SidecarClient`: ``poll_nowait`` returns the queued lists,
    reads sent without waiting are taken; anything else is not expected here."""

    def __init__(self) -> None:
        self.polls: list[list[Completion]] = []
        self.reads: list[str] = []

    def read_nowait(self, engine_id: str, request_id: str, *args: object,
                    **kwargs: object) -> None:
        self.reads.append(request_id)

    def read_many_nowait(self, engine_id: str, specs: list[ReadSpec]) -> None:
        self.reads += [s.request_id for s in specs]

    def poll_nowait(self, engine_id: str) -> list[Completion]:
        return self.polls.pop(0) if self.polls else []


def job(rid: str, blocks: list[int]) -> ReadJob:
    return ReadJob(rid, [blocks], "P0", 1, ["tcp://127.0.0.1:1"], rid, [blocks], 0,
                   16 * len(blocks), True)


def transfers(client: PollingClient) -> Transfers:
    return Transfers(cast(SidecarClient, client), "D0", 0, "/run/d.sock", Settings(), "memfd",
                     cast(VllmLayout, None), batches=True, keeps=True, one_group=True)


def test_refusal_code_reads_only_a_refusal_the_client_made() -> None:
    refused = refusal_reason(UnknownEngine(UNKNOWN_ENGINE, "engine 'D0' is not registered"))
    assert refusal_code(Completion("x", "failed", refused)) == UNKNOWN_ENGINE
    assert refusal_code(Completion("x", "failed", refusal_reason(
        Error("bad_request", "block 9 is out of range")))) == "bad_request"
    assert refusal_code(Completion("x", "failed", "transfer error: UCX timed out")) == ""
    assert refusal_code(Completion("x", "aborted", refused)) == ""
    assert refusal_code(Completion("x", "failed", "refused by the sidecar (")) == ""


def test_a_read_refused_unknown_engine_fails_every_read_for_the_lost_registration(
        caplog: pytest.LogCaptureFixture) -> None:
    """The poll brings only x's refusal; y, in flight too, was taken by the
    sidecar that died. Both fail in this step, for the lost registration
    (their blocks invalid, vLLM recomputes), no read goes to the sidecar
    until the rank registers again, and x is reported once."""
    client = PollingClient()
    t = transfers(client)
    t.start(KvSidecarMetadata(reads=[job("x", [3, 4]), job("y", [5])]))
    assert client.reads == ["x", "y"]
    refused = refusal_reason(UnknownEngine(UNKNOWN_ENGINE, "engine 'D0' is not registered here"))
    client.polls.append([Completion("x", "failed", refused)])
    caplog.set_level(logging.ERROR, logger="kvsidecar.integrations.vllm")

    out = t.results()

    assert out.finished_recving == {"x", "y"}
    assert t.load_errors() == {3, 4, 5}
    failed = [r.getMessage() for r in caplog.records if "its KV read failed" in r.getMessage()]
    assert len(failed) == 2
    assert all("lost engine 'D0' rank 0's registration" in m and "unknown_engine" in m
               for m in failed)
    assert "lost engine" in t._down
    t._next_repair = float("inf")  # registering again is test_sidecar_errors' part
    t.start(KvSidecarMetadata(reads=[job("z", [6])]))
    assert client.reads == ["x", "y"]  # z failed at once: the sidecar has no registration
    assert t.results().finished_recving == {"z"}
    assert t.load_errors() == {6}


def test_another_refusal_fails_its_read_alone() -> None:
    """A read refused for itself (``bad_request``) fails alone; the link stays up."""
    client = PollingClient()
    t = transfers(client)
    t.start(KvSidecarMetadata(reads=[job("x", [3]), job("y", [5])]))
    client.polls.append([Completion("x", "failed", refusal_reason(
        BadRequest("bad_request", "block 3 is out of range")))])
    out = t.results()
    assert out.finished_recving == {"x"}
    assert t.load_errors() == {3}
    assert t._down == ""
    t.start(KvSidecarMetadata(reads=[job("z", [6])]))
    assert client.reads == ["x", "y", "z"]
