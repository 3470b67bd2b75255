"""benchmarks/hop_timeline.py's table: each point's offset from the engine's
call, per read window, numbered when a point repeats in a window."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import hop_timeline
finally:
    sys.path.remove(str(ROOT / "benchmarks"))


def test_offsets_are_per_window_numbered_and_ordered_by_median() -> None:
    us = 1000
    marks = [(0, 500 * us), (1000 * us, 1600 * us)]
    events = [
        (300 * us, "claim granted (P loop)"),  # out of order on input
        (50 * us, "engine message in (D loop)"),
        (100 * us, "reply to the engine leaving (D loop)"),
        (400 * us, "reply to the engine leaving (D loop)"),
        (700 * us, "claim granted (P loop)"),  # between windows: no read's
        (1040 * us, "engine message in (D loop)"),
        (1120 * us, "reply to the engine leaving (D loop)"),
        (1350 * us, "claim granted (P loop)"),
        (1550 * us, "reply to the engine leaving (D loop)"),
    ]
    got, rare = hop_timeline.timeline(events, marks)
    rows = dict(got)
    assert rare == {}
    assert list(rows) == ["engine message in (D loop)", "reply to the engine leaving (D loop)",
                          "claim granted (P loop)", "reply to the engine leaving (D loop) #2",
                          "engine has the completion"]
    assert rows["engine message in (D loop)"] == [50e-6, 40e-6]
    assert rows["claim granted (P loop)"] == [300e-6, 350e-6]
    assert rows["reply to the engine leaving (D loop) #2"] == [400e-6, 550e-6]
    assert rows["engine has the completion"] == [500e-6, 600e-6]


def test_a_point_seen_in_fewer_than_half_the_reads_is_left_out_and_named() -> None:
    marks = [(0, 10), (20, 30), (40, 50)]
    got, rare = hop_timeline.timeline([(5, "rare (D loop)"), (25, "often (D loop)"),
                                       (45, "often (D loop)")], marks)
    assert [k for k, _ in got] == ["often (D loop)", "engine has the completion"]
    assert rare == {"rare (D loop)": 1}
