"""benchmarks/hop_timeline.py's table: each point's offset from the engine's
call, per read window, numbered when a point repeats in a window."""

from __future__ import annotations

from .bench_modules import hop_timeline


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



def test_the_window_cpu_note_gives_the_share_of_the_cores_and_the_floor_it_sets() -> None:
    # per read, CPU / wall / cores: 0.6, 0.4, 0.875 of two cores (a median of
    # the ratios, not a ratio of the medians: that would be 0.55); no read
    # costing 1.2 ms of CPU ends in under 0.6 ms on two cores
    note = hop_timeline.window_cpu_note([1.2e-3, 1.0e-3, 1.4e-3],
                                        [1.0e-3, 1.25e-3, 0.8e-3], 2)
    assert "median 1,200 µs a read, keeping 60% of the 2 cores busy" in note
    assert "(p10 44%, p90 82%)" in note
    assert "takes 600 µs, a lower bound on the p50" in note
