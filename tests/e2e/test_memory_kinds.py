"""Region kinds through real sidecars: memfd host memory passed by SCM_RIGHTS,
mixed with POSIX shm, every byte checked with the LAYOUT.md oracle; GPU kinds
refused by a host-memory sidecar with a reason."""

from __future__ import annotations

import pytest

from kvsidecar.ipc.client import BadRequest, Duplicate, SidecarClient
from kvsidecar.ipc.memfd import MemfdRegion
from kvsidecar.ipc.memory import ShmRegion
from kvsidecar.ipc.protocol import CudaIpcRef, MemfdRef, ReservedRef
from kvsidecar.sim.models import attn, hybrid
from kvsidecar.sim.oracle import Request

from .test_transfers import assert_received, assert_sent

pytestmark = pytest.mark.e2e

GPU = "GPU-01234567-89ab-cdef-0123-456789abcdef"


@pytest.mark.parametrize(("p_mem", "d_mem"), [("memfd", "memfd"), ("memfd", "shm"),
                                              ("shm", "memfd")])
def test_memfd_regions_transfer_hetero_tp(pool, p_mem: str, d_mem: str) -> None:
    """P tp1 -> D tp2, hybrid attention + Mamba2: the engines' memory is memfds the
    sidecars created and passed over the fd socket; NIXL reads land in the pages
    the engine maps (the oracle reads them through the engine's own mapping)."""
    with pool.engines(hybrid, 1, 2, memory=p_mem, d_memory=d_mem) as (P, (D,)):
        for e, mem in ((P, p_mem), (D, d_mem)):
            kinds = {type(r) for reg in e.registrations for r in reg.regions}
            assert kinds == ({MemfdRegion} if mem == "memfd" else {ShmRegion}), (mem, kinds)
        rids = []
        for i, tokens in enumerate((9, 150)):
            rid = f"memfd-{p_mem}-{d_mem}-{i}"
            D.start_read(P.prefill(rid, Request(seed=40 + i, prompt_tokens=tokens)))
            rids.append(rid)
        assert_received(D, rids)
        assert_sent(P, rids)


def test_host_sidecar_refuses_gpu_kinds(pool) -> None:
    c = SidecarClient(pool.d[0].socket, timeout_s=30)
    layout = attn(2)(1, 8)
    try:
        for memory in ("cuda_malloc", "cuda_vmm"):
            with pytest.raises(BadRequest, match=f"memory kind '{memory}' needs a GPU sidecar "
                                                 r"\(--device cuda:N.*serves shm, memfd$"):
                c.register(pool.uid("gpu"), 0, layout, allocate=True, memory=memory)  # type: ignore[arg-type]
        # Attach mode with the engine's own GPU tensors: refused the same way.
        refs = [CudaIpcRef(b"\x01" * 64, GPU, layout.region_bytes)
                for _ in range(layout.num_regions)]
        with pytest.raises(BadRequest, match="memory kind 'cuda_ipc' needs a GPU sidecar"):
            c.register(pool.uid("gpu"), 0, layout, regions=[_Ref(r) for r in refs])  # type: ignore[list-item]
        # The sidecar's own export kinds are not attachable.
        with pytest.raises(BadRequest, match="attach mode cannot take 'memfd' regions"):
            c.register(pool.uid("gpu"), 0, layout,
                       regions=[_Ref(MemfdRef("ab" * 16, i, layout.region_bytes))  # type: ignore[list-item]
                                for i in range(layout.num_regions)])
        assert c.ping().version >= 1  # still serving
    finally:
        c.close()


class _Ref:
    """Stands in for a region object in attach mode: the client only calls ref()."""

    def __init__(self, ref: object) -> None:
        self._ref = ref

    def ref(self) -> object:
        return self._ref


@pytest.mark.parametrize("memory", ["memfd", "shm"])
def test_reserved_views_transfer(pool, memory: str) -> None:
    """The vLLM path (integrations/vllm/pool.py): each rank reserves one allocation, then
    registers the layout's regions as views at gapped offsets into it; the
    sidecar registers its own memory. Hybrid P tp1 -> D tp2, oracle-checked."""
    with pool.engines(hybrid, 1, 2, memory=memory, reserve=True) as (P, (D,)):
        rids = []
        for i, tokens in enumerate((33, 140)):
            rid = f"reserved-{memory}-{i}"
            D.start_read(P.prefill(rid, Request(seed=70 + i, prompt_tokens=tokens)))
            rids.append(rid)
        assert_received(D, rids)
        assert_sent(P, rids)


def test_reservation_rules(pool) -> None:
    c = SidecarClient(pool.d[1].socket, timeout_s=30)
    eid = pool.uid("res")
    layout = attn(2)(1, 8)
    try:
        r = c.reserve(eid, 1 << 20)
        again = c.reserve(eid, 1 << 20)  # a retry: the same reservation, mapped again
        r.numpy()[:3] = 5
        assert again.numpy()[:3].tolist() == [5, 5, 5]
        again.close()
        with pytest.raises(Duplicate, match="already has a reservation"):
            c.reserve(eid, 2 << 20)
        from kvsidecar.ipc.regions import RegionView

        with pytest.raises(BadRequest, match="ends past the 1048576 B reservation"):
            c.register(eid, 0, layout, regions=[  # type: ignore[list-item]
                _Ref(ReservedRef((1 << 20) - layout.region_bytes + 1, layout.region_bytes))
                for _ in range(layout.num_regions)])
        with pytest.raises(BadRequest, match="has no reservation here"):
            c.register(pool.uid("nores"), 0, layout,
                       regions=[RegionView(r, 0, layout.region_bytes)] * layout.num_regions)
        c.deregister(eid)  # drops a reservation that never registered
        fresh = c.reserve(eid, 2 << 20)  # so a new size is accepted now
        assert fresh.nbytes == 2 << 20 and fresh.numpy()[:3].tolist() == [0, 0, 0]
        fresh.close()
        c.deregister(eid)
        r.close()
    finally:
        c.close()
