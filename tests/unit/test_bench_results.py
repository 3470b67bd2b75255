"""``make bench`` rewrites the generated table of benchmarks/RESULTS.md and
keeps the sections measured by hand below the mark; the CPU bound its
sustained rows print."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import run
    import suite
finally:
    sys.path.remove(str(ROOT / "benchmarks"))


def test_hand_sections_survive_a_run() -> None:
    previous = f"# old table\n\n| a |\n\n{run.HAND_MARK}\n\n## By hand\n\nfigures\n"
    out = run.with_hand_sections("# new table\n\n| b |\n", previous)
    assert out.startswith("# new table\n\n| b |\n\n")
    assert "old table" not in out
    assert out.endswith(f"{run.HAND_MARK}\n\n## By hand\n\nfigures\n")


def test_without_a_mark_the_run_is_the_file() -> None:
    assert run.with_hand_sections("# new\n", "# old\n") == "# new\n"


def test_the_results_file_has_its_mark_before_the_hand_sections() -> None:
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert text.count(run.HAND_MARK) == 1
    assert text.index(run.HAND_MARK) < text.index("## Engine CPU per call")


def test_the_busy_note_gives_the_share_of_the_cores_and_the_rate_at_full_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    # 400 reads in 50 ms with 80 ms of CPU: 200 µs a read, 80 % of two
    # cores; with both busy the same CPU per read allows 10,000 reads/s
    note, cap = suite.busy_note(0.08, 0.05, 400)
    assert cap == pytest.approx(10_000)
    assert "ran 200 µs of CPU a read and kept 80% of the 2 cores busy" in note
    assert "with every core busy, 10,000 reads/s" in note
