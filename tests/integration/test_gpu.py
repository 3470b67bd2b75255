"""The GPU path on a GPU, and what a GPU sidecar does without one.

Tests marked ``gpu`` need a CUDA device and the gpu extra; elsewhere they are
skipped and the reason is printed (``-ra``). No GPU was available where this
suite was written: those tests have never run (see docs/gpu.md).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvsidecar.ipc.cuda import CudaError


def _no_gpu_reason() -> str | None:
    try:
        from kvsidecar.ipc import cuda

        drv = cuda.driver()
        count = int(cuda.check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))
    except CudaError as e:
        return str(e)
    return None if count > 0 else "no CUDA GPU here: the driver sees 0 devices"


NO_GPU = _no_gpu_reason()


def _has_cuda_bindings() -> bool:
    """find_spec("cuda.bindings") raises, not answers None, when the parent
    package ``cuda`` is absent too (a clean CI venv), so ask by importing."""
    try:
        importlib.import_module("cuda.bindings")
    except ImportError:
        return False
    return True


@pytest.mark.skipif(NO_GPU is None, reason="a GPU is present: the sidecar would start")
def test_gpu_sidecar_without_a_gpu_exits_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "serve", "--device", "cuda:0", "--insecure-peers",
         "--transport-check", "off", "--socket", str(tmp_path / "run" / "cuda0.sock")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    if not _has_cuda_bindings():  # CI: the gpu extra is not installed
        assert last == ("kvsidecar: --device cuda:0: GPU regions need cuda-bindings: "
                        "pip install 'kvsidecar[gpu]'")
    else:  # the binding is installed, the driver is not
        assert last.startswith("kvsidecar: --device cuda:0: no CUDA driver here:"), last
    assert not (tmp_path / "run" / "cuda0.sock").exists()


#: Run in a fresh interpreter: map the sidecar's export, check every byte, write back.
CHILD = """
import sys, msgspec, torch
from kvsidecar.ipc.mapping import map_refs
from kvsidecar.ipc.protocol import RegionRef
ref = msgspec.msgpack.decode(bytes.fromhex(sys.argv[1]), type=RegionRef)
(region,) = map_refs([ref], sys.argv[2])
t = region.torch()
ok = bool(torch.all(t == int(sys.argv[3])).item())
t.fill_(int(sys.argv[3]) + 1)
torch.cuda.synchronize()
region.close()
print("ok" if ok else "bytes differ")
"""


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU is not None, reason=str(NO_GPU))
@pytest.mark.parametrize("kind", ["cuda_malloc", "cuda_vmm"])
def test_sidecar_allocation_is_shared_zero_copy(tmp_path: Path, kind: str) -> None:
    """The sidecar allocates and exports; another process maps it, sees the sidecar's
    bytes and writes into the same memory (legacy IPC handle or VMM fd over SCM_RIGHTS)."""
    import msgspec
    import torch

    from kvsidecar.daemon.cuda_device import CudaDevice
    from kvsidecar.daemon.engine_access import AccessPolicy
    from kvsidecar.daemon.fd_server import FdServer

    gpu = CudaDevice(0)
    gpu.open()
    (region,) = gpu.allocate(kind, 1, 3 << 20)
    t = region.torch()  # type: ignore[attr-defined]
    t.fill_(7)
    torch.cuda.synchronize()

    async def run() -> str:
        srv = FdServer(str(tmp_path / "s.fds"), AccessPolicy.own_uid())
        await srv.start()
        try:
            if kind == "cuda_vmm":
                region.share(srv.offer([region.fd], os.geteuid(), "test"), 0)  # type: ignore[attr-defined]
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-c", CHILD, msgspec.msgpack.encode(region.ref()).hex(),
                srv.path, "7", stdout=asyncio.subprocess.PIPE)
            out, _ = await child.communicate()
            return out.decode().strip()
        finally:
            await srv.stop()

    assert asyncio.run(run()) == "ok"
    assert bool(torch.all(t == 8).item())  # the child's write landed in the sidecar's memory
    region.close()

