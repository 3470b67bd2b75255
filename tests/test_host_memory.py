"""Host allocations past what the machine has are refused before anything is
reserved (daemon/host_memory.py): a 16 TiB memfd request once ran the host out
of memory and the OOM killer killed five processes."""

from __future__ import annotations

import contextlib
import resource
import signal
from collections.abc import Iterator

import pytest

from kvsidecar.daemon import host_memory, memory_kinds
from kvsidecar.daemon.memory_kinds import MemoryContext
from kvsidecar.ipc.protocol import UNAVAILABLE, RequestError

GiB = 1 << 30


def test_room_error_keeps_a_headroom() -> None:
    total = 64 * GiB
    keep = host_memory.headroom(total)
    assert keep == 4 * GiB
    assert host_memory.room_error(10 * GiB, 20 * GiB, total) == ""
    assert host_memory.room_error(16 * GiB, 20 * GiB, total) == ""
    why = host_memory.room_error(16 * GiB + 1, 20 * GiB, total)
    assert "OOM killer" in why and str(20 * GiB) in why
    assert host_memory.headroom(GiB) == 256 << 20  # small machines keep 256 MiB


def test_this_host_reports_its_memory() -> None:
    room = host_memory.available_bytes()
    assert room is not None
    available, total = room
    assert 0 < available <= total


@contextlib.contextmanager
def _file_size_limit(nbytes: int) -> Iterator[None]:
    """Files (a memfd too) of this process may not grow past ``nbytes`` meanwhile:
    should the guard ever fail, the allocation below fails with EFBIG instead of
    taking the machine's memory."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize("kind", ["memfd", "shm"])
def test_a_host_allocation_past_the_machine_is_refused_before_reserving(kind: str) -> None:
    ctx = MemoryContext(engine_id="too-big", shm_prefix="kvs-test-host-memory")
    with _file_size_limit(GiB), pytest.raises(RequestError) as e:
        memory_kinds.allocate(kind, 1, 1 << 44, ctx)  # 16 TiB
    assert e.value.code == UNAVAILABLE and "OOM killer" in e.value.message, e.value.message
