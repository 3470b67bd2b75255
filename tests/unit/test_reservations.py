"""The reservation table (daemon/reservations.py): retries, duplicates, the
limit, per-uid visibility and expiry of reservations nobody registered."""

from __future__ import annotations

import pytest

from kvsidecar.daemon.reservations import Reservation, Reservations
from kvsidecar.ipc.memfd import MemfdRegion
from kvsidecar.ipc.protocol import RequestError


@pytest.fixture
def region():
    r = MemfdRegion.create("kvs-res", 4096)
    yield r
    r.close()


def test_table_rules(region: MemfdRegion) -> None:
    refused: list[str] = []
    t = Reservations(limit=2, on_limit=refused.append)
    assert t.check_room("a", 0, 4096, "memfd") is None
    t.add(Reservation("a", 0, "memfd", region))
    assert t.check_room("a", 0, 4096, "memfd") is t.of("a", 0)  # a retry
    with pytest.raises(RequestError, match="already has a reservation"):
        t.check_room("a", 0, 8192, "memfd")
    with pytest.raises(RequestError, match="already has a reservation"):
        t.check_room("a", 1000, 4096, "memfd")  # another user, same engine id
    assert t.of("a", 1000) is None  # not visible to another uid
    t.add(Reservation("b", 0, "memfd", region))
    with pytest.raises(RequestError, match="holds 2 reservations already"):
        t.check_room("c", 0, 4096, "memfd")
    assert refused == ["c"]  # counted (kvsidecar_limit_refusals_total{limit="reservations"})


def test_reservations_being_allocated_take_room(region: MemfdRegion) -> None:
    """Room is booked before the allocation is awaited (pipelined Reserves
    otherwise all found the same room) and given back on failure."""
    refused: list[str] = []
    t = Reservations(limit=2, on_limit=refused.append)
    assert t.check_room("a", 0, 4096, "memfd") is None
    t.book("a")
    assert t.check_room("b", 0, 4096, "memfd") is None
    t.book("b")
    with pytest.raises(RequestError, match=r"holds 2 reservations already \(the limit; 2 of "
                                           "them being allocated"):
        t.check_room("c", 0, 4096, "memfd")
    assert refused == ["c"]
    with pytest.raises(RequestError, match="is being reserved"):
        t.check_room("a", 0, 4096, "memfd")
    t.add(Reservation("a", 0, "memfd", region))  # allocated: held, no longer booked
    assert (len(t), t.booked) == (1, 1)
    t.unbook("b")  # its allocation failed
    assert (len(t), t.booked) == (1, 0)
    assert t.check_room("c", 0, 4096, "memfd") is None


def test_unregistered_reservations_go_stale(region: MemfdRegion) -> None:
    t = Reservations()
    t.add(Reservation("old", 0, "memfd", region, at=100.0))
    t.add(Reservation("registered", 0, "memfd", region, at=100.0))
    t.add(Reservation("young", 0, "memfd", region, at=125.0))
    assert t.stale(131.0, 30.0, {"registered"}) == ["old"]
