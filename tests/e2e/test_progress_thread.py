"""``--nixl-progress-thread-ms`` end to end: real P and D sidecar processes whose
agents run NIXL's UCX progress thread (woken by UCX events, not spinning), real
NIXL, every byte checked with the LAYOUT.md oracle, in both hetero-TP
directions; each engine rank's lane 0 runs one more thread than without the
flag, and a sidecar with the flag idles."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsidecar.sim.cluster import SidecarProcess, all_running, engines
from kvsidecar.sim.models import attn, hybrid

from ..unit.bench_modules import suite
from .test_lanes import _nixl_threads

pytestmark = pytest.mark.e2e

FLAG = ["--nixl-progress-thread-ms", "10", "--metrics-port", "0"]

_ids = itertools.count()


@pytest.fixture(scope="module")
def threaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[SidecarProcess]]]:
    """Two P and two D sidecars with the flag, and one P sidecar without it."""
    work = tmp_path_factory.mktemp("progress-thread")
    with all_running({
            "p": [SidecarProcess(work, f"tp{i}", args=["--hold-timeout", "60", *FLAG])
                  for i in range(2)],
            "d": [SidecarProcess(work, f"td{i}", args=FLAG) for i in range(2)],
            "plain": [SidecarProcess(work, "plain", args=["--hold-timeout", "60"])]}) as out:
        yield out


def _settled_threads(pid: int) -> int:
    """:func:`_nixl_threads` once it stayed the same for 0.5 s (an earlier test's
    engine rank may still be stopping its threads)."""
    deadline = time.monotonic() + 30
    last, since = _nixl_threads(pid), time.monotonic()
    while time.monotonic() - since < 0.5:
        assert time.monotonic() < deadline, "the NIXL thread count never settled"
        time.sleep(0.05)
        now = _nixl_threads(pid)
        if now != last:
            last, since = now, time.monotonic()
    return last


@pytest.mark.parametrize("family", ["hybrid", "attn-K2"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (1, 1)])
def test_reads_with_the_progress_thread_are_oracle_exact(
        threaded: dict[str, list[SidecarProcess]], family: str, p_tp: int, d_tp: int) -> None:
    """Every read received with the oracle's bytes, every hold ended ``sent``."""
    make = {"hybrid": hybrid, "attn-K2": attn(2)}[family]
    with engines(threaded["p"], threaded["d"], lambda x: f"pt{x}{next(_ids)}", make, p_tp,
                 d_tp) as (P, (D,)):
        rids = D.read_exactly(P, f"pt-{family}-{p_tp}{d_tp}", 40 + 3 * p_tp + d_tp)
        held = P.wait_for(rids)
        for rid in rids:
            assert sorted(held[rid]) == list(range(p_tp)), held[rid]
            assert {c.kind for c in held[rid].values()} == {"sent"}, held[rid]


def test_lane_zero_runs_nixls_progress_thread_and_idles(
        threaded: dict[str, list[SidecarProcess]], tmp_path: Path) -> None:
    """Registering an engine rank starts one more thread under the flag (NIXL's
    progress thread); a sidecar with the flag and an engine registered stays
    near idle (the thread sleeps in poll(), it does not spin a core)."""
    p, plain = threaded["p"][0], threaded["plain"][0]
    assert p.proc is not None and plain.proc is not None
    base, plain_base = _settled_threads(p.proc.pid), _settled_threads(plain.proc.pid)
    with engines([plain], threaded["d"], lambda x: f"ptp{x}{next(_ids)}", attn(2), 1, 1):
        plain_per_rank = _nixl_threads(plain.proc.pid) - plain_base
    with engines([p], threaded["d"], lambda x: f"ptt{x}{next(_ids)}", attn(2), 1, 1) as (P, (D,)):
        assert _nixl_threads(p.proc.pid) - base == plain_per_rank + 1
        D.read_exactly(P, "pt-idle", 70, tokens=(33,))
        time.sleep(0.5)
        before = suite.proc_cpu_s(p.proc.pid)
        time.sleep(3.0)
        used = suite.proc_cpu_s(p.proc.pid) - before
    # a spinning progress thread would use about 3 s of CPU here
    assert used < 0.5, f"{used:.2f} s of CPU in 3 s"
