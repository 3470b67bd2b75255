"""How much host memory an allocation may take before the kernel's OOM killer wakes.

Allocate mode reserves an engine's host regions at once (``posix_fallocate`` on
shared memory or a memfd), so that a full machine fails the registration rather
than a later page fault. A memfd has no size limit of its own (``/dev/shm`` at
least has its tmpfs size), so an engine asking for more than the machine has got
its pages until memory ran out, and the OOM killer then killed processes
(measured: one 16 TiB memfd request; five processes on the host were killed,
the sidecar among them). Here a request is refused when it is larger than what
the kernel says is available (``MemAvailable``, and the memory cgroup's limit
less its usage, where one is set), minus a headroom kept for everything else.

The cgroup's usage counts its page cache, which the kernel drops before any
OOM kill: its inactive file pages are taken as room (as the kubelet's working
set does). And the headroom is 1/16 of what this process may use (the cgroup's
limit where it is smaller than the machine): 1/16 of a large host's
``MemTotal`` was more than a container's whole limit (512 GiB host: 32 GiB kept
free, so a 32 GiB pod refused every allocation, however small).
The limit is the tightest of the process's memory cgroup and every ancestor
up to the root of the hierarchy (v2, and v1 where mounted): a limit set only
on a parent kills the process just the same (measured before: a 3 GiB
reservation under a 2 GiB parent limit passed, and the sidecar was
OOM-killed 0.8 s later).

Allocations under way count: :data:`LEDGER` checks and books each one under
one lock and keeps it booked until its pages are reserved (and so in the
kernel's figures). Before, four concurrent 0.9 GiB reservations in a 2 GiB
cgroup each saw the same room, all passed, and the sidecar was OOM-killed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["LEDGER", "HostMemoryError", "Ledger", "available_bytes", "headroom", "room_error"]

#: cgroup v1 reports "no limit" as a number near 2^63
_NO_LIMIT = 1 << 62


def _meminfo(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _read_int(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        text = path.read_text().strip()
        return None if text == "max" else int(text)
    return None


def _stat(path: Path, key: str) -> int:
    """One counter of a cgroup's ``memory.stat`` (0 if absent)."""
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


#: Per cgroup version: (limit file, usage file, memory.stat key of droppable page cache).
_FILES = {
    2: ("memory.max", "memory.current", "inactive_file"),
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


def _chain(path: str) -> list[str]:
    """``/a/b/c`` -> ``["a/b/c", "a/b", "a", ""]``: a cgroup and every ancestor,
    up to the root of its hierarchy (as this process sees it)."""
    parts = [p for p in path.split("/") if p]
    return ["/".join(parts[:n]) for n in range(len(parts), -1, -1)]


def _level_room(base: Path, version: int) -> tuple[int, int] | None:
    """(room, limit) of one cgroup directory, or None when it sets no readable limit."""
    limit_f, used_f, cache_key = _FILES[version]
    cap, now = _read_int(base / limit_f), _read_int(base / used_f)
    if cap is None or now is None or cap >= _NO_LIMIT:
        return None
    cache = _stat(base / "memory.stat", cache_key)
    return max(0, cap - max(0, now - cache)), cap


def _hierarchies(cgroup: Path, root: Path) -> list[tuple[int, Path, str]]:
    """(version, mount, path) of each memory hierarchy this process is in: the v1
    memory controller, and the v2 unified hierarchy (mounted at the root, or at
    ``unified/`` in the hybrid layout)."""
    out: list[tuple[int, Path, str]] = []
    with contextlib.suppress(OSError):
        for line in cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                for mount in (root, root / "unified"):
                    if (mount / "cgroup.controllers").exists() or (
                            mount / path.lstrip("/") / "memory.max").exists():
                        out.append((2, mount, path))
                        break
            elif "memory" in controllers.split(","):
                out.append((1, root / "memory", path))
    return out


def _cgroup_room(cgroup: Path, root: Path) -> tuple[int, int] | None:
    """(room, limit) of the tightest memory cgroup this process is under, or None
    when none sets a limit.

    Every level counts, not only the process's own cgroup: a limit set on a
    parent (a Kubernetes pod with an unlimited container, a systemd slice) kills
    the process just the same when the parent's usage reaches it. Each level's
    room is its limit less its usage, droppable page cache counted as room; v1
    also reports the effective limit of ancestors this process cannot see
    (``hierarchical_memory_limit``), taken against the leaf's usage."""
    best: tuple[int, int] | None = None

    def take(level: tuple[int, int] | None) -> None:
        nonlocal best
        if level is not None:
            best = level if best is None else (min(best[0], level[0]), min(best[1], level[1]))

    for version, mount, path in _hierarchies(cgroup, root):
        chain = _chain(path)
        for rel in chain:
            take(_level_room(mount / rel, version))
        if version == 1:
            leaf = mount / chain[0]
            hier = _stat(leaf / "memory.stat", "hierarchical_memory_limit")
            now = _read_int(leaf / "memory.usage_in_bytes")
            if 0 < hier < _NO_LIMIT and now is not None:
                cache = _stat(leaf / "memory.stat", "total_inactive_file")
                take((max(0, hier - max(0, now - cache)), hier))
    return best


def available_bytes(meminfo: Path = Path("/proc/meminfo"),
                    cgroup: Path = Path("/proc/self/cgroup"),
                    root: Path = Path("/sys/fs/cgroup")) -> tuple[int, int] | None:
    """(bytes available to a new allocation, the memory this process may use at
    most: ``MemTotal`` or its cgroup's limit), or None if unknown. The paths are
    the kernel's (parameters for tests)."""
    info = _meminfo(meminfo)
    if "MemAvailable" not in info or "MemTotal" not in info:
        return None
    room, total = info["MemAvailable"], info["MemTotal"]
    limited = _cgroup_room(cgroup, root)
    if limited is not None:
        room, total = min(room, limited[0]), min(total, limited[1])
    return room, total


def headroom(total: int) -> int:
    """Bytes kept free for everything else: 1/16 of what this process may use
    (``available_bytes``' second figure), at least 256 MiB."""
    return max(256 << 20, total // 16)


def room_error(nbytes: int, available: int, total: int, pending: int = 0) -> str:
    """Why ``nbytes`` of host memory may not be allocated now ('' when it may), with
    ``pending`` bytes of other allocations under way, not yet in ``available``."""
    keep = headroom(total)
    if nbytes <= available - pending - keep:
        return ""
    under_way = f", {pending} B being allocated already" if pending else ""
    return (f"{nbytes} B of host memory asked for, {available} B available on this host "
            f"(MemAvailable, or the tightest memory cgroup's room){under_way} and {keep} B "
            "kept free: allocating it would wake the kernel's OOM killer")


class HostMemoryError(MemoryError):
    """An allocation refused before anything was reserved (the message says why)."""


class Ledger:
    """Host memory booked by allocations under way in this process.

    :meth:`claim` checks a request against the room ``probe`` reports less what
    is booked already, and books it, under one lock, so concurrent allocations
    can never each see the same room; the booking ends when the ``with`` block
    does (the pages are then reserved and in the kernel's own figures, or the
    allocation failed).
    """

    def __init__(self, probe: Callable[[], tuple[int, int] | None] = lambda: available_bytes()
                 ) -> None:
        self._probe = probe
        self._lock = threading.Lock()
        self._pending = 0

    @property
    def pending(self) -> int:
        """Bytes booked now."""
        return self._pending

    @contextlib.contextmanager
    def claim(self, nbytes: int) -> Iterator[None]:
        """Book ``nbytes`` for the ``with`` block; HostMemoryError if there is no room."""
        with self._lock:
            room = self._probe()
            if room is not None:
                why = room_error(nbytes, room[0], room[1], self._pending)
                if why:
                    raise HostMemoryError(why)
            self._pending += nbytes
        try:
            yield
        finally:
            with self._lock:
                self._pending -= nbytes


#: The one ledger of this process's host allocations (memory_kinds books through it).
LEDGER = Ledger()
