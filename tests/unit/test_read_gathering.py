"""D's read table gathers the reads one engine message accepts
(``ReadTable.together``) and starts them as a group when the message ends.
What it gathers belongs to the task handling that message: reads another
connection's task accepts meanwhile start at once, even if a handler of the
message suspended. The starts are recorded instead of run (no sidecar here);
the real batch path is covered end to end by tests/e2e/test_read_batch.py."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from kvsidecar.daemon.d_side.driver import POST_FIRST_BLOCKS
from kvsidecar.daemon.d_side.parts import SPLIT_MIN_BYTES
from kvsidecar.daemon.d_side.table import ReadTable, by_size, goes_alone
from kvsidecar.metrics.registry import Metrics


def _table() -> tuple[ReadTable, list[Any], list[list[Any]]]:
    table = ReadTable(ThreadPoolExecutor(1), None, 1.0,  # type: ignore[arg-type]
                      lambda eng, c: None, Metrics())
    alone: list[Any] = []
    groups: list[list[Any]] = []
    table._start_one = lambda eng, job: alone.append(job)  # type: ignore[method-assign]
    table._start = lambda gathered: groups.append(  # type: ignore[method-assign]
        [job for _, job in gathered])
    return table, alone, groups


async def test_a_message_gathers_only_its_own_reads_while_it_suspends() -> None:
    table, alone, groups = _table()
    inside = asyncio.Event()

    async def message() -> None:
        with table.together():
            table._route(None, "a")  # type: ignore[arg-type]
            inside.set()
            await asyncio.sleep(0.01)  # a handler that suspends
            table._route(None, "b")  # type: ignore[arg-type]

    async def another_connection() -> None:
        await inside.wait()
        table._route(None, "x")  # type: ignore[arg-type]
        assert alone == ["x"]  # started at once, not held for the other message

    await asyncio.gather(message(), another_connection())
    assert groups == [["a", "b"]]
    assert alone == ["x"]


async def test_nested_gathering_starts_once_at_the_outer_end() -> None:
    table, alone, groups = _table()
    with table.together():
        table._route(None, "a")  # type: ignore[arg-type]
        with table.together():
            table._route(None, "b")  # type: ignore[arg-type]
        assert groups == []
    assert groups == [["a", "b"]] and alone == []
    table._route(None, "c")  # type: ignore[arg-type]
    assert alone == ["c"]


async def test_a_read_a_task_created_inside_accepts_after_the_end_starts_at_once() -> None:
    """A task created inside together() copies its context, so it still sees the
    gathering after it ended: a read it accepts then must start (alone), not
    join the group already started, where it would never run."""
    table, alone, groups = _table()
    go = asyncio.Event()

    async def later() -> None:
        await go.wait()
        table._route(None, "late")  # type: ignore[arg-type]

    with table.together():
        table._route(None, "a")  # type: ignore[arg-type]
        task = asyncio.create_task(later())
    assert groups == [["a"]]
    go.set()
    await task
    assert alone == ["late"] and groups == [["a"]]


def test_over_lanes_a_large_read_starts_alone_a_small_one_joins() -> None:
    """Over several lanes a read of SPLIT_MIN_BYTES or more local bytes starts
    alone (it may then be cut into a part per lane), a smaller one joins its
    group; over one lane every unverified read joins; a verified read never."""
    layout = SimpleNamespace(page_bytes=1 << 20, num_regions=4)  # 4 MiB a block
    one = SimpleNamespace(lanes=[object()], layout=layout)
    two = SimpleNamespace(lanes=[object(), object()], layout=layout)

    def job(blocks: int, verify: object = None) -> Any:
        return SimpleNamespace(verify=verify, req=SimpleNamespace(
            local_block_ids=[list(range(blocks))]))

    assert SPLIT_MIN_BYTES == 16 << 20
    assert goes_alone(two, job(4)) and not goes_alone(two, job(3))
    assert not goes_alone(one, job(4)) and not goes_alone(one, job(100))
    assert goes_alone(one, job(1, verify=object()))


def test_small_reads_never_start_in_a_group_with_large_ones() -> None:
    """A burst's reads of at most POST_FIRST_BLOCKS blocks start apart from
    the larger ones (together if several), each kind in order: a 1-block read
    gathered with 64 16-block reads waited for all their claims and plans and
    their merged READ (benchmarks/tail_under_load.py)."""
    def job(blocks: int) -> Any:
        return SimpleNamespace(req=SimpleNamespace(local_block_ids=[list(range(blocks)), []]))

    small, small2, big, big2 = (job(1), job(POST_FIRST_BLOCKS), job(POST_FIRST_BLOCKS + 1),
                                job(16))
    assert by_size([big, small, big2, small2]) == [[small, small2], [big, big2]]
    assert by_size([big, big2]) == [[big, big2]]
    assert by_size([small, small2]) == [[small, small2]]
    assert by_size([]) == []
