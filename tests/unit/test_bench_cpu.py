"""The CPU bounds ``make bench`` prints beside the #31 targets: a timed
window's CPU across processes (:class:`suite.CpuWindow`) and what it
allows with every core busy (:func:`suite.busy_note`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from .bench_modules import suite


def test_the_busy_note_gives_the_share_of_the_cores_and_the_most_reads_they_allow() -> None:
    # 400 reads in 50 ms with 80 ms of CPU: 200 µs a read, 80 % of two
    # cores; even with both busy that CPU per read allows 10,000 reads/s
    note, cap = suite.busy_note(0.08, 0.05, 400, 2)
    assert cap == pytest.approx(10_000)
    assert "ran 200 µs of CPU a read and kept 80% of the 2 cores busy" in note
    assert "at most 10,000 reads/s" in note


def test_the_caller_note_splits_a_blocking_caller_s_time_into_its_calls_and_tails() -> None:
    # 4 calls of 100, 200, 300 and 400 µs (mean 250), 0.2 ms of tail over the
    # 4 reads (50 µs each): one read every 300 µs, 3,333 reads/s
    note = suite._caller_note([1e-4, 2e-4, 3e-4, 4e-4], 2e-4, 4, 2.9e-4)
    assert "p50 250 µs" in note and "mean 250 µs" in note
    assert "ran 290 µs of CPU a read" in note
    assert "took 50 µs a read more: 3,333 reads/s from this caller" in note


def test_a_window_counts_another_process_s_cpu_between_its_edges_only() -> None:
    # a child that spins until it has run 0.3 s of CPU (however loaded the
    # host), says so, then sleeps: a window around the spin holds that CPU
    # (and the child's start-up), a window around the sleep holds none
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, time\nwhile time.process_time() < 0.3: pass\n"
                              "print('spun', flush=True)\ntime.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        win = suite.CpuWindow(child.pid)
        win.start()
        assert child.stdout is not None
        assert child.stdout.readline() == "spun\n"
        spun = win.stop()
        win.start()
        time.sleep(0.2)
        slept = win.stop()
    finally:
        child.kill()
        child.wait()
    assert 0.25 < spun < 0.6  # less the few ms it ran before the window opened
    assert slept < 0.02
    assert win.total == pytest.approx(spun + slept)


def test_a_window_counts_this_process_s_own_cpu() -> None:
    win = suite.CpuWindow(os.getpid())  # counted twice: as "this process" and as a pid
    win.start()
    t = time.process_time()
    while time.process_time() - t < 0.1:
        pass
    spent = win.stop()
    assert 0.18 < spent < 0.3
