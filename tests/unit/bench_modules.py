"""The benchmark modules of ``benchmarks/`` (scripts, not a package: they
import each other by plain name), for the unit tests of their pure parts."""

from __future__ import annotations

import sys
from pathlib import Path

_DIR = str(Path(__file__).resolve().parents[2] / "benchmarks")
sys.path.insert(0, _DIR)
try:
    import hop_timeline
    import run
    import suite
finally:
    sys.path.remove(_DIR)

__all__ = ["hop_timeline", "run", "suite"]
