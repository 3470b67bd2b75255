"""The benchmarks' bare-NIXL baseline pair (sim/raw_nixl.py), real NIXL/UCX
across two processes: it reads the target's bytes, and whatever ends its
processes leaves neither shared memory in /dev/shm nor a target spinning.

Killed benchmark runs left their 125 MiB regions in /dev/shm (raw-<pid>-*):
a region is unlinked only when its process leaves its ``with`` block."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvsidecar.sim.raw_nixl import RawPair, RawReader

from ..unit.bench_modules import suite


def _named(pid: int) -> list[str]:
    if not os.path.isdir("/dev/shm"):
        return []
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"raw-{pid:x}-")]


def test_an_open_pair_reads_the_target_and_names_nothing_in_dev_shm() -> None:
    with RawPair(RawReader.span(65536, 4)) as pair:
        assert _named(os.getpid()) == [] and _named(pair._proc.pid) == []
        RawReader(pair, 65536, 4).once()
        got = pair.region.numpy()
        # every other 16 KiB slot was read (the target's memory is all 7s)
        assert (got[:16384] == 7).all() and (got[16384:32768] == 0).all()
        assert np.count_nonzero(got == 7) == 65536


def _wakeups_over(pid: int, seconds: float) -> int:
    """Voluntary context switches of every thread of ``pid`` in ``seconds``."""
    before = sum(suite.proc_threads_wakeups(pid).values())
    time.sleep(seconds)
    return sum(suite.proc_threads_wakeups(pid).values()) - before


def test_a_resting_target_stops_polling_and_serves_again_once_woken() -> None:
    with RawPair(RawReader.span(65536)) as pair:
        reader = RawReader(pair, 65536)
        reader.once()
        target = pair._proc.pid
        # awake it polls its worker every 100 us: thousands of wake-ups a second
        assert _wakeups_over(target, 0.5) > 200
        with pair.resting():
            assert _wakeups_over(target, 0.5) < 20  # blocked on the pipe
        pair.region.numpy()[:] = 0
        reader.once()  # its closing flush needs the target progressing again
        assert (pair.region.numpy()[:65536] == 7).all()


def test_a_spinning_target_refuses_to_rest() -> None:
    with (RawPair(65536, spin=True) as pair, pytest.raises(ValueError, match="does not rest"),
          pair.resting()):
        pass


_KILLED_WITH_A_PAIR = r"""
import os, signal, sys
from kvsidecar.sim.raw_nixl import RawPair
with RawPair(65536) as pair:
    with open(sys.argv[1], "w") as f:
        f.write(str(pair._proc.pid))
    os.kill(os.getpid(), signal.SIGKILL)  # no __exit__: as a benchmark killed mid-run
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not reaped
    except FileNotFoundError:
        return True


def test_an_initiator_killed_mid_run_leaves_no_memory_and_no_target(tmp_path: Path) -> None:
    # Output to files, not pipes: a target left running would hold a pipe open.
    pid_file, log = tmp_path / "target.pid", tmp_path / "out.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", _KILLED_WITH_A_PAIR, str(pid_file)],
                                stdout=out, stderr=subprocess.STDOUT)
        proc.wait(timeout=120)
    assert proc.returncode == -9, log.read_text()
    assert _named(proc.pid) == []
    target = int(pid_file.read_text())
    deadline = time.monotonic() + 60
    while not _gone(target) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _gone(target):
        os.kill(target, signal.SIGKILL)
        raise AssertionError("the target kept running after its initiator died")
    assert _named(target) == []
