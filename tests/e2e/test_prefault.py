"""A sidecar maps every page of the host memory it allocated for an engine right
after the engine registers (daemon/prefault.py), so no read pays a page fault per
4 KiB on its first touch of a block: seen from outside, the sidecar's resident
shared memory covers the regions before any read. (Attached memory, where only
pages that already hold data are mapped: tests/unit/test_prefault.py.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvsidecar.sim.cluster import SidecarProcess, SimEngine
from kvsidecar.sim.models import attn

pytestmark = pytest.mark.e2e


def _rss_shmem(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/<pid>/status")


def test_engine_regions_are_resident_in_the_sidecar_before_any_read(tmp_path: Path) -> None:
    s = SidecarProcess(tmp_path, "pf").start()
    assert s.proc is not None
    try:
        before = _rss_shmem(s.proc.pid)
        E = SimEngine("pf", attn(8), 1, 4096, [s])
        try:
            need = E.layout.num_regions * E.layout.region_bytes
            assert need >= 16 << 20  # big enough to tell from the sidecar's own pages
            deadline = time.monotonic() + 60
            while _rss_shmem(s.proc.pid) - before < need:
                assert time.monotonic() < deadline, (
                    f"{_rss_shmem(s.proc.pid) - before} of {need} B resident")
                time.sleep(0.05)
        finally:
            E.close()
    finally:
        assert s.stop() == 0
