"""KvSidecarConnector against vLLM 0.33's real v1 Scheduler, two real sidecars per side.

A P engine and a D engine, each a real ``Scheduler`` with our connector on
the scheduler side and one worker-side connector per tp rank; the bytes move
between real ``kvsidecar serve`` processes over NIXL and are checked by the
LAYOUT.md oracle.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm==0.33.0)")

from vllm.v1.request import RequestStatus

from kvsidecar.sim.cluster import SidecarProcess
from kvsidecar.sim.oracle import Request as OracleRequest
from kvsidecar.sim.oracle import check_received

from .harness import Engine, make_engine, oracle_fill, request, write_model

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

_ids = itertools.count()


class Sidecars:
    def __init__(self, workdir: Path) -> None:
        self.p = [SidecarProcess(workdir, f"vp{i}", args=["--hold-timeout", "60"])
                  for i in range(2)]
        self.d = [SidecarProcess(workdir, f"vd{i}", args=["--read-timeout", "20"])
                  for i in range(2)]
        self.workdir = workdir

    @property
    def all(self) -> list[SidecarProcess]:
        return self.p + self.d


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecars]:
    s = Sidecars(tmp_path_factory.mktemp("vllm-sidecars"))
    try:
        for sc in s.all:
            sc.start()
        yield s
    finally:
        for sc in s.all:
            sc.stop()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, str]:
    d = tmp_path_factory.mktemp("models")
    return {False: write_model(d / "llama", False), True: write_model(d / "hybrid", True)}


def pair(sidecars: Sidecars, models: dict[bool, str], p_tp: int, d_tp: int, hybrid: bool,
         seeds: dict[str, int]) -> tuple[Engine, Engine]:
    n = next(_ids)
    P = make_engine(f"P{n}", models[hybrid], "kv_producer", p_tp,
                    [s.socket for s in sidecars.p[:p_tp]], 64, hybrid)
    D = make_engine(f"D{n}", models[hybrid], "kv_consumer", d_tp,
                    [s.socket for s in sidecars.d[:d_tp]], 48, hybrid)
    P.fill = oracle_fill(lambda rid: seeds[rid])
    return P, D


def prefill(P: Engine, rid: str, tokens: int, seed: int) -> dict[str, Any]:
    """Run P until the request finishes; return the kv_transfer_params it hands D."""
    P.sched.add_request(request(P, rid, tokens, {"do_remote_decode": True}, max_tokens=1,
                                seed=seed))
    for _ in range(10):
        P.step()
        outs = P.outputs.get(rid, [])
        if outs and outs[-1].finished:
            params = outs[-1].kv_transfer_params
            assert params is not None and params["do_remote_prefill"], params
            return dict(params)
    raise AssertionError(f"P never finished {rid}")


def run_until(eng: Engine, done: Any, steps: int = 400) -> None:
    for _ in range(steps):
        eng.step()
        if done():
            return
    raise AssertionError(f"{eng.name}: condition not reached in {steps} steps")


def verify(D: Engine, rid: str, tokens_read: int, seed: int, skip: int = 0) -> None:
    """The oracle on every D rank; pages earlier reads wrote (D.dirty) may differ."""
    kinds = [g.kv_cache_spec.__class__.__name__ for g in D.sched.kv_cache_config.kv_cache_groups]
    ids = [[b for b in g if b != 0] for g in D.block_ids(rid)]
    ids = [g[-1:] if k == "MambaSpec" else g for g, k in zip(ids, kinds)]
    others = D.dirty | {b for r in D.sched.requests if r != rid for g in D.block_ids(r)
                        for b in g}
    for rank in range(len(D.workers)):
        problems = check_received(D.buffers(rank), D.layout_of(rank), rank, ids,
                                  OracleRequest(seed, tokens_read), skip,
                                  ignore_blocks=others)
        assert not problems, f"D rank {rank}: {problems}"
    D.dirty.update(b for g in ids for b in g)


CASES = [(1, 1, False), (1, 2, False), (2, 1, False), (1, 2, True)]


@pytest.mark.parametrize("p_tp,d_tp,hybrid", CASES,
                         ids=[f"{'hybrid' if h else 'attn'}-{p}to{d}" for p, d, h in CASES])
def test_p_to_d_through_real_schedulers(sidecars: Sidecars, models: dict[bool, str],
                                        p_tp: int, d_tp: int, hybrid: bool,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")  # what kvsidecar's layout needs
    seeds = {"r1": 11, "r2": 12}
    P, D = pair(sidecars, models, p_tp, d_tp, hybrid, seeds)
    try:
        for rid, tokens in (("r1", 70), ("r2", 33)):
            params = prefill(P, rid, tokens, seeds[rid])
            # Mamba: P computed N-1 tokens (D recomputes the last from its state).
            computed = tokens - 1 if hybrid else tokens
            assert params["remote_num_tokens"] == computed
            assert len(params["remote_handshake"]) == p_tp
            D.sched.add_request(request(D, rid, tokens, params, seed=seeds[rid]))
            D.step()  # schedules the read: the request waits for remote KV
            assert D.sched.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS
            run_until(D, lambda rid=rid: rid in D.sched.finished_recving_kv_req_ids
                      or D.sched.requests[rid].status == RequestStatus.RUNNING)
            verify(D, rid, computed, seeds[rid])
            # P frees its blocks once D's notification arrives.
            run_until(P, lambda rid=rid: rid not in P.sched.requests)
            run_until(D, lambda rid=rid: len(D.outputs.get(rid, [])) >= 2)
            assert D.sched.requests[rid].num_computed_tokens >= computed
        stats = D.workers[0].worker.stats  # type: ignore[union-attr]
        assert stats is not None
    finally:
        P.shutdown()
        D.shutdown()
