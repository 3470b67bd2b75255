"""KvSidecarConnector inside vLLM's MultiConnector, through the real Scheduler.

vLLM's MultiConnector composes connectors: a request loads from the first
one that has its tokens, saves go to all, and a request whose blocks two
children keep for an asynchronous send is freed only after both finished. The
second child here is vLLM's ExampleConnector (shared-storage KV, runs on CPU):
OffloadingConnector and SimpleCPUOffloadConnector need CUDA streams in their
workers, so they cannot run on this CPU-only machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("KVSIDECAR_REQUIRE_VLLM"):
    import vllm  # noqa: F401  # make test (CI) installed it: fail, never skip
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm==0.33.0)")

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.v1.request import RequestStatus

from kvsidecar.integrations.vllm import KvSidecarConnector
from kvsidecar.sim.cluster import SidecarProcess

from .harness import (
    BLOCK,
    Engine,
    kv_cache_config,
    oracle_fill,
    request,
    start_engine,
    vllm_config,
    write_model,
)
from .test_connector import FAST, prefill, run_until, start_all, verify

pytestmark = pytest.mark.vllm


class MultiEngine(Engine):
    """An Engine whose connectors are MultiConnectors; ours is child 0."""

    @property
    def connector(self) -> KvSidecarConnector:
        c = self.sched.connector
        assert isinstance(c, MultiConnector)
        ours = c._connectors[0]
        assert isinstance(ours, KvSidecarConnector)
        return ours

    def ours(self, rank: int) -> KvSidecarConnector:
        w = self.workers[rank]
        assert isinstance(w, MultiConnector)
        ours = w._connectors[0]
        assert isinstance(ours, KvSidecarConnector)
        return ours

    def buffers(self, rank: int) -> list[np.ndarray]:
        w = self.ours(rank).worker
        assert w is not None
        return [r.numpy() for r in w.regions]

    @property
    def layout(self) -> object:
        return self.layout_of(0)

    def layout_of(self, rank: int) -> object:
        w = self.ours(rank).worker
        assert w is not None
        return w.vl.layout


def make_multi_engine(name: str, model: str, role: str, socket: str, storage: Path,
                      num_blocks: int) -> MultiEngine:
    cfg = vllm_config(model, role, name, 1, [socket], False)
    assert cfg.kv_transfer_config is not None
    ours = cfg.kv_transfer_config
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector", kv_role=role, engine_id=name,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"connectors": [
            {"kv_connector": ours.kv_connector,
             "kv_connector_module_path": ours.kv_connector_module_path,
             "kv_role": role, "kv_connector_extra_config": ours.kv_connector_extra_config},
            {"kv_connector": "ExampleConnector", "kv_role": role,
             "kv_connector_extra_config": {"shared_storage_path": str(storage)}},
        ]})
    eng: MultiEngine = start_engine(name, cfg, kv_cache_config(1, num_blocks, False), [BLOCK],
                                    1, worker_cls=MultiConnector, engine_cls=MultiEngine)
    return eng


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess, ...]]:
    d = tmp_path_factory.mktemp("multi-sidecars")
    p = SidecarProcess(d, "mp", args=["--hold-timeout", "60", *FAST])
    q = SidecarProcess(d, "md", args=["--read-timeout", "60", "--handshake-timeout", "30",
                                      *FAST])
    try:
        start_all([p, q])
        yield p, q
    finally:
        p.stop()
        q.stop()


def test_multi_connector_with_vllms_example_connector(
        tmp_path: Path, sidecars: tuple[SidecarProcess, SidecarProcess]) -> None:
    """P and D each run MultiConnector([kvsidecar, ExampleConnector]): D loads
    from our connector (it has the tokens; ExampleConnector's storage has none),
    the bytes are the oracle's, P reports the send finished exactly once and
    frees every block exactly once, D's request runs to the end."""
    model = write_model(tmp_path / "llama", False)
    P = make_multi_engine("MP", model, "kv_producer", sidecars[0].socket, tmp_path / "p", 32)
    D = make_multi_engine("MD", model, "kv_consumer", sidecars[1].socket, tmp_path / "d", 32)
    P.fill = oracle_fill(lambda rid: 5)
    try:
        params = prefill(P, "m", 50, 5)
        D.sched.add_request(request(D, "m", 50, params, seed=5))
        D.step()
        assert D.sched.requests["m"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        blocks = tuple(list(g) for g in D.block_ids("m"))
        run_until(D, lambda: D.sched.requests["m"].status == RequestStatus.RUNNING)
        verify(D, "m", blocks, 50, 5)
        run_until(D, lambda: "m" in D.outputs and D.outputs["m"][-1].finished)
        sent = 0
        for _ in range(2000):
            _, agg = P.step()
            out = agg.kv_connector_output
            sent += "m" in ((out.finished_sending or ()) if out else ())
            if "m" not in P.sched.requests:
                break
        assert sent == 1 and "m" not in P.sched.requests
        for eng in (P, D):
            pool = eng.sched.kv_cache_manager.block_pool
            assert pool.get_num_free_blocks() == eng.sched.kv_cache_config.num_blocks - 1
    finally:
        for eng in (P, D):
            eng.ours(0).shutdown()
