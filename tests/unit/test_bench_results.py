"""``make bench`` rewrites the generated table of benchmarks/RESULTS.md and
keeps the sections measured by hand below the mark."""

from __future__ import annotations

from pathlib import Path

from .bench_modules import run

ROOT = Path(__file__).resolve().parents[2]


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

