"""The benchmarks of ``make bench`` still run (tiny sizes, every benchmark once).

Performance is measured by ``make bench``, never asserted here: this test only
checks that every benchmark runs to the end against real sidecars and writes
its rows, so the benchmark code cannot rot unnoticed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.e2e


def test_every_benchmark_runs_in_smoke_mode(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import suite
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = tmp_path / "RESULTS.md"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--scale",
                          "smoke", "--out", str(out)], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    text = out.read_text()
    assert "failed in this run" not in text
    for name in suite.BENCHES:
        assert f"== {name} ..." in run.stdout
    for needle in ("load average", "commit:", "bulk", "hetero-TP 1→2", "hetero-TP 2→1",
                   "latency", "sustained", "engine CPU per `read`", "`hold`", "`poll`",
                   "start-up", "idle sidecar", "descriptors per request", "GPU figures"):
        assert needle in text, needle
