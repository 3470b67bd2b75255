"""Failed KV loads, through vLLM 0.33's real scheduler and real sidecars: the
scenarios of vLLM's ``test_kv_load_failure_recovery.py`` / error-propagation
tests and NixlConnector's failure cases (handshake failure and transfer failure
"return finished", logged at ERROR, both ``kv_load_failure_policy`` values).

The contract: a read that fails is reported in ``finished_recving`` in one
step, with its blocks in ``get_block_ids_with_load_errors`` when the model has
a single KV-cache group (vLLM then keeps the valid prefix) and in
``failed_recving`` when it has several; with ``recompute`` vLLM then
computes the prompt itself, with ``fail`` it ends the request FINISHED_ERROR;
either way its blocks come back and nothing is stuck. A sidecar error never
escapes the worker as an exception (vLLM would take that for a dead engine).
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import pytest

if os.environ.get("KVSIDECAR_REQUIRE_VLLM"):
    import vllm  # noqa: F401  # make test (CI) installed it: fail, never skip
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm==0.33.0)")

from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from kvsidecar.ipc.client import SidecarClient
from kvsidecar.sim.oracle import POISON

from .flows import (
    assert_drained,
    closing,
    engines,
    finish_prefill,
    finished,
    reported,
    step_until,
    waiting_for_kv,
)
from .harness import BLOCK, Engine, failed_reads, request
from .test_connector import Sidecars

pytestmark = pytest.mark.vllm

SEED = 5
TOKENS = int(BLOCK * 2.5)
#: P's lease on blocks no D reads: the failing reads below never reach them
LEASE = {"extra": {"hold_timeout_s": 1.0}}


def unknown_to_p(params: dict[str, Any]) -> dict[str, Any]:
    """P's params naming an engine P's sidecar does not have: D's sidecar
    reaches P's, which refuses to serve it (a failed handshake)."""
    return {**params, "remote_engine_id": params["remote_engine_id"] + "-gone"}


def failed_step(D: Engine, rid: str) -> tuple[Any, Any]:
    """From the step that schedules ``rid``'s read (it may fail within that
    step), step D until a worker reports it failed: the scheduling step's
    connector metadata and the output of the step that reported the failure."""
    so, agg = D.step()
    outs = [agg.kv_connector_output]
    if rid not in failed_reads(outs[0]):
        outs += step_until(D, lambda: rid not in D.sched.requests or not waiting_for_kv(D, rid)
                           or rid in D.sched.finished_recving_kv_req_ids)
    (out,) = [o for o in outs if rid in failed_reads(o)]
    return so.kv_connector_metadata, out


def test_failed_handshake_is_a_failed_read_and_d_recomputes(
        sidecars: Sidecars, models: dict[bool, str]) -> None:
    """Policy ``recompute``: the failed read is finished in one step with the
    request's blocks invalid (one KV-cache group: no ``failed_recving``, so
    vLLM keeps any valid prefix; here there is none); vLLM then schedules the
    whole prompt locally, nothing is ever written into D's pages, and both engines
    end empty (P's unread hold at its lease)."""
    P, D = engines(sidecars, models[False], seed=SEED, p=LEASE)
    with closing(P, D):
        params = unknown_to_p(finish_prefill(P, "f", TOKENS, SEED))
        D.sched.add_request(request(D, "f", TOKENS, params, seed=SEED))
        meta, out = failed_step(D, "f")
        (job,) = meta.reads
        assert out.finished_recving == {"f"} and not out.failed_recving
        assert out.invalid_block_ids == set(job.local_block_ids[0])
        so, _ = D.step()
        assert so.num_scheduled_tokens == {"f": TOKENS}  # all of it, locally
        step_until(D, lambda: finished(D, "f"))
        assert sum(len(o.new_token_ids) for o in D.outputs["f"]) == 4
        assert all((b == POISON).all() for b in D.buffers(0))
        D.step()
        assert_drained(D)
        step_until(P, lambda: not P.sched.requests)
        assert_drained(P)


def test_fail_policy_ends_the_request_with_an_error(sidecars: Sidecars,
                                                    models: dict[bool, str]) -> None:
    """Policy ``fail``: the request ends FINISHED_ERROR (finish reason
    ERROR) in the step its failure is reported, its blocks come back, D is
    empty and nothing was written into its pages."""
    P, D = engines(sidecars, models[False], seed=SEED, p=LEASE,
                   d={"failure_policy": "fail"})
    with closing(P, D):
        params = unknown_to_p(finish_prefill(P, "f", TOKENS, SEED))
        D.sched.add_request(request(D, "f", TOKENS, params, seed=SEED))
        failed_step(D, "f")
        assert finished(D, "f")
        assert D.outputs["f"][-1].finish_reason == FinishReason.ERROR
        D.step()
        assert_drained(D)
        assert all((b == POISON).all() for b in D.buffers(0))
        step_until(P, lambda: not P.sched.requests)


def test_a_failed_read_is_logged_at_error_with_its_request_id(
        sidecars: Sidecars, models: dict[bool, str], caplog: pytest.LogCaptureFixture) -> None:
    """As vLLM's NixlConnector tests require of transfer failures."""
    P, D = engines(sidecars, models[False], seed=SEED, p=LEASE)
    with closing(P, D), caplog.at_level(logging.WARNING, logger="kvsidecar"):
        params = unknown_to_p(finish_prefill(P, "logged", TOKENS, SEED))
        D.sched.add_request(request(D, "logged", TOKENS, params, seed=SEED))
        failed_step(D, "logged")
        errors = [r for r in caplog.records if r.name.startswith("kvsidecar")
                  and r.levelno >= logging.ERROR and "logged" in r.getMessage()]
        assert errors, [r.getMessage() for r in caplog.records]
        step_until(D, lambda: finished(D, "logged"))
        step_until(P, lambda: not P.sched.requests)


def test_a_refused_hold_ends_the_send_and_frees_p_blocks(sidecars: Sidecars,
                                                         models: dict[bool, str]) -> None:
    """P's sidecar no longer knows P (it dropped its registration): the hold is
    refused. Right outcome: the request is reported in ``finished_sending``,
    its blocks come back, no exception reaches vLLM."""
    P, D = engines(sidecars, models[False], seed=SEED)
    with closing(P, D):
        with SidecarClient(sidecars.p[0].socket) as c:
            c.deregister(P.name)
        params = finish_prefill(P, "h", TOKENS, SEED)
        assert params["remote_block_ids"]
        outs = step_until(P, lambda: "h" not in P.sched.requests)
        assert reported(outs, "finished_sending") == {"h"}
        assert_drained(P)


def test_a_failed_poll_fails_the_reads_in_flight(sidecars: Sidecars,
                                                models: dict[bool, str]) -> None:
    """D's sidecar drops D while its read waits on a silent P: D's poll can no
    longer be answered for D. Right outcome: the read in flight is reported
    finished and failed, vLLM recomputes the prompt, no exception reaches vLLM."""
    P, D = engines(sidecars, models[False], seed=SEED)
    p_proc = sidecars.p[0].proc
    assert p_proc is not None
    with closing(P, D):
        params = finish_prefill(P, "r", TOKENS, SEED)
        p_proc.send_signal(signal.SIGSTOP)
        try:
            D.sched.add_request(request(D, "r", TOKENS, params, seed=SEED))
            D.step()  # the read waits on P
            with SidecarClient(sidecars.d[0].socket) as c:
                c.deregister(D.name)
            outs = step_until(D, lambda: "r" in D.sched.finished_recving_kv_req_ids)
            (out,) = [o for o in outs if "r" in failed_reads(o)]
            assert out.finished_recving == {"r"}
        finally:
            p_proc.send_signal(signal.SIGCONT)
        so, _ = D.step()
        assert so.num_scheduled_tokens == {"r": TOKENS}
        assert D.sched.requests["r"].status == RequestStatus.RUNNING
