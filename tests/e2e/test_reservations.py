"""A sidecar process releases a reservation its engine never registered."""

from __future__ import annotations

import time
from pathlib import Path


def test_a_sidecar_releases_a_reservation_nobody_registered(tmp_path: Path) -> None:
    from kvsidecar.ipc.client import Duplicate, SidecarClient
    from kvsidecar.sim.cluster import SidecarProcess

    side = SidecarProcess(tmp_path, "lease", args=["--engine-lease", "1"]).start()
    c = SidecarClient(side.socket, timeout_s=30)
    try:
        first = c.reserve("ghost", 1 << 20)
        first.close()
        deadline = time.monotonic() + 60
        while True:  # the same id with another size is a duplicate until it is released
            try:
                again = c.reserve("ghost", 2 << 20)
                break
            except Duplicate:
                assert time.monotonic() < deadline, "the reservation was never released"
                time.sleep(0.2)
        assert again.nbytes == 2 << 20
        again.close()
        assert "did not register within --engine-lease" in side.read_log()
    finally:
        c.close()
        assert side.stop() == 0
