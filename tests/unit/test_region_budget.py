"""The region budget's arithmetic: fds (two per region, a quarter of the limit
and the reserve kept for connections) and memory maps, the tighter one named."""

from __future__ import annotations

from kvsidecar.daemon.conn_guard import FD_RESERVE
from kvsidecar.daemon.region_budget import (
    FDS_PER_REGION,
    MAP_RESERVE,
    Usage,
    regions_allowed,
    usage,
)


def test_fds_bound_the_regions_and_keep_a_quarter_for_connections() -> None:
    # the audit's daemon: RLIMIT_NOFILE 20000, 27 fds open; 9960 regions took 19,950 fds
    n, why = regions_allowed(Usage(fds_open=27, fd_limit=20000, maps_open=500,
                                   map_limit=65530))
    assert n == (20000 - FD_RESERVE - 5000 - 27) // FDS_PER_REGION == 7358
    assert n < 9960
    assert why == ("27 of RLIMIT_NOFILE 20000 fds open, 2 per region, a quarter and "
                   f"{FD_RESERVE} kept for connections")


def test_memory_maps_bound_the_regions_when_tighter() -> None:
    # fds plenty (systemd's 524288), maps at vm.max_map_count's default: 65,536
    # regions (MAX_REGIONS) would pass it
    n, why = regions_allowed(Usage(fds_open=100, fd_limit=524288, maps_open=900,
                                   map_limit=65530))
    assert n == 65530 - MAP_RESERVE - 900 < 1 << 16
    assert why == f"900 of vm.max_map_count 65530 memory maps in use, {MAP_RESERVE} kept free"


def test_nothing_left_is_zero_never_negative() -> None:
    n, _ = regions_allowed(Usage(fds_open=1000, fd_limit=1024, maps_open=0, map_limit=None))
    assert n == 0
    n, _ = regions_allowed(Usage(fds_open=0, fd_limit=None, maps_open=70000,
                                 map_limit=65530))
    assert n == 0


def test_no_limit_at_all() -> None:
    n, why = regions_allowed(Usage(fds_open=5, fd_limit=None, maps_open=5, map_limit=None))
    assert n > 1 << 16 and why == "no limit"


def test_usage_reads_this_process() -> None:
    u = usage()
    assert u.fds_open >= 3 and u.maps_open > 0
    assert u.fd_limit is None or u.fd_limit >= u.fds_open
