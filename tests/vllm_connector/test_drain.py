"""A prefill worker shut down with requests not yet pulled (issue #29): vLLM's
worker ``shutdown`` deregisters with ``drain``, so the sidecar keeps serving the
held requests from the memory it kept; D, scheduled by vLLM's real scheduler,
still receives them oracle-exact, and P's sidecar frees that memory once they
were read."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvsidecar.ipc.client import SidecarClient

from .flows import (
    assert_drained,
    closing,
    engines,
    finish_prefill,
    finished,
    reads_end_in_their_step,
    step_until,
)
from .harness import request
from .test_connector import WAIT_S, Sidecars, verify

pytestmark = pytest.mark.vllm

SEED = 5
TOKENS = 70  # hybrid: several attention blocks and the Mamba state


def _drained_line(side: Any, engine_id: str) -> str:
    deadline = time.monotonic() + WAIT_S
    while True:
        lines = [ln for ln in side.read_log().splitlines()
                 if f"engine {engine_id!r} generation" in ln and "drained in" in ln]
        if lines:
            return lines[-1]
        assert time.monotonic() < deadline, f"{side.name}: {engine_id} never drained"
        time.sleep(0.05)


@pytest.mark.parametrize(("p_tp", "d_tp", "memory"), [(1, 2, None), (2, 1, "memfd")],
                         ids=["1to2-shm", "2to1-memfd"])
def test_p_worker_shut_down_before_d_pulled_its_requests(
        sidecars: Sidecars, models: dict[bool, str], p_tp: int, d_tp: int,
        memory: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")  # what kvsidecar's layout needs
    mem = {"memory": memory} if memory else {}
    P, D = engines(sidecars, models[True], hybrid=True, p_tp=p_tp, d_tp=d_tp, seed=SEED,
                   p=mem, d=mem)
    rids = ["a", "b"]
    with closing(D):
        params = {rid: finish_prefill(P, rid, TOKENS, SEED) for rid in rids}
        # The step after a request finished hands its hold to the workers (vLLM's
        # engine core keeps stepping while finished requests wait to be sent).
        P.step()
        worker = P.workers[0].worker
        assert worker is not None
        engine_id = worker.engine_id
        P.shutdown()  # a normal shutdown: the engine process may exit now
        for side in sidecars.p[:p_tp]:
            with SidecarClient(side.socket) as c:
                assert engine_id not in c.ping().engines
        reads_end_in_their_step(D)
        for rid in rids:
            D.sched.add_request(request(D, rid, TOKENS, params[rid], seed=SEED))
        _, agg = D.step()
        assert agg.kv_connector_output.finished_recving == set(rids)
        assert not agg.kv_connector_output.failed_recving
        for rid in rids:
            verify(D, rid, D.block_ids(rid), TOKENS, SEED)
        step_until(D, lambda: all(finished(D, r) for r in rids))
        D.step()
        assert_drained(D)
    for side in sidecars.p[:p_tp]:
        line = _drained_line(side, engine_id)
        assert "sent 2" in line and "aborted" not in line and "expired" not in line, line
        assert side.proc is not None
        with open(f"/proc/{side.proc.pid}/maps") as f:
            assert not [ln for ln in f if engine_id in ln], "its memory is still mapped"
