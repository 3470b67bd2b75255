"""The staging pool with several lanes (``--post-lanes``): registered in every
lane's agent, and an area whose transfer's outcome is unknown comes back only
once the lane that carried it was reset (another lane's reset proves nothing
about a transfer it never carried)."""

from __future__ import annotations

import asyncio
import mmap
from typing import Any, cast

from kvsidecar.daemon.staging import StagingPool
from kvsidecar.daemon.transport.worker import NixlWorker


class FakeLane:
    """Named fake of a NixlWorker: what the pool uses (registration, generation)."""

    def __init__(self) -> None:
        self.generation = 0
        self.registered: list[list[tuple[int, int]]] = []
        self.deregistered: list[int] = []

    async def register(self, regions: list[tuple[int, int]], mem_type: str, dev_id: int) -> int:
        self.registered.append(regions)
        return len(self.registered)

    async def deregister(self, reg_id: int) -> None:
        self.deregistered.append(reg_id)


def test_pool_registers_in_every_lane_and_quarantine_follows_its_lane() -> None:
    async def main() -> None:
        lanes = [FakeLane(), FakeLane()]
        workers = cast(list[NixlWorker], lanes)
        pool = StagingPool(mmap.PAGESIZE, workers[0], lanes=workers)
        try:
            assert await pool.ensure()
            assert [len(x.registered) for x in lanes] == [1, 1]
            assert lanes[0].registered == lanes[1].registered
            area = pool.acquire(mmap.PAGESIZE)
            assert area is not None
            pool.quarantine(area, lanes[1].generation, 1)
            lanes[0].generation += 1  # lane 0 reset: lane 1's transfer may still write
            assert pool.acquire(mmap.PAGESIZE) is None
            assert pool.quarantined == mmap.PAGESIZE
            lanes[1].generation += 1  # its own lane reset: that transfer is dead
            again: Any = pool.acquire(mmap.PAGESIZE)
            assert again is not None and pool.quarantined == 0
        finally:
            pool.close()

    asyncio.run(main())


class FailingLane(FakeLane):
    """Named fake: a lane whose registration fails (as one past the memlock limit
    would); a real failure cannot be caused on demand in CI."""

    async def register(self, regions: list[tuple[int, int]], mem_type: str, dev_id: int) -> int:
        raise RuntimeError("registration refused")


def test_a_pool_that_fails_to_register_in_one_lane_is_deregistered_from_the_others() -> None:
    """Registered in lane 0, refused by lane 1: the pool is unavailable (reads post
    scattered) and lane 0's registration goes while the memory is still mapped;
    kept, it outlived the mapping, and lane 0's next reset would register the
    unmapped range again (the worker registers its registrations anew)."""
    async def main() -> None:
        lanes = [FakeLane(), FailingLane()]
        workers = cast(list[NixlWorker], lanes)
        pool = StagingPool(mmap.PAGESIZE, workers[0], lanes=workers)
        try:
            assert not await pool.ensure()
            assert pool.failed and pool.acquire(mmap.PAGESIZE) is None
            assert lanes[0].deregistered == [1]
        finally:
            pool.close()

    asyncio.run(main())
