"""benchmarks/gpu_e2e.py on a machine without a GPU: one clear line, status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_gpu import NO_GPU

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_e2e.py"


@pytest.mark.skipif(NO_GPU is None, reason="a GPU is present: the script would run for real")
def test_without_a_gpu_it_says_so_and_exits_2() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gpu_e2e: no CUDA GPU here (")
    assert lines[0].endswith("this benchmark needs one GPU (two for the cross-GPU case) and "
                             "the gpu extra: pip install -e '.[gpu]'")
