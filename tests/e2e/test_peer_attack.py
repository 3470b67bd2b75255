"""The outsider's attack of issue #8, against real sidecars and a real NIXL agent.

With the handshake port open (``--insecure-peers``), a plain ZMQ client gets an
engine's NIXL metadata and region bases, and a bare NIXL agent built from that
reply reads the engine's KV bytes and writes its own into them: the positive
control, which proves the attack is real and this test can see it. With the
default (CURVE), the same client gets no reply at all (nothing to build an
agent from), and a client with another key neither; both attempts are logged.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from kvsidecar.daemon.peer_auth import generate_keys, load_keys
from kvsidecar.daemon.peers.messages import HandshakeInfo, HandshakeRequest
from kvsidecar.ipc.client import SidecarClient
from kvsidecar.ipc.memory import ShmRegion, unique_name
from kvsidecar.sim.cluster import SidecarProcess, fleet_keys
from kvsidecar.sim.models import attn
from kvsidecar.sim.raw_nixl import bare_agent

# Each test starts its own sidecars: minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

_reply = msgspec.msgpack.Decoder(dict[str, object])


def _ask(address: str, engine_id: str, keys: tuple[bytes, bytes, bytes] | None = None,
         wait_s: float = 5.0) -> bytes | None:
    """One handshake request as an outsider would send it; the raw reply or None."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
    sock.connect(f"tcp://{address}")
    try:
        sock.send(msgspec.msgpack.encode(HandshakeRequest(engine_id, 0)))
        return sock.recv() if sock.poll(int(wait_s * 1000)) else None
    finally:
        sock.close(0)
        ctx.term()


def _wait_for_log(side: SidecarProcess, text: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in side.read_log():
        assert time.monotonic() < deadline, f"{text!r} never logged:\n{side.read_log()}"
        time.sleep(0.1)


@pytest.fixture
def victim(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[SidecarProcess,
                                                                             ShmRegion]]:
    """A sidecar (insecure or default) with one registered engine whose KV is all 0x5a."""
    args = ["--insecure-peers"] if request.param == "insecure" else []
    side = SidecarProcess(tmp_path, "victim", args=args).start()
    layout = attn(2)(1, 16)
    c = SidecarClient(side.socket, timeout_s=30)
    reg = c.register("victim-engine", 0, layout, allocate=True)
    region = reg.regions[0]
    region.numpy()[:] = 0x5A
    try:
        yield side, region
    finally:
        for r in reg.regions:
            r.close()
        c.close()
        assert side.stop() == 0


@pytest.mark.parametrize("victim", ["insecure"], indirect=True)
def test_positive_control_an_open_port_gives_away_the_kv(
        victim: tuple[SidecarProcess, ShmRegion]) -> None:
    side, region = victim
    raw = _ask(side.handshake, "victim-engine")
    assert raw is not None
    info = msgspec.msgpack.Decoder(HandshakeInfo).decode(
        msgspec.msgpack.encode(_reply.decode(raw)["info"]))
    agent = bare_agent("thief")
    peer = agent.add_remote_agent(info.agent_metadata)
    n = 4096
    with ShmRegion.create(unique_name("thief"), n) as mine:
        descs = agent.get_reg_descs([(mine.address, n, 0, "")], "DRAM")
        agent.register_memory(descs)
        local = agent.get_xfer_descs([(mine.address, n, 0)], "DRAM")
        remote = agent.get_xfer_descs([(info.bases[0], n, 0)], "DRAM")
        for op in ("READ", "WRITE"):
            if op == "WRITE":
                assert np.all(mine.numpy() == 0x5A)  # the READ stole the engine's bytes
                mine.numpy()[:] = 0x66
            handle = agent.initialize_xfer(op, local, remote, peer, b"")
            state = agent.transfer(handle)
            deadline = time.monotonic() + 60
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
            assert state == "DONE"
        # ... and the WRITE overwrote them with its own.
        assert np.all(region.numpy()[:n] == 0x66)
        assert np.all(region.numpy()[n:] == 0x5A)
        agent.deregister_memory(descs)


@pytest.mark.parametrize("victim", ["default"], indirect=True)
def test_by_default_an_outsider_gets_nothing_to_build_an_agent_from(
        victim: tuple[SidecarProcess, ShmRegion], tmp_path: Path) -> None:
    side, region = victim
    assert _ask(side.handshake, "victim-engine") is None  # plain ZMQ: no reply at all
    _wait_for_log(side, "failed its handshake")
    generate_keys(tmp_path / "thief-keys")
    thief = load_keys(tmp_path / "thief-keys")
    fleet_public = load_keys(fleet_keys()).public  # public keys are not secrets
    assert _ask(side.handshake, "victim-engine", (thief.public, thief.secret, fleet_public)) \
        is None
    _wait_for_log(side, "peer channel: refused")
    # A fleet member (same keys as every sidecar this harness starts) is served.
    fleet = load_keys(fleet_keys())
    got = _ask(side.handshake, "victim-engine", (fleet.public, fleet.secret, fleet.public),
               wait_s=30)
    assert got is not None and _reply.decode(got)["type"] == "reply"
    assert np.all(region.numpy() == 0x5A)  # nobody wrote anything
