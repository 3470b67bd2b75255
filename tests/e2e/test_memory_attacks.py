"""An engine attacks the memory it shares with its sidecar (real sidecars, default flags).

Before: an engine that ``ftruncate``\\ d the memfd its sidecar allocated (or the
POSIX shm it registered in attach mode) and placed a hold killed the P sidecar
with SIGBUS as soon as a peer read those pages, taking every engine on it.
Now the sidecar seals every memfd it allocates against any size change, and
maps no POSIX shm unless ``--allow-unsealed-shm`` says every engine is trusted.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsidecar.ipc.client import BadRequest, SidecarClient
from kvsidecar.ipc.memfd import MemfdRegion
from kvsidecar.ipc.memory import ENGINE_SHM_PREFIX, allocate_for_layout
from kvsidecar.sim.cluster import SidecarProcess, SimEngine
from kvsidecar.sim.models import attn, hybrid
from kvsidecar.sim.oracle import Request

pytestmark = pytest.mark.e2e

UNSEALED = "cannot be sealed against truncation"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess,
                                                                      SidecarProcess]]:
    work = tmp_path_factory.mktemp("memattack")
    p = SidecarProcess(work, "ma-p", args=["--hold-timeout", "60"])
    d = SidecarProcess(work, "ma-d", args=["--read-timeout", "30"])
    try:
        p.start()
        d.start()
        yield p, d
    finally:
        codes = {s.name: s.stop() for s in (p, d)}
        assert codes == {"ma-p": 0, "ma-d": 0}, codes


def test_an_engine_cannot_shrink_or_grow_its_memfd_and_a_read_still_lands(pair) -> None:
    p, d = pair
    P = SimEngine("ma-P", hybrid, 1, 64, [p], memory="memfd")
    D = SimEngine("ma-D", hybrid, 1, 64, [d], timeout_s=60)
    try:
        sent = P.prefill("shrunk", Request(seed=3, prompt_tokens=90))  # filled, and held
        region = P.registrations[0].regions[0]
        assert isinstance(region, MemfdRegion)
        refused = []
        for size in (region.nbytes * 2, region.nbytes // 2, 0):  # ends shrunk to nothing
            try:
                os.ftruncate(region.fd, size)  # the attack: cut the pages under the sidecar
            except PermissionError:
                refused.append(size)
        D.start_read(sent)
        got = D.wait_for(["shrunk"], timeout_s=60)["shrunk"][0]
        assert p.alive() and d.alive(), p.read_log()[-3000:]
        assert got.kind == "received", got
        assert not D.verify("shrunk")
        assert refused == [region.nbytes * 2, region.nbytes // 2, 0]
        assert os.fstat(region.fd).st_size == region.nbytes
    finally:
        D.close()
        P.close()


def test_posix_shm_is_refused_by_default_in_every_mode(pair, tmp_path: Path) -> None:
    p, _ = pair
    layout = attn(2)(1, 8)
    mine = allocate_for_layout(layout, f"{ENGINE_SHM_PREFIX}ma-attach")
    try:
        with SidecarClient(p.socket, timeout_s=30) as c:
            with pytest.raises(BadRequest, match=UNSEALED):
                c.register("ma-attach", 0, layout, regions=mine)
            with pytest.raises(BadRequest, match=UNSEALED):
                c.register("ma-alloc", 0, layout, allocate=True, memory="shm")
            with pytest.raises(BadRequest, match=UNSEALED):
                c.reserve("ma-reserve", 1 << 20, "shm")
            assert c.ping().engines == []
            assert not [n for n in os.listdir("/dev/shm") if "ma-alloc" in n
                        or "ma-reserve" in n]
    finally:
        for r in mine:
            r.close()
            r.unlink()
    assert p.alive()
