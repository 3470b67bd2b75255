"""The simulated engine's GPU writes (poison, pushes) are waited for on the GPU
they run on, not only on torch's current device (``torch.cuda.synchronize()``
without a device waits for the current device alone). A fake torch
``synchronize`` records what was waited for; the regions are CPU tensors
that say they are on GPU 1."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvsidecar.ipc.regions import Device
from kvsidecar.sim.cluster import SimEngine

torch = pytest.importorskip("torch")


class _FakeGpuRegion:
    """A region that claims to be VRAM on GPU ``index`` (its tensor is on the CPU)."""

    mem_type = "VRAM"

    def __init__(self, nbytes: int, index: int) -> None:
        self.device = Device(index, f"GPU-{index:08x}-0000-0000-0000-000000000000")
        self._t = torch.zeros(nbytes, dtype=torch.uint8)

    def torch(self) -> Any:
        return self._t


def _engine(pages: int, page_bytes: int, index: int) -> Any:
    eng: Any = SimEngine.__new__(SimEngine)
    eng.layout = SimpleNamespace(page_bytes=page_bytes)
    region = _FakeGpuRegion(pages * page_bytes, index)
    eng.registrations = [SimpleNamespace(regions=[region])]
    eng.buffers = [[np.zeros(pages * page_bytes, np.uint8)]]
    eng._free = []
    return eng


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    out: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: out.append(device))
    return out


def test_free_waits_for_the_poison_on_the_regions_gpu(synced: list[object]) -> None:
    eng = _engine(4, 64, index=1)
    eng.free([[2]])
    assert synced == [1]
    assert eng._free == [2]


def test_push_waits_on_the_regions_gpu(synced: list[object]) -> None:
    eng = _engine(4, 64, index=1)
    eng.buffers[0][0][:] = 7
    eng._push(0)
    assert synced == [1]
    assert int(eng.registrations[0].regions[0].torch()[0]) == 7
