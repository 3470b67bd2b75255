"""The GPU path's driver calls, against a fake of ``cuda.bindings.driver``
(``fake_cuda_driver``): what each allocation, import and release calls, in
which order, and that a failure at any step gives back everything the steps
before it took. No GPU here; what only a GPU can show is in
``tests/integration/test_gpu.py`` and ``benchmarks/gpu_e2e.py``."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvsidecar.daemon.cuda_device import CudaDevice
from kvsidecar.ipc import cuda

from .fake_cuda_driver import CUresult, FakeCudaDriver

MIB = 1 << 20


@pytest.fixture
def drv(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudaDriver]:
    """The fake, as ``cuda.driver()`` returns it. Each test closes what it made
    (fds closed here after the fact could by then be numbers reused by others)."""
    fake = FakeCudaDriver()
    monkeypatch.setattr(cuda, "driver", lambda: fake)
    yield fake


def _gpu(drv: FakeCudaDriver) -> CudaDevice:
    gpu = CudaDevice(0)
    gpu.open()
    drv.calls.clear()
    return gpu


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_vmm_failure_after_mapping_gives_back_mapping_reservation_handle_and_fd(
        drv: FakeCudaDriver) -> None:
    """Zeroing fails once the allocation is mapped: the mapping and the address
    reservation go too, not only the handle and the exported fd."""
    gpu = _gpu(drv)
    drv.fail["cuMemsetD8"] = CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(cuda.CudaError, match="cuMemsetD8"):
        gpu.allocate("cuda_vmm", 1, 3 * MIB)
    assert drv.held() == cuda_nothing()
    assert not any(_fd_open(fd) for fd in drv.exported_fds)


def cuda_nothing() -> dict[str, object]:
    return {"allocs": {}, "handles": {}, "reserved": {}, "mapped": {}, "opened": {}}


@pytest.mark.parametrize("kind", ["cuda_malloc", "cuda_vmm"])
def test_zeroing_has_finished_before_the_memory_is_handed_out(drv: FakeCudaDriver,
                                                               kind: str) -> None:
    """``cuMemsetD8`` on device memory is asynchronous with respect to the host
    (CUDA driver API, "API synchronization behavior"): the allocation waits for
    it, so the engine never writes before a late memset, and an error of the
    memset itself fails the allocation (with nothing kept)."""
    gpu = _gpu(drv)
    (region,) = gpu.allocate(kind, 1, 3 * MIB)
    names = drv.names()
    assert "cuCtxSynchronize" in names[names.index("cuMemsetD8"):]
    region.close()
    assert drv.held() == cuda_nothing()

    drv.calls.clear()
    drv.fail["cuCtxSynchronize"] = CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(cuda.CudaError, match="cuCtxSynchronize"):
        gpu.allocate(kind, 1, 3 * MIB)
    assert drv.held() == cuda_nothing()
    assert not any(_fd_open(fd) for fd in drv.exported_fds)


def test_vmm_release_goes_on_past_a_failed_step_and_closes_the_fd(drv: FakeCudaDriver) -> None:
    """A failed ``cuMemUnmap`` at close still releases the handle (the driver
    frees the memory once the last mapping goes: releasing while mapped is
    allowed) and closes the exported fd; the first error is raised."""
    gpu = _gpu(drv)
    (region,) = gpu.allocate("cuda_vmm", 1, 3 * MIB)
    (fd,) = drv.exported_fds
    drv.fail["cuMemUnmap"] = CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(cuda.CudaError, match="cuMemUnmap"):
        region.close()
    assert "cuMemRelease" in drv.names()
    assert drv.handles == {}
    assert not _fd_open(fd)


def test_imported_vmm_release_goes_on_past_a_failed_step(drv: FakeCudaDriver) -> None:
    """The engine's side: a failed unmap still releases the imported handle."""
    from kvsidecar.ipc.protocol import CudaVmmRef

    fd = os.open(os.devnull, os.O_RDONLY)
    uuid = cuda.device_uuid(0)
    region = cuda.import_vmm(CudaVmmRef("0" * 32, 0, uuid, 3 * MIB, 4 * MIB), fd)
    assert not _fd_open(fd)  # closed once imported
    drv.fail["cuMemUnmap"] = CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(cuda.CudaError, match="cuMemUnmap"):
        region.close()
    assert drv.handles == {}


def test_raw_nixl_gpu_fill_has_finished_when_it_returns(drv: FakeCudaDriver) -> None:
    """The raw-NIXL baseline's target fills its GPU buffer, then serves READs of it
    from other streams (UCX's): the fill must be done, not only queued."""
    from kvsidecar.sim.raw_nixl import _GpuBuffer

    buf = _GpuBuffer(MIB, 0)
    drv.calls.clear()
    buf.fill(7)
    assert drv.names() == ["cuMemsetD8", "cuCtxSynchronize"]
    buf.close()
    assert drv.held() == cuda_nothing()


def test_vram_self_check_buffers_are_ready_before_nixl_reads_them(
        drv: FakeCudaDriver) -> None:
    """The start-up VRAM check copies its source from pageable host memory (the
    DMA may still run when ``cuMemcpyHtoD`` returns) and zeroes its destination
    (``cuMemsetD8``: asynchronous); NIXL's READ runs on UCX's streams, unordered
    with both, so the buffers are waited for before the READ."""
    from kvsidecar.daemon.transport.check import _Buffers

    _Buffers(1 << 16, 0)
    names = drv.names()
    last_write = max(names.index("cuMemcpyHtoD"), names.index("cuMemsetD8"))
    assert "cuCtxSynchronize" in names[last_write:]


def test_the_engines_side_leaves_its_threads_context_as_it_found_it() -> None:
    """Importing, opening and closing a region make its GPU's context current only
    while they run: an engine thread of GPU 1 (torch follows the current context)
    still has GPU 1's current after mapping and unmapping a region of GPU 0, and a
    thread with none has none again."""
    from kvsidecar.ipc.protocol import CudaIpcRef, CudaVmmRef

    drv = FakeCudaDriver(devices=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuda, "driver", lambda: drv)
        uuid0 = cuda.device_uuid(0)
        for before in (1, None):
            drv.current = before
            vmm = cuda.import_vmm(CudaVmmRef("0" * 32, 0, uuid0, 3 * MIB, 4 * MIB),
                                  os.open(os.devnull, os.O_RDONLY))
            assert drv.current == before
            vmm.close()
            assert drv.current == before
            ipc = cuda.open_ipc(CudaIpcRef(bytes(range(1, 65)), uuid0, MIB))
            assert drv.current == before
            ipc.close()
            assert drv.current == before
        assert drv.held() == cuda_nothing()


def test_a_close_whose_context_could_not_be_set_can_be_retried(drv: FakeCudaDriver) -> None:
    """The release is kept until it runs: a close that could not make the GPU's
    context current frees nothing and leaves it for the next close."""
    from kvsidecar.ipc.protocol import CudaVmmRef

    region = cuda.import_vmm(CudaVmmRef("0" * 32, 0, cuda.device_uuid(0), 3 * MIB, 4 * MIB),
                             os.open(os.devnull, os.O_RDONLY))
    drv.fail["cuCtxSetCurrent"] = CUresult.CUDA_ERROR_INVALID_CONTEXT
    with pytest.raises(cuda.CudaError, match="cuCtxSetCurrent"):
        region.close()
    assert drv.handles  # nothing released
    del drv.fail["cuCtxSetCurrent"]
    region.close()
    assert drv.held() == cuda_nothing()
