"""The host-memory check against real memory cgroups and a real sidecar in them.

Before: four concurrent 0.9 GiB reservations in a 2 GiB cgroup each passed the
check and the sidecar was OOM-killed; with the limit on a parent cgroup only, a
3 GiB reservation passed (only the leaf was read) and the sidecar was killed.

These cgroups are real (cgroup v1's memory controller, which is where this
machine mounts it; as root). The v2 layout is covered with a fake tree in
tests/unit/test_host_memory.py: no v2 memory controller can be had here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsidecar.ipc.client import SidecarClient, SidecarError, Unavailable
from kvsidecar.sim.cluster import SidecarProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MiB = 1 << 20
V1 = Path("/sys/fs/cgroup/memory")


def _cgroup(rel: str, limit: int | None) -> Path:
    path = V1 / rel
    path.mkdir()
    if limit is not None:
        (path / "memory.limit_in_bytes").write_text(str(limit))
    return path


@pytest.fixture
def cgroups() -> Iterator[list[Path]]:
    """Made cgroups, removed after (children first)."""
    if os.geteuid() != 0 or not (V1 / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and cgroup v1's memory controller at /sys/fs/cgroup/memory")
    made: list[Path] = []
    yield made
    for path in reversed(made):
        try:
            path.rmdir()
        except OSError:  # pragma: no cover - a process left inside; say so
            print(f"could not remove {path}")


def _sidecar_in(leaf: Path, tmp_path: Path, name: str) -> SidecarProcess:
    """A sidecar that moves itself into ``leaf`` before it execs (so every page it
    allocates is charged there)."""
    move = f'echo $$ > {leaf}/cgroup.procs && exec "$@"'
    return SidecarProcess(tmp_path, name, launcher=["sh", "-c", move, "kvs-cgroup"]).start()


def test_concurrent_reservations_cannot_add_up_past_the_cgroup(cgroups, tmp_path: Path) -> None:
    tag = f"kvs-hm-{os.getpid()}"
    limit = 1536 * MiB
    cgroups.append(leaf := _cgroup(tag, limit))
    side = _sidecar_in(leaf, tmp_path, "hm-concurrent")
    each = 640 * MiB  # four of them: 2.5 GiB in a 1.5 GiB cgroup
    outcome: dict[int, str] = {}
    go = threading.Barrier(4)

    def reserve(i: int) -> None:
        with SidecarClient(side.socket, timeout_s=120) as c:
            go.wait()
            try:
                c.reserve(f"hm-{i}", each).close()
                outcome[i] = "granted"
            except Unavailable as e:
                outcome[i] = e.message
            except (SidecarError, OSError) as e:
                outcome[i] = f"other: {e!r}"

    try:
        threads = [threading.Thread(target=reserve, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert side.alive(), "the sidecar was killed (OOM?)\n" + side.read_log()[-2000:]
        granted = [i for i, o in outcome.items() if o == "granted"]
        refused = [o for o in outcome.values() if o != "granted"]
        assert len(outcome) == 4 and granted and refused, outcome
        assert len(granted) * each < limit, outcome
        assert all("OOM killer" in o for o in refused), refused
        with SidecarClient(side.socket, timeout_s=30) as c:
            assert c.ping().version >= 1
    finally:
        assert side.stop() == 0


def test_a_limit_on_the_parent_cgroup_only_is_honoured(cgroups, tmp_path: Path) -> None:
    tag = f"kvs-hm-parent-{os.getpid()}"
    cgroups.append(_cgroup(tag, 1536 * MiB))
    cgroups.append(leaf := _cgroup(f"{tag}/sidecar", None))  # no limit of its own
    side = _sidecar_in(leaf, tmp_path, "hm-parent")
    try:
        with SidecarClient(side.socket, timeout_s=120) as c:
            with pytest.raises(Unavailable, match="OOM killer"):
                c.reserve("hm-big", 2048 * MiB)
            c.reserve("hm-small", 128 * MiB).close()  # within the parent's room: granted
            c.deregister("hm-small")
            assert c.ping().version >= 1
        assert side.alive()
    finally:
        assert side.stop() == 0
