"""Hostile-input fuzzing of both protocols against a real sidecar process.

Structure-aware (valid messages of every op with one field replaced by
arbitrary msgpack values, fields dropped or added), plus random bytes and
truncated valid frames. Every input must get exactly one reply (inputs stay
under the message size limit, so no connection is dropped); meanwhile a second,
well-behaved engine keeps being served, and the daemon's RSS, fds and threads
stay flat.

CI runs ``KVSIDECAR_FUZZ_EXAMPLES`` (default 1,000) inputs per protocol;
``make fuzz`` runs 100,000 per protocol and prints the figures.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar.daemon.peer_auth import load_keys
from kvsidecar.ipc.client import SidecarClient, UnknownEngine
from kvsidecar.ipc.seqpacket import BlockingChannel
from kvsidecar.sim.cluster import SidecarProcess, fleet_keys
from kvsidecar.sim.models import attn

# Starting a sidecar on a loaded 2-core machine can take minutes; so can the long form.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(int(os.environ.get(
    "KVSIDECAR_FUZZ_TIMEOUT", "1800")))]

EXAMPLES = int(os.environ.get("KVSIDECAR_FUZZ_EXAMPLES", "1000"))
TARGET = "fz-target"
GOOD = "well-behaved-engine-7f3c2a"
LAYOUT = attn(2)(1, 16)
_LAYOUT_MAP = msgspec.to_builtins(LAYOUT)

# Valid requests of every op, addressed to a registered engine so that
# validation runs deep; the remote address is a closed loopback port, never
# mutated (a mutated address could make the sidecar dial anywhere).
ENGINE_TEMPLATES: list[dict[str, Any]] = [
    {"op": "ping", "id": 1, "v": 1},
    {"op": "poll", "id": 2, "v": 1, "engine_id": TARGET, "ack": 0, "epoch": ""},
    {"op": "hold", "id": 3, "v": 1, "engine_id": TARGET, "request_id": "h", "block_ids": [[1, 2]],
     "readers": 1},
    {"op": "release", "id": 4, "v": 1, "engine_id": TARGET, "request_id": "h"},
    {"op": "read", "id": 5, "v": 1, "engine_id": TARGET, "request_id": "r",
     "local_block_ids": [[3]], "remote_block_ids": [[4]], "num_tokens": 8,
     "remote": {"engine_id": "p", "tp_size": 1, "handshake": ["127.0.0.1:1"]}},
    {"op": "register", "id": 6, "v": 1, "engine_id": "fz-new", "tp_rank": 0,
     "layout": _LAYOUT_MAP, "mode": "attach",
     "regions": [{"kind": "shm", "name": "kvsidecar-nonexistent", "nbytes": 4096}]},
    {"op": "deregister", "id": 7, "v": 1, "engine_id": "fz-unknown"},
]
#: Handshake requests and the control messages (claim, abandon; daemon/peers/
#: control.py) that share the peer channel. ``agent_name`` is filled in with
#: the target's real agent at start-up, so that mutated claims and abandons get
#: past the agent check into the hold book.
PEER_TEMPLATES: list[dict[str, Any]] = [
    {"engine_id": TARGET, "tp_rank": 0, "v": 1, "req_id": 1},
    {"engine_id": TARGET, "tp_rank": 0, "v": 1, "req_id": 2, "reader_engine": "fz-reader",
     "reader_rank": 0, "reader_agent": "fz-reader-agent"},
    {"op": "claim", "engine_id": TARGET, "tp_rank": 0, "agent_name": "", "request_id": "h",
     "reader_engine": "fz-reader", "reader_rank": 0, "reader_tp": 1, "req_id": 3, "v": 1},
    {"op": "abandon", "engine_id": TARGET, "tp_rank": 0, "agent_name": "", "request_id": "h",
     "reader_engine": "fz-reader", "reader_rank": 0, "reader_tp": 1, "reason": "fz",
     "req_id": 4, "v": 1},
]
#: A control batch (issue #12) of the claim and the abandon above, and of a
#: third item the fuzzer's values make out of anything.
PEER_TEMPLATES.append({"op": "batch", "items": [PEER_TEMPLATES[2], PEER_TEMPLATES[3]],
                       "req_id": 5, "v": 1})
FROZEN = {"remote", "op"}  # "op" is mutated by the op-name strategy instead
OPS = ["ping", "poll", "hold", "release", "read", "register", "deregister", "claim", "abandon",
       "batch"]


def _with_agent(template: dict[str, Any], agent: str) -> dict[str, Any]:
    """``template`` with its (and its batch items') ``agent_name`` set to ``agent``."""
    out = {**template, "agent_name": agent} if "agent_name" in template else dict(template)
    if "items" in out:
        out["items"] = [_with_agent(i, agent) for i in out["items"]]
    return out

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=40) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=5),
    max_leaves=20,
)


@st.composite
def mutated(draw: st.DrawFn, templates: list[dict[str, Any]]) -> bytes:
    msg = dict(draw(st.sampled_from(templates)))
    kind = draw(st.sampled_from(["replace", "drop", "add", "op"]))
    keys = [k for k in msg if k not in FROZEN]
    if kind == "replace" and keys:
        msg[draw(st.sampled_from(keys))] = draw(values)
    elif kind == "drop" and keys:
        del msg[draw(st.sampled_from(keys))]
    elif kind == "add":
        msg[draw(st.text(max_size=12))] = draw(values)
    elif "op" in msg:
        msg["op"] = draw(st.text(max_size=12) | st.sampled_from(OPS))
    return msgspec.msgpack.encode(msg)


@st.composite
def truncated(draw: st.DrawFn, templates: list[dict[str, Any]]) -> bytes:
    frame = msgspec.msgpack.encode(draw(st.sampled_from(templates)))
    return frame[: draw(st.integers(0, len(frame) - 1))]


def inputs(templates: list[dict[str, Any]]) -> st.SearchStrategy[bytes]:
    return st.one_of(mutated(templates), truncated(templates), st.binary(max_size=2048))


def _proc_stats(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_kb": int(fields["VmRSS"].split()[0]), "threads": int(fields["Threads"]),
            "fds": len(list(Path(f"/proc/{pid}/fd").iterdir()))}


@dataclass
class Target:
    side: SidecarProcess
    good: SidecarClient
    #: the fuzzed engine's own client: it keeps talking, so the target engine stays
    #: registered (an engine silent for --engine-lease is released) and mutated
    #: requests reach its hold book instead of 'unknown_engine'
    owner: SidecarClient
    sent: int = 0
    answered: int = 0
    checks: int = 0
    peer_checks: int = 0
    #: times a fuzzed request deregistered the target (an op mutated into
    #: 'deregister') and its owner registered it again
    reregistered: int = 0
    stats: list[dict[str, int]] = field(default_factory=list)
    #: a second fleet member's own connection to the handshake port, once opened
    good_peer: _Channel | None = None

    def pid(self) -> int:
        assert self.side.proc is not None
        return self.side.proc.pid

    def behave(self) -> None:
        """The well-behaved engine's turn: served, promptly enough to not time out."""
        assert self.good.ping().version == 1
        assert self.good.poll(GOOD) == []
        try:
            self.owner.poll(TARGET)  # whatever the fuzzed holds ended with; it must answer
        except UnknownEngine:  # a fuzzed 'deregister' of the target: register it again
            self.owner.register(TARGET, 0, LAYOUT, allocate=True)
            self.reregistered += 1
        self.checks += 1
        if self.good_peer is not None:
            self.behave_as_peer()

    def behave_as_peer(self) -> None:
        """Another fleet member on its own connection: its handshake is answered
        with the good engine's real info."""
        assert self.good_peer is not None
        reply = msgspec.msgpack.decode(self.good_peer.roundtrip(msgspec.msgpack.encode(
            {"engine_id": GOOD, "tp_rank": 0, "v": 1, "req_id": 7})))
        assert reply["type"] == "reply" and reply["req_id"] == 7, reply
        assert reply["info"]["engine_id"] == GOOD and reply["info"]["agent_metadata"]
        self.peer_checks += 1

    def agent_name(self, engine_id: str) -> str:
        assert self.good_peer is not None
        reply = msgspec.msgpack.decode(self.good_peer.roundtrip(msgspec.msgpack.encode(
            {"engine_id": engine_id, "tp_rank": 0, "v": 1, "req_id": 8})))
        name = reply["info"]["agent_name"]
        assert isinstance(name, str) and name
        return name


@pytest.fixture(autouse=True)
def sidecars_alive() -> Iterator[None]:
    """Overrides conftest's: the fuzz target is its own sidecar, so the shared pool
    (8 more sidecars) is not started for nothing; `make fuzz` runs only this module."""
    yield


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    side = SidecarProcess(tmp_path_factory.mktemp("fuzz"), "fz").start(timeout_s=600)
    good = SidecarClient(side.socket, timeout_s=60)
    good.register(GOOD, 0, LAYOUT, allocate=True)
    owner = SidecarClient(side.socket, timeout_s=60)
    owner.register(TARGET, 0, LAYOUT, allocate=True)
    t = Target(side, good, owner)
    try:
        yield t
    finally:
        good.close()
        owner.close()
        assert side.stop() == 0, side.read_log()


class _Channel:
    """A raw connection that sends one message and expects exactly one reply: a
    DEALER (CURVE) to the peer socket, or a bare Unix connection to the engine
    socket (``ipc://``)."""

    def __init__(self, endpoint: str, curve: bool) -> None:
        self.engine = (BlockingChannel(endpoint.removeprefix("ipc://"), timeout_s=30)
                       if endpoint.startswith("ipc://") else None)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        if self.engine is None:
            if curve:
                keys = load_keys(fleet_keys())
                self.sock.curve_publickey, self.sock.curve_secretkey = keys.public, keys.secret
                self.sock.curve_serverkey = keys.public
            self.sock.connect(endpoint)
        #: replies by type/code ("error:bad_message", "reply", "control", ...)
        self.kinds: dict[str, int] = {}

    def roundtrip(self, frame: bytes) -> bytes:
        if self.engine is not None:
            self.engine.send(frame)
            reply = self.engine.recv()
        else:
            self.sock.send(frame)
            assert self.sock.poll(30_000), f"no reply to {frame[:80]!r}"
            reply = self.sock.recv()
        msg = msgspec.msgpack.decode(reply)
        tag = msg.get("type", msg.get("op"))  # peer replies are tagged "type", engine ones "op"
        kind = f"{tag}:{msg['code']}" if tag == "error" else str(tag)
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        assert kind != "error:internal", (frame[:200], msg)
        return reply

    def close(self) -> None:
        if self.engine is not None:
            assert not self.engine.readable(0.5), "a second reply to some input"
            self.engine.close()
        else:
            assert self.sock.poll(500) == 0, "a second reply to some input"
        self.sock.close(0)
        self.ctx.term()


def _fuzz(target: Target, endpoint: str, curve: bool, templates: list[dict[str, Any]],
          label: str) -> None:
    if curve:  # the peer protocol: a second fleet member is served throughout too
        target.good_peer = _Channel(endpoint, curve)
        agent = target.agent_name(TARGET)
        templates = [_with_agent(t, agent) for t in templates]
    chan = _Channel(endpoint, curve)
    chan.roundtrip(msgspec.msgpack.encode(templates[0]))  # warm-up (connection, executors)
    for _ in range(50):
        chan.roundtrip(os.urandom(64))
    target.behave()
    before = _proc_stats(target.pid())
    count = {"n": 0}
    last = {"t": time.monotonic()}
    t0 = time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(inputs(templates))
    def one(frame: bytes) -> None:
        chan.roundtrip(frame)
        count["n"] += 1
        # Like a real engine, the well-behaved one talks at least every 2 s (an engine
        # silent for --engine-lease is taken for dead): every 250 inputs or 2 s.
        if count["n"] % 250 == 0 or time.monotonic() - last["t"] > 2.0:
            target.behave()
            last["t"] = time.monotonic()
        if count["n"] % 10_000 == 0:
            print(f"fuzz {label}: {count['n']} inputs, {time.monotonic() - t0:.0f} s, "
                  f"daemon {_proc_stats(target.pid())}, load {os.getloadavg()[0]:.1f}",
                  flush=True)

    one()
    chan.close()
    target.behave()
    if target.good_peer is not None:
        target.good_peer.close()
        target.good_peer = None
    time.sleep(1.0)
    after = _proc_stats(target.pid())
    print(f"\nfuzz {label}: {count['n']} inputs in {time.monotonic() - t0:.0f} s, all answered "
          f"once; well-behaved engine served {target.checks} times, well-behaved peer "
          f"{target.peer_checks} times, target re-registered {target.reregistered} times; "
          f"daemon before {before}, after {after}; "
          f"load average {os.getloadavg()}; replies {dict(sorted(chan.kinds.items()))}")
    assert target.side.alive()
    assert after["fds"] <= before["fds"] + 8, (before, after)
    assert after["threads"] <= before["threads"] + 4, (before, after)
    assert after["rss_kb"] <= before["rss_kb"] + 64 * 1024, (before, after)
    assert "Traceback" not in target.side.read_log()


def test_fuzz_engine_protocol(target: Target) -> None:
    _fuzz(target, f"ipc://{target.side.socket}", False, ENGINE_TEMPLATES, "engine IPC")


def test_fuzz_peer_protocol(target: Target) -> None:
    _fuzz(target, f"tcp://{target.side.handshake}", True, PEER_TEMPLATES, "peer handshake")
