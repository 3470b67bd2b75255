"""Host allocations past what the machine has are refused before anything is
reserved (daemon/host_memory.py): a 16 TiB memfd request once ran the host out
of memory and the OOM killer killed five processes."""

from __future__ import annotations

import contextlib
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

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
    ctx = MemoryContext(engine_id="too-big", shm_prefix="kvs-test-host-memory",
                        allow_unsealed_shm=True)
    with _file_size_limit(GiB), pytest.raises(RequestError) as e:
        memory_kinds.allocate(kind, 1, 1 << 44, ctx)  # 16 TiB
    assert e.value.code == UNAVAILABLE and "OOM killer" in e.value.message, e.value.message


def _fake_kernel(tmp_path: Path, version: int, limit: int, usage: int,
                 inactive_file: int) -> tuple[Path, Path, Path]:
    """FAKE /proc and /sys/fs/cgroup files: a 1 TiB host (900 GiB available) and a
    container with a memory limit, which CI cannot set up for real (no cgroup
    may be made or limited from a test). The file formats are the kernel's."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {(1 << 40) >> 10} kB\n"
                       f"MemFree:        {(800 * GiB) >> 10} kB\n"
                       f"MemAvailable:   {(900 * GiB) >> 10} kB\n")
    root = tmp_path / "sys-fs-cgroup"
    if version == 2:
        cgroup_text = "0::/kubepods/pod1/sidecar\n"
        base = root / "kubepods/pod1/sidecar"
        names = ("memory.max", "memory.current", "inactive_file")
    else:
        cgroup_text = "5:pids:/x\n4:memory:/kubepods/pod1/sidecar\n1:cpu:/x\n"
        base = root / "memory/kubepods/pod1/sidecar"
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    base.mkdir(parents=True)
    (base / names[0]).write_text(f"{limit}\n")
    (base / names[1]).write_text(f"{usage}\n")
    (base / "memory.stat").write_text(f"active_file 4096\n{names[2]} {inactive_file}\n")
    cgroup = tmp_path / "cgroup"
    cgroup.write_text(cgroup_text)
    return meminfo, cgroup, root


@pytest.mark.parametrize("version", [1, 2])
def test_a_container_on_a_large_host_may_allocate_within_its_limit(
        tmp_path: Path, version: int) -> None:
    """The headroom is a share of the container's limit, not of the host: 1/16 of
    a 1 TiB host is 64 GiB, more than the whole 32 GiB limit, and every
    allocation was refused. Page cache the kernel would drop (inactive file
    pages, counted in the cgroup's usage) is room too."""
    room = host_memory.available_bytes(*_fake_kernel(
        tmp_path, version, limit=32 * GiB, usage=20 * GiB, inactive_file=10 * GiB))
    assert room == (22 * GiB, 32 * GiB)
    assert host_memory.room_error(16 * GiB, *room) == ""
    assert host_memory.room_error(21 * GiB, *room) != ""  # 2 GiB kept free of 32


@pytest.mark.parametrize("version", [1, 2])
def test_a_container_without_a_limit_has_the_host(tmp_path: Path, version: int) -> None:
    limit = 9223372036854771712 if version == 1 else "max"
    meminfo, cgroup, root = _fake_kernel(tmp_path, version, limit=0, usage=GiB,
                                         inactive_file=0)
    for f in root.rglob("memory.max"):
        f.write_text(f"{limit}\n")
    for f in root.rglob("memory.limit_in_bytes"):
        f.write_text(f"{limit}\n")
    assert host_memory.available_bytes(meminfo, cgroup, root) == (900 * GiB, 1 << 40)


def _fake_chain(tmp_path: Path, version: int, levels: dict[str, tuple[int | str, int, int]],
                leaf: str) -> tuple[Path, Path, Path]:
    """A FAKE cgroup tree (the kernel's file formats) with a limit, usage and
    droppable cache per level, for the layouts this machine cannot build for
    real: v2 has no memory controller here (it is bound to v1). A 1 TiB host."""
    meminfo, _, root = _fake_kernel(tmp_path, version, limit=0, usage=0, inactive_file=0)
    names = (("memory.max", "memory.current", "inactive_file") if version == 2 else
             ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    mount = root if version == 2 else root / "memory"
    if version == 2:
        (root / "cgroup.controllers").write_text("cpu memory pids\n")
    for rel, (limit, usage, cache) in levels.items():
        base = mount / rel
        base.mkdir(parents=True, exist_ok=True)
        (base / names[0]).write_text(f"{limit}\n")
        (base / names[1]).write_text(f"{usage}\n")
        (base / "memory.stat").write_text(f"{names[2]} {cache}\n")
    cgroup = tmp_path / "cgroup"
    cgroup.write_text(f"0::/{leaf}\n" if version == 2 else f"4:memory:/{leaf}\n")
    return meminfo, cgroup, root


@pytest.mark.parametrize("version", [1, 2])
def test_a_limit_on_a_parent_cgroup_counts(tmp_path: Path, version: int) -> None:
    """The limit only on the pod (the container's own cgroup is unlimited): before,
    only the leaf was read and a 3 GiB allocation under a 2 GiB pod limit passed."""
    unlimited = "max" if version == 2 else 9223372036854771712
    paths = _fake_chain(tmp_path, version, {
        "": (unlimited, 10 * GiB, 0),  # the root
        "kubepods": (unlimited, 8 * GiB, 0),
        "kubepods/pod1": (2 * GiB, GiB, 0),
        "kubepods/pod1/sidecar": (unlimited, GiB, 0),
    }, "kubepods/pod1/sidecar")
    room = host_memory.available_bytes(*paths)
    assert room == (GiB, 2 * GiB)
    assert "OOM killer" in host_memory.room_error(3 * GiB, *room)


@pytest.mark.parametrize("version", [1, 2])
def test_the_tightest_level_of_the_chain_wins(tmp_path: Path, version: int) -> None:
    paths = _fake_chain(tmp_path, version, {
        "a": (64 * GiB, 60 * GiB, 2 * GiB),  # 6 GiB of room, the tightest
        "a/b": (16 * GiB, 4 * GiB, 0),  # 12 GiB of room, the smallest limit
        "a/b/c": (32 * GiB, 4 * GiB, 0),
    }, "a/b/c")
    assert host_memory.available_bytes(*paths) == (6 * GiB, 16 * GiB)


def test_v1_counts_ancestors_it_cannot_see(tmp_path: Path) -> None:
    """In a container the v1 mount's root is the container's own cgroup: the limit
    of a parent it cannot see is still in memory.stat (hierarchical_memory_limit)."""
    meminfo, cgroup, root = _fake_chain(tmp_path, 1, {
        "": (9223372036854771712, GiB, 0)}, "")
    (root / "memory" / "memory.stat").write_text(
        f"hierarchical_memory_limit {3 * GiB}\ntotal_inactive_file 0\n")
    assert host_memory.available_bytes(meminfo, cgroup, root) == (2 * GiB, 3 * GiB)


def test_allocations_under_way_are_booked() -> None:
    """Concurrent allocations each saw the same room: four 0.9 GiB reservations in
    a 2 GiB cgroup all passed. The ledger books each one until it is done."""
    ledger = host_memory.Ledger(lambda: (2 * GiB - (256 << 20), 2 * GiB))
    with ledger.claim(900 << 20):
        assert ledger.pending == 900 << 20
        with (pytest.raises(host_memory.HostMemoryError, match="being allocated already"),
              ledger.claim(900 << 20)):
            pass  # pragma: no cover - refused above
        with ledger.claim(500 << 20):
            assert ledger.pending == 1400 << 20
    assert ledger.pending == 0
    with ledger.claim(900 << 20):  # room again once the first is done
        pass
