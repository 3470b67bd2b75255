"""Shared sidecar processes for the end-to-end tests.

Starting a sidecar costs a few seconds (NIXL and torch imports), so one pool
of real ``kvsidecar serve`` processes serves the whole session; each test
registers engines under fresh ids, which also exercises several engines per
daemon.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.sim.cluster import SidecarProcess, SimEngine, engines
from kvsidecar.sim.models import MakeLayout

N_P, N_D = 4, 4
SHM = ["--allow-unsealed-shm"]


class Pool:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        # --allow-unsealed-shm: the pool also serves the tests of POSIX shm (attach
        # mode, memory="shm"); sealed memfd, the default, is what most tests use.
        self.p = [SidecarProcess(workdir, f"p{i}", args=["--hold-timeout", "60", *SHM])
                  for i in range(N_P)]
        self.d = [SidecarProcess(workdir, f"d{i}", args=SHM) for i in range(N_D)]
        self._ids = itertools.count()

    def uid(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids)}"

    def engines(self, make: MakeLayout, p_tp: int, d_tp: int, **kw: Any
                ) -> AbstractContextManager[tuple[SimEngine, list[SimEngine]]]:
        """A fresh P engine on the P sidecars and D engine(s) on the D sidecars."""
        return engines(self.p, self.d, self.uid, make, p_tp, d_tp, **kw)

    @property
    def all(self) -> list[SidecarProcess]:
        return self.p + self.d


@pytest.fixture(scope="session")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    pool = Pool(tmp_path_factory.mktemp("sidecars"))
    try:
        for s in pool.all:
            s.start()
        yield pool
    finally:
        codes = {s.name: s.stop() for s in pool.all}
        bad = {k: v for k, v in codes.items() if v != 0}
        assert not bad, f"sidecars exited uncleanly: {bad}"
        for s in pool.all:
            assert not Path(s.socket).exists(), f"{s.name} left its socket behind"


@pytest.fixture(autouse=True)
def sidecars_alive(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test that used the shared pool: every pool sidecar still runs."""
    yield
    if "pool" not in request.fixturenames:
        return
    pool: Pool = request.getfixturevalue("pool")
    dead = [s.name for s in pool.all if not s.alive()]
    assert not dead, f"sidecars died during the test: {dead}: " + "".join(
        pool.all[[s.name for s in pool.all].index(n)].read_log() for n in dead)
