"""The KV memory pool (integrations/vllm/pool.py): vLLM's one KV allocation served from a
sidecar reservation, zero-copy; everything else passes through. Host memory here
(a real memfd); the same code serves a CUDA region on a GPU."""

from __future__ import annotations

import pytest
import torch

from kvsidecar.integrations.vllm.pool import ReservationTooSmall, SidecarKVPool
from kvsidecar.ipc.memfd import MemfdRegion
from kvsidecar.ipc.memory import RegionError
from kvsidecar.ipc.protocol import ReservedRef


@pytest.fixture
def region():
    r = MemfdRegion.create("kvs-pool-test", 1 << 20)
    yield r
    r.close()


def test_the_kv_allocation_lands_in_the_reservation(region: MemfdRegion) -> None:
    pool = SidecarKVPool(region, expect_bytes=600_000)
    with pool:
        other = torch.zeros(16, dtype=torch.int8)  # another size: not the KV buffer
        kv = torch.zeros(600_000, dtype=torch.int8, device="cpu")
        after = torch.zeros(600_000, dtype=torch.int8)  # only one allocation is taken
    assert kv.data_ptr() == region.address and pool.tensor is kv
    assert other.data_ptr() != region.address and after.data_ptr() != region.address
    region.numpy()[:4] = 9
    assert kv[:4].tolist() == [9, 9, 9, 9]  # the same pages, no copy


def test_only_int8_one_dimensional_cpu_allocations_are_taken(region: MemfdRegion) -> None:
    pool = SidecarKVPool(region)
    with pool:
        floats = torch.zeros(100, dtype=torch.float32)
        square = torch.zeros(10, 10, dtype=torch.int8)
        kv = torch.zeros((4096,), dtype=torch.int8)
    assert floats.data_ptr() != region.address and square.data_ptr() != region.address
    assert kv.data_ptr() == region.address and kv.numel() == 4096 and kv.dtype == torch.int8
    assert bool((kv == 0).all())


def test_too_small_a_reservation_names_both_sizes(region: MemfdRegion) -> None:
    with SidecarKVPool(region), pytest.raises(
            ReservationTooSmall, match=r"allocates 2097152 B of KV cache but the sidecar "
                                       r"reservation is 1048576 B.*kv-cache-memory-bytes"):
        torch.zeros(2 << 20, dtype=torch.int8)


def test_views_are_reserved_refs(region: MemfdRegion) -> None:
    pool = SidecarKVPool(region)
    with pytest.raises(RegionError, match="not allocated inside this pool"):
        pool.views([(0, 4096)])
    with pool:
        torch.zeros(1 << 20, dtype=torch.int8)
    views = pool.views([(0, 4096), (8192, 4096)])
    assert [v.ref() for v in views] == [ReservedRef(0, 4096), ReservedRef(8192, 4096)]
    assert views[1].address == region.address + 8192 and views[1].mem_type == "DRAM"
    views[1].numpy()[:] = 3
    assert region.numpy()[8192] == 3 and region.numpy()[8191] == 0


class _FakeGpuRegion:
    """A fake VRAM region (no GPU here): the pool only reads its kind, device
    and size before it would map it."""

    mem_type = "VRAM"
    nbytes = 1 << 20

    def __init__(self, index: int) -> None:
        from kvsidecar.ipc.regions import Device

        self.device = Device(index, f"GPU-{index:08d}")

    def torch(self) -> torch.Tensor:
        raise AssertionError("a refused allocation maps nothing")


def test_a_gpu_reservation_refuses_an_allocation_on_another_gpu() -> None:
    from kvsidecar.integrations.vllm.pool import ReservationOnAnotherGpu

    with SidecarKVPool(_FakeGpuRegion(0)), pytest.raises(  # type: ignore[arg-type]
            ReservationOnAnotherGpu, match=r"on cuda:1 but the sidecar reservation is on "
                                           r"cuda:0 \(GPU-00000000\).*sidecar_socket"):
        torch.zeros(4096, dtype=torch.int8, device="cuda:1")
