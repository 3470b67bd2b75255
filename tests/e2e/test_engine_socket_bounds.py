"""Bounds on what one engine's messages can make a real sidecar do: a refused
message is refused fast, with the limit named, and every other engine is still
served meanwhile."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from kvsidecar.ipc.layout import MAX_REGIONS, MAX_SEGMENTS_PER_GROUP
from kvsidecar.ipc.seqpacket import BlockingChannel
from kvsidecar.sim.cluster import SidecarProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    s = SidecarProcess(tmp_path_factory.mktemp("bounds"), "bounds", args=["--metrics-port", "0"])
    try:
        s.start()
        yield s
    finally:
        assert s.stop() == 0


class Raw:
    """One engine connection speaking the protocol's plain maps."""

    def __init__(self, path: str) -> None:
        self.ch = BlockingChannel(path, timeout_s=120)

    def send(self, msg: dict[str, Any]) -> None:
        self.ch.send(msgspec.msgpack.encode(msg))

    def recv(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.msgpack.decode(self.ch.recv())
        return out

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.send(msg)
        return self.recv()

    def close(self) -> None:
        self.ch.close()


def _one_byte_segments(n: int, regions: int, *, overlap: bool) -> dict[str, Any]:
    segs = [{"name": f"s{i}", "offset": i, "nbytes_local": 1, "units_total": 1}
            for i in range(n)]
    if overlap:
        segs.append({"name": "dup", "offset": 0, "nbytes_local": 1, "units_total": 1})
    return {"family": "x", "tp_size": 1, "num_regions": regions, "num_blocks": 1,
            "page_bytes": n, "groups": [{"kind": "mamba", "segments": segs}]}


@pytest.mark.parametrize(("segments", "says"), [
    # the audit's message: 301 segments in 65536 regions took 5.7 s and 1.5 GB
    (300, f"301 segments exceed the limit ({MAX_SEGMENTS_PER_GROUP} per group)"),
    (MAX_SEGMENTS_PER_GROUP - 1, "segments overlap in region 0"),
])
def test_a_costly_layout_is_refused_at_once_and_others_are_served(
        sidecar: SidecarProcess, segments: int, says: str) -> None:
    other, bad = Raw(sidecar.socket), Raw(sidecar.socket)
    try:
        assert other.call({"op": "ping", "id": 1, "v": 1})["op"] == "pong"
        t0 = time.monotonic()
        bad.send({"op": "register", "id": 7, "v": 1, "engine_id": f"costly{segments}",
                  "tp_rank": 0, "layout": _one_byte_segments(segments, MAX_REGIONS,
                                                             overlap=True),
                  "mode": "allocate", "memory": "memfd"})
        t1 = time.monotonic()
        assert other.call({"op": "ping", "id": 2, "v": 1})["op"] == "pong"
        ping_s = time.monotonic() - t1
        reply = bad.recv()
        took = time.monotonic() - t0
        assert (reply["op"], reply["code"]) == ("error", "bad_request"), reply
        assert reply["message"].startswith("invalid layout: "), reply
        assert says in reply["message"], reply
        assert took < 1.0 and ping_s < 1.0, (took, ping_s)
    finally:
        bad.close()
        other.close()
