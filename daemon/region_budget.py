"""How many more regions this sidecar can map: its fds and its memory maps.

A registered region holds file descriptors for its life (a memfd region two:
the memfd, which the fd socket passes to the engine, and the copy Python's
``mmap`` keeps) and at least one memory map (VMA). A layout may have 65,536
regions, so without a bound one engine could take nearly every fd of the
daemon (``RLIMIT_NOFILE``; then no connection can be accepted) or pass
``vm.max_map_count`` (65,530 by default; then every ``mmap`` fails, NIXL's
and the allocator's included).

A registration is refused when its regions, with those of the registrations
under way, would leave fewer than a quarter of the fd limit (plus the
:data:`~kvsidecar.daemon.conn_guard.FD_RESERVE`) free for connections, or
fewer than :data:`MAP_RESERVE` maps. What is open now is counted
(``/proc/self/fd``, ``/proc/self/maps``), not booked: nothing to give back
when an engine leaves, and every region of every kind counts alike.
:func:`regions_allowed` is the arithmetic, :func:`usage` reads the process.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

from kvsidecar.daemon.conn_guard import FD_RESERVE

__all__ = ["FDS_PER_REGION", "MAP_RESERVE", "Usage", "regions_allowed", "usage"]

#: fds one region holds (a memfd and mmap's copy of it; other kinds fewer)
FDS_PER_REGION = 2
#: memory maps kept free for everything else (thread stacks, the allocators, NIXL)
MAP_RESERVE = 4096
_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"


@dataclass(frozen=True)
class Usage:
    """What the process has and may have (None: no such limit)."""

    fds_open: int
    fd_limit: int | None
    maps_open: int
    map_limit: int | None


def regions_allowed(u: Usage) -> tuple[int, str]:
    """(regions that may still be mapped, the limit that sets it, in words)."""
    out: list[tuple[int, str]] = []
    if u.fd_limit is not None:
        room = u.fd_limit - FD_RESERVE - u.fd_limit // 4 - u.fds_open
        out.append((max(0, room // FDS_PER_REGION),
                    f"{u.fds_open} of RLIMIT_NOFILE {u.fd_limit} fds open, "
                    f"{FDS_PER_REGION} per region, a quarter and {FD_RESERVE} kept for "
                    "connections"))
    if u.map_limit is not None:
        room = u.map_limit - MAP_RESERVE - u.maps_open
        out.append((max(0, room),
                    f"{u.maps_open} of vm.max_map_count {u.map_limit} memory maps in use, "
                    f"{MAP_RESERVE} kept free"))
    return min(out, default=(1 << 62, "no limit"))


def usage() -> Usage:
    """This process's fds and memory maps now, and their limits."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        with open(_MAX_MAP_COUNT) as f:
            map_limit: int | None = int(f.read())
    except (OSError, ValueError):
        map_limit = None
    try:
        with open("/proc/self/maps", "rb") as f:
            maps = sum(1 for _ in f)
    except OSError:
        maps = 0
    return Usage(fds_open=len(os.listdir("/proc/self/fd")),
                 fd_limit=None if soft == resource.RLIM_INFINITY else soft,
                 maps_open=maps, map_limit=map_limit)
