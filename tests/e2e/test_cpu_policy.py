"""``--cpu-policy``: by default every thread of a real sidecar runs under
SCHED_BATCH (so none preempts the engine, or another sidecar thread, when it
wakes), including the threads it starts after start-up (an engine rank's NIXL
worker, ZMQ's I/O threads); ``normal`` leaves the kernel's default."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from kvsidecar.sim.cluster import SidecarProcess, engines
from kvsidecar.sim.models import attn
from kvsidecar.sim.oracle import Request

pytestmark = pytest.mark.e2e


def _policies(pid: int) -> dict[str, set[int]]:
    """Thread name -> the policies of the threads of that name."""
    out: dict[str, set[int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            out.setdefault(name, set()).add(os.sched_getscheduler(int(tid)))
    return out


@pytest.mark.parametrize(("flag", "policy"), [((), os.SCHED_BATCH),
                                              (("--cpu-policy", "normal"), os.SCHED_OTHER)])
def test_every_sidecar_thread_runs_under_the_policy(tmp_path: Path, flag: tuple[str, ...],
                                                    policy: int) -> None:
    p = SidecarProcess(tmp_path, "cpu-p", args=list(flag)).start()
    d = SidecarProcess(tmp_path, "cpu-d", args=list(flag)).start()
    try:
        with engines([p], [d], lambda side: f"cpu{side}", attn(2), 1, 1) as (P, (D,)):
            D.start_read(P.prefill("r", Request(seed=1, prompt_tokens=16)))
            assert D.wait_for(["r"])["r"][0].kind == "received"
            assert not D.verify("r")  # the oracle's bytes (LAYOUT.md §6)
            for side in (p, d):
                assert side.proc is not None
                seen = _policies(side.proc.pid)
                # the threads started for the engine and its read are there too
                assert any(name.startswith("kvs-nixl") for name in seen), seen
                assert any(name.startswith("ZMQbg/IO") for name in seen), seen
                assert set().union(*seen.values()) == {policy}, seen
    finally:
        assert d.stop() == 0
        assert p.stop() == 0
