"""Bounds on what one engine's messages can make a real sidecar do: a refused
message is refused fast, with the limit named, and every other engine is still
served meanwhile."""

from __future__ import annotations

import contextlib
import os
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvsidecar.ipc.client import BadRequest, SidecarClient, SidecarError
from kvsidecar.ipc.layout import MAX_REGIONS, MAX_SEGMENTS_PER_GROUP
from kvsidecar.ipc.seqpacket import BlockingChannel
from kvsidecar.sim.cluster import SidecarProcess
from kvsidecar.sim.models import attn

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


def _peak_rss_mb(side: SidecarProcess) -> int:
    """The sidecar's peak resident memory so far (VmHWM), in MB."""
    assert side.proc is not None
    with open(f"/proc/{side.proc.pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kb // 1024


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
        peak = _peak_rss_mb(sidecar)
        bad.send({"op": "register", "id": 7, "v": 1, "engine_id": f"costly{segments}",
                  "tp_rank": 0, "layout": _one_byte_segments(segments, MAX_REGIONS,
                                                             overlap=True),
                  "mode": "allocate", "memory": "memfd"})
        assert other.call({"op": "ping", "id": 2, "v": 1})["op"] == "pong"
        reply = bad.recv()
        assert (reply["op"], reply["code"]) == ("error", "bad_request"), reply
        assert reply["message"].startswith("invalid layout: "), reply
        assert says in reply["message"], reply
        # Checked without a span per region: the old check took ~5 MB a segment
        # (300 MB for 63 segments, 1.5 GB for 301) at its peak.
        grew = _peak_rss_mb(sidecar) - peak
        assert grew < 100, f"the daemon's peak memory grew {grew} MB"
    finally:
        bad.close()
        other.close()


def test_a_hold_naming_a_page_twice_is_refused_and_grows_nothing(
        sidecar: SidecarProcess) -> None:
    """The audit's holds of 2,000,000 zeros (one 16-page layout) were each placed
    and kept ~17 MB until their timeout; a hold names each page once."""
    layout = attn(2)(1, 16)
    c = SidecarClient(sidecar.socket, timeout_s=60)
    try:
        c.register("holder", 0, layout, allocate=True)
        rss = []
        for i in range(8):
            with pytest.raises(BadRequest, match="held block id 0 named twice: a hold names "
                                                 "each page once"):
                c.hold("holder", f"dups{i}", [[0] * 2_000_000], timeout_s=3600)
            rss.append(_rss_kb(sidecar))
        # A decoded message's memory may stay with the allocator (reused by the
        # next ones), but the daemon no longer keeps each hold: before, the 7 holds
        # after the first grew it by 7 x 17 MB.
        assert rss[-1] - rss[0] < 40 << 10, rss
        assert c.hold("holder", "fine", [list(range(16))], timeout_s=60).token
        c.release("holder", "fine")
    finally:
        with contextlib.suppress(SidecarError):
            c.deregister("holder")
        c.close()


def _rss_kb(s: SidecarProcess) -> int:
    for line in Path(f"/proc/{s.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _fds_layout(regions: int) -> dict[str, Any]:
    return {"family": "x", "tp_size": 1, "num_regions": regions, "num_blocks": 1,
            "page_bytes": 4096, "groups": [{"kind": "mamba", "segments": [
                {"name": "s", "offset": 0, "nbytes_local": 4096, "units_total": 1}]}]}


def _refusals(s: SidecarProcess, limit: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    want = f'kvsidecar_limit_refusals_total{{engine="",limit="{limit}"}} '
    return sum(float(line[len(want):]) for line in text.splitlines()
               if line.startswith(want))


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_regions_past_the_fd_budget_are_refused_and_others_are_served(tmp_path: Path) -> None:
    """The audit's registration: 9,960 memfd regions of 4 KiB took 19,950 of the
    daemon's 20,000 fds (two per region), and other clients' connections failed
    (EMFILE). Here with 2,048 fds: at most (2048 - 256 - 512 - open) / 2 regions."""
    s = SidecarProcess(tmp_path, "fds", args=["--metrics-port", "0"],
                       launcher=["prlimit", "--nofile=2048:2048", "--"])
    s.start()
    hog, other = Raw(s.socket), Raw(s.socket)
    try:
        assert s.proc is not None
        reply = hog.call({"op": "register", "id": 1, "v": 1, "engine_id": "hog", "tp_rank": 0,
                          "layout": _fds_layout(1000), "mode": "allocate", "memory": "memfd"})
        assert (reply["op"], reply["code"]) == ("error", "unavailable"), reply
        assert reply["message"].startswith("1000 regions do not fit: this sidecar can map "), reply
        assert "of RLIMIT_NOFILE 2048 fds open, 2 per region, a quarter and 256 kept for " \
               "connections" in reply["message"], reply
        assert _refusals(s, "regions") == 1
        fds = len(os.listdir(f"/proc/{s.proc.pid}/fd"))
        assert fds < 200, fds  # nothing of the refused registration stays open
        # within the budget: registered, and every other client is still served
        reply = hog.call({"op": "register", "id": 2, "v": 1, "engine_id": "hog", "tp_rank": 0,
                          "layout": _fds_layout(400), "mode": "allocate", "memory": "memfd"})
        assert reply["op"] == "registered", reply
        c = SidecarClient(s.socket, timeout_s=60)
        try:
            c.register("victim", 0, attn(2)(1, 16), allocate=True)
            conns = [Raw(s.socket) for _ in range(50)]
            for i, conn in enumerate(conns):
                assert conn.call({"op": "ping", "id": i, "v": 1})["op"] == "pong"
                conn.close()
            c.deregister("victim")
        finally:
            c.close()
        assert other.call({"op": "ping", "id": 3, "v": 1})["op"] == "pong"
        assert "Too many open files" not in s.read_log()
    finally:
        hog.close()
        other.close()
        assert s.stop() == 0
