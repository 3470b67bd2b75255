"""A sidecar process releases a reservation its engine never registered."""

from __future__ import annotations

import time
from pathlib import Path


def test_a_sidecar_releases_a_reservation_nobody_registered(tmp_path: Path) -> None:
    from kvsidecar.ipc.client import Duplicate, SidecarClient
    from kvsidecar.sim.cluster import SidecarProcess

    side = SidecarProcess(tmp_path, "lease", args=["--engine-lease", "1"]).start()
    c = SidecarClient(side.socket, timeout_s=30)
    try:
        first = c.reserve("ghost", 1 << 20)
        first.close()
        deadline = time.monotonic() + 60
        while True:  # the same id with another size is a duplicate until it is released
            try:
                again = c.reserve("ghost", 2 << 20)
                break
            except Duplicate:
                assert time.monotonic() < deadline, "the reservation was never released"
                time.sleep(0.2)
        assert again.nbytes == 2 << 20
        again.close()
        assert "did not register within --engine-lease" in side.read_log()
    finally:
        c.close()
        assert side.stop() == 0


def test_pipelined_reserves_get_exactly_the_limit(tmp_path: Path) -> None:
    """Reserves of distinct engine ids sent back to back on one connection: each
    allocation is awaited off the event loop, and the limit was checked only
    before it, so all 400 of an audit's were added (MAX_RESERVATIONS is 64).
    Exactly the limit succeed now; every other gets ``unavailable`` naming it,
    is counted, and after deregistering them the daemon's fds are back where
    they began."""
    import os

    import msgspec

    from kvsidecar.daemon.reservations import MAX_RESERVATIONS
    from kvsidecar.ipc.seqpacket import BlockingChannel
    from kvsidecar.sim.cluster import SidecarProcess

    side = SidecarProcess(tmp_path, "piped", args=["--metrics-port", "0"]).start()
    assert side.proc is not None
    fd_dir = f"/proc/{side.proc.pid}/fd"
    ch = BlockingChannel(side.socket, timeout_s=60)
    try:
        def call(msg: dict[str, object]) -> dict[str, object]:
            ch.send(msgspec.msgpack.encode(msg))
            return dict(msgspec.msgpack.decode(ch.recv()))

        assert call({"op": "ping", "id": 0, "v": 1})["op"] == "pong"
        fds_before = len(os.listdir(fd_dir))
        n = 3 * MAX_RESERVATIONS
        for i in range(n):
            ch.send(msgspec.msgpack.encode({"op": "reserve", "id": i + 1, "v": 1,
                                            "engine_id": f"piped{i}", "nbytes": 4096}))
        replies = [msgspec.msgpack.decode(ch.recv()) for _ in range(n)]
        reserved = [r for r in replies if r["op"] == "reserved"]
        refused = [r for r in replies if r["op"] == "error"]
        assert len(reserved) == MAX_RESERVATIONS
        assert len(refused) == n - MAX_RESERVATIONS
        for r in refused:
            assert r["code"] == "unavailable"
            assert f"holds {MAX_RESERVATIONS} reservations already (the limit" in r["message"]
        assert side.metric("kvsidecar_limit_refusals_total",
                           limit="reservations") == n - MAX_RESERVATIONS
        late = call({"op": "reserve", "id": n + 1, "v": 1, "engine_id": "late",
                     "nbytes": 4096})
        assert late["op"] == "error" and late["code"] == "unavailable"

        for k, r in enumerate(reserved):  # replies carry their request's id
            rep = call({"op": "deregister", "id": n + 2 + k, "v": 1,
                        "engine_id": f"piped{r['id'] - 1}"})
            assert rep["op"] == "ok", rep
        again = call({"op": "reserve", "id": 2 * n + 2, "v": 1, "engine_id": "after",
                      "nbytes": 4096})
        assert again["op"] == "reserved"  # the room is back
        assert call({"op": "deregister", "id": 2 * n + 3, "v": 1,
                     "engine_id": "after"})["op"] == "ok"
        deadline = time.monotonic() + 30
        while len(os.listdir(fd_dir)) > fds_before:  # memory is released off the loop
            assert time.monotonic() < deadline, (
                f"daemon fds {fds_before} -> {len(os.listdir(fd_dir))} after deregistering")
            time.sleep(0.1)
    finally:
        ch.close()
        assert side.stop() == 0
