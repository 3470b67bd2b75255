"""The benchmarks of ``make bench`` still run (tiny sizes, every benchmark once).

Performance is measured by ``make bench``, never asserted here: this test only
checks that every benchmark runs to the end against real sidecars and writes
its rows, so the benchmark code cannot rot unnoticed. It starts five sidecars
and about ten bare-NIXL processes, so it is marked slow (a minute on a quiet
2-core machine, several under heavy load).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.timeout(1800)
def test_every_benchmark_runs_in_smoke_mode(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import suite
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = tmp_path / "RESULTS.md"
    # Its own session, so that whatever happens here its sidecars go with it.
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--scale",
                             "smoke", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=1700)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stdout[-4000:] + stderr[-4000:]
    text = out.read_text()
    assert "failed in this run" not in text
    for name in suite.BENCHES:
        assert f"== {name} ..." in stdout
    for needle in ("load average", "commit:", "bulk", "byte verification", "hetero-TP 1→2",
                   "hetero-TP 2→1", "latency", "sustained", "engine CPU per `read`", "`hold`",
                   "`poll`",
                   "start-up", "idle sidecar", "descriptors per request", "descriptor economy",
                   "GPU figures", "hop by hop on one clock",
                   # the CPU bounds quoted where a target is not met
                   "CPU inside the reads' windows", "with every core busy",
                   # the hop floors a read's messages meet, after the rest of its cycle
                   "after 2 ms idle"):
        assert needle in text, needle
    # every point of the hop timeline still names a daemon function
    assert "points not found in this daemon" not in text
