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
Best effort: two allocations checked at the same moment may still add up past
it; ``--max-engines`` bounds how many.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["available_bytes", "headroom", "room_error"]

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


def _cgroup_room(cgroup: Path, root: Path) -> tuple[int, int] | None:
    """(the memory cgroup's limit less its usage, page cache it may drop counted as
    room; its limit), if a limit is set and readable."""
    with contextlib.suppress(OSError):
        for line in cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2
                base = root / path.lstrip("/")
                limit, used = base / "memory.max", base / "memory.current"
                cache = _stat(base / "memory.stat", "inactive_file")
            elif "memory" in controllers.split(","):  # v1
                base = root / "memory" / path.lstrip("/")
                limit, used = base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"
                cache = _stat(base / "memory.stat", "total_inactive_file")
            else:
                continue
            cap, now = _read_int(limit), _read_int(used)
            if cap is not None and now is not None and cap < _NO_LIMIT:
                return max(0, cap - max(0, now - cache)), cap
    return None


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


def room_error(nbytes: int, available: int, total: int) -> str:
    """Why ``nbytes`` of host memory may not be allocated now ('' when it may)."""
    keep = headroom(total)
    if nbytes <= available - keep:
        return ""
    return (f"{nbytes} B of host memory asked for, {available} B available on this host "
            f"(MemAvailable, or the memory cgroup's room) and {keep} B kept free: "
            "allocating it would wake the kernel's OOM killer")
