"""End to end: the links one engine rank keeps to remote ranks are bounded
(``--max-peer-links-per-engine``): idle ones are evicted first, and when
every link is held by a read in flight a new one is refused with a clear
error, counted."""

from __future__ import annotations

import socket
import time

import pytest

from kvsidecar.ipc.protocol import RemoteEngine
from kvsidecar.sim.cluster import SidecarProcess, SimEngine
from kvsidecar.sim.models import attn
from kvsidecar.sim.oracle import Request

pytestmark = pytest.mark.e2e



def test_peer_links_are_bounded_idle_ones_evicted_held_ones_refuse(pool, tmp_path) -> None:
    d = SidecarProcess(tmp_path, "links-d", args=[
        "--max-peer-links-per-engine", "2", "--handshake-timeout", "60",
        "--metrics-port", "0"]).start()
    A = SimEngine(pool.uid("A"), attn(8), 2, 96, pool.p[:2])
    B = SimEngine(pool.uid("B"), attn(8), 1, 96, pool.p[2:3])
    D = SimEngine(pool.uid("D"), attn(8), 1, 96, [d])
    C: SimEngine | None = None
    silent = socket.socket()  # accepts TCP connections, never speaks ZMQ
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        # Read X holds both links: A rank 0 (linked) and rank 1 (a handshake that
        # never answers, so X stays in flight).
        x = A.prefill("x", Request(seed=1, prompt_tokens=24), timeout_s=60)
        x.remote = RemoteEngine(x.remote.engine_id, 2,
                                [x.remote.handshake[0], f"127.0.0.1:{silent.getsockname()[1]}"])
        D.start_read(x)
        # Link A is made (a link still being made is never evicted: a read may wait for it).
        deadline = time.monotonic() + 60
        while d.metric("kvsidecar_handshakes_total", side="client", result="ok") < 1:
            assert time.monotonic() < deadline, "the link to A rank 0 was never made"
            time.sleep(0.01)
        # Read Y needs a third link: none is idle, so it is refused, naming the flag.
        D.start_read(B.prefill("y", Request(seed=2, prompt_tokens=24)))
        y = D.wait_for(["y"])["y"][0]
        assert y.kind == "failed" and "--max-peer-links-per-engine" in y.reason, y
        assert "PeerLinkLimit" in y.reason and "the limit is 2" in y.reason
        assert d.metric("kvsidecar_limit_refusals_total", engine=D.engine_id,
                       limit="peer_links") == 1
        D.finish("y")
        B.wait_for(["y"])  # its hold ended (the failed read abandoned it)
        # X ends (aborted): its links are idle now, and the next read evicts them.
        D.clients[0].release(D.engine_id, "x")
        assert D.wait_for(["x"])["x"][0].kind == "aborted"
        D.finish("x")
        A.clients[1].release(A.engine_id, "x")  # X's abandon for rank 1 went to the silent socket
        A.wait_for(["x"])
        # X's link to the silent socket, still being made, went with X (no other
        # read waited for it): Y2 finds room without evicting anything...
        D.start_read(B.prefill("y2", Request(seed=3, prompt_tokens=24)))
        got = D.wait_for(["y2"])["y2"][0]
        assert got.kind == "received", got
        assert D.verify("y2") == []
        assert d.metric("kvsidecar_peer_links_evicted_total", engine=D.engine_id) == 0
        # ...and a third remote rank evicts the least recently used idle link (A's).
        C = SimEngine(pool.uid("C"), attn(8), 1, 96, pool.p[3:4])
        D.start_read(C.prefill("z", Request(seed=4, prompt_tokens=24)))
        got = D.wait_for(["z"])["z"][0]
        assert got.kind == "received", got
        assert D.verify("z") == []
        assert d.metric("kvsidecar_peer_links_evicted_total", engine=D.engine_id) == 1
    finally:
        silent.close()
        for e in (D, B, A, C):
            if e is not None:
                e.close()
        assert d.stop() == 0
