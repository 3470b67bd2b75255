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
Best effort: two allocations checked at the same moment may still add up past
it; ``--max-engines`` bounds how many.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["available_bytes", "headroom", "room_error"]

#: cgroup v1 reports "no limit" as a number near 2^63
_NO_LIMIT = 1 << 62


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
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


def _cgroup_room() -> int | None:
    """The memory cgroup's limit less its usage, if a limit is set and readable."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2
                base = Path("/sys/fs/cgroup") / path.lstrip("/")
                limit, used = base / "memory.max", base / "memory.current"
            elif "memory" in controllers.split(","):  # v1
                base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
                limit, used = base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"
            else:
                continue
            cap, now = _read_int(limit), _read_int(used)
            if cap is not None and now is not None and cap < _NO_LIMIT:
                return max(0, cap - now)
    return None


def available_bytes() -> tuple[int, int] | None:
    """(bytes available to a new allocation, MemTotal), or None if unknown."""
    info = _meminfo()
    if "MemAvailable" not in info or "MemTotal" not in info:
        return None
    room = info["MemAvailable"]
    cgroup = _cgroup_room()
    if cgroup is not None:
        room = min(room, cgroup)
    return room, info["MemTotal"]


def headroom(total: int) -> int:
    """Bytes kept free for everything else: 1/16 of the machine, at least 256 MiB."""
    return max(256 << 20, total // 16)


def room_error(nbytes: int, available: int, total: int) -> str:
    """Why ``nbytes`` of host memory may not be allocated now ('' when it may)."""
    keep = headroom(total)
    if nbytes <= available - keep:
        return ""
    return (f"{nbytes} B of host memory asked for, {available} B available on this host "
            f"(MemAvailable, or the memory cgroup's room) and {keep} B kept free: "
            "allocating it would wake the kernel's OOM killer")
