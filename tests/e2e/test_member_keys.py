"""Member identity on the peer channel: one fleet member cannot end, pin or
poison another's holds.

Real sidecars (P and D, each with its own CURVE keypair, every member's public
key admitted) and a third admitted member M, the attacker: a raw ZMQ client
with M's own key, so it passes CURVE and speaks the real control protocol.
With one shared fleet key M was every member at once: its forged abandon
ended D's hold, its renewals pinned a 3 s hold until it stopped, its early
claims filled the table and refused D's real one, and its re-declaration of
D's reader agent made P reject D's real notification. Here each is refused
(or ignored) and D's read ends as it should: ``received`` on D, ``sent`` on P.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvsidecar.daemon.peer_auth import generate_keys, load_keys
from kvsidecar.daemon.peers import control
from kvsidecar.daemon.peers.messages import HandshakeRequest
from kvsidecar.sim.cluster import SidecarProcess, SimEngine, member_keys
from kvsidecar.sim.models import attn
from kvsidecar.sim.oracle import Request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

_reply = msgspec.msgpack.Decoder(dict[str, Any])


class Member:
    """A fleet member's raw peer-channel client (its own admitted key)."""

    def __init__(self, keys_dir: str, server_keys_dir: str, address: str) -> None:
        mine, server = load_keys(keys_dir), load_keys(server_keys_dir)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.curve_publickey, self.sock.curve_secretkey = mine.public, mine.secret
        self.sock.curve_serverkey = server.public
        self.sock.connect(f"tcp://{address}")

    def ask(self, msg: Any, wait_s: float = 10.0) -> dict[str, Any] | None:
        self.sock.send(msgspec.msgpack.encode(msg))
        return _reply.decode(self.sock.recv()) if self.sock.poll(int(wait_s * 1000)) else None

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[SidecarProcess, SidecarProcess, dict[str, str]]]:
    work = tmp_path_factory.mktemp("members")
    keys = member_keys(work, ["p", "d", "m"])
    p = SidecarProcess(work, "p", args=["--peer-keys", keys["p"], "--hold-timeout", "60"])
    d = SidecarProcess(work, "d", args=["--peer-keys", keys["d"]])
    try:
        p.start()
        d.start()
        yield p, d, keys
    finally:
        d.stop()
        p.stop()


@pytest.fixture
def engines(fleet: tuple[SidecarProcess, SidecarProcess, dict[str, str]],
            request: pytest.FixtureRequest) -> Iterator[tuple[SimEngine, SimEngine, Member]]:
    p, d, keys = fleet
    name = request.node.name[5:30]
    P = SimEngine(f"P-{name}", attn(2), 1, 64, [p])
    D = SimEngine(f"D-{name}", attn(2), 1, 64, [d])
    m = Member(keys["m"], keys["p"], p.handshake)
    try:
        yield P, D, m
    finally:
        m.close()
        D.close()
        P.close()


def _claim(P: SimEngine, D: SimEngine, rid: str, op: str = "claim", **kw: Any) -> Any:
    cls = control.Claim if op == "claim" else control.Abandon
    return cls(engine_id=P.engine_id, tp_rank=0, agent_name=P.registrations[0].agent_name,
               request_id=rid, reader_engine=D.engine_id, reader_rank=0, reader_tp=1, **kw)


def _hold_end(P: SimEngine, rid: str, timeout_s: float = 60.0) -> tuple[str, float]:
    """The kind of ``rid``'s hold completion on P, and when it came (monotonic)."""
    got = P.wait_for([rid], timeout_s=timeout_s)
    return got[rid][0].kind, time.monotonic()


def _read(P: SimEngine, D: SimEngine, sent: Any) -> None:
    D.start_read(sent)
    got = D.wait_for([sent.request_id])
    assert [c.kind for c in got[sent.request_id].values()] == ["received"], got
    assert not D.verify(sent.request_id)
    D.finish(sent.request_id)


def test_a_forged_abandon_ends_nothing(engines: tuple[SimEngine, SimEngine, Member]) -> None:
    P, D, m = engines
    sent = P.prefill("r1", Request(seed=1, prompt_tokens=40), timeout_s=30)
    forged = f"1.{int(time.time()) + 600}.{'ab' * 16}.{'cd' * 16}.{'ef' * 16}"
    for token in ("", forged):
        reply = m.ask(_claim(P, D, "r1", "abandon", reason="forged", token=token))
        assert reply is not None and reply["granted"] is False, reply
    _read(P, D, sent)
    assert _hold_end(P, "r1")[0] == "sent"


def test_renewals_without_the_token_pin_nothing(
        engines: tuple[SimEngine, SimEngine, Member]) -> None:
    P, D, m = engines
    P.prefill("r2", Request(seed=2, prompt_tokens=40), timeout_s=3)
    placed = time.monotonic()
    replies = []
    # M renews for 12 s, four times the hold's life; the hold expires at its 3 s.
    while time.monotonic() < placed + 12:
        replies.append(m.ask(_claim(P, D, "r2")))
        P.poll()
        if any(c.request_id == "r2" for c in P.completions[0]):
            break
        time.sleep(0.5)
    kind, at = _hold_end(P, "r2", timeout_s=30)
    assert kind == "expired"
    assert at - placed < 8.0, at - placed
    assert replies and all(r is not None and r["granted"] is False
                           and "no hold token" in r["reason"] for r in replies), replies[:2]


def test_early_claims_of_one_member_refuse_no_other(
        engines: tuple[SimEngine, SimEngine, Member]) -> None:
    P, D, m = engines
    granted = 0
    for start in range(0, 4096, control.MAX_BATCH_ITEMS):
        items = [_claim(P, D, f"flood-{i}") for i in range(start, start + control.MAX_BATCH_ITEMS)]
        reply = m.ask(control.ControlBatch(items=items))
        assert reply is not None
        granted += sum(r["granted"] for r in reply["replies"])
    assert granted == 0
    # D reads before P holds (vLLM's order: the workers hold a step later).
    sent = P.prefill("r3", Request(seed=3, prompt_tokens=40), hold=False)
    D.start_read(sent)
    time.sleep(1.0)
    P.clients[0].hold(P.engine_id, "r3", sent.block_ids)
    got = D.wait_for(["r3"])
    assert [c.kind for c in got["r3"].values()] == ["received"], got
    assert not D.verify("r3")
    assert _hold_end(P, "r3")[0] == "sent"


def test_a_redeclared_reader_agent_does_not_silence_the_real_one(
        engines: tuple[SimEngine, SimEngine, Member]) -> None:
    P, D, m = engines
    _read(P, D, P.prefill("r4a", Request(seed=4, prompt_tokens=40)))  # D linked, declared
    assert _hold_end(P, "r4a")[0] == "sent"
    reply = m.ask(HandshakeRequest(P.engine_id, 0, reader_engine=D.engine_id, reader_rank=0,
                                   reader_agent="evil-agent"))
    assert reply is not None and reply["type"] == "reply"  # M is a member: it may link
    sent = P.prefill("r4b", Request(seed=5, prompt_tokens=40), timeout_s=8)
    t0 = time.monotonic()
    _read(P, D, sent)  # over D's cached link: no new handshake declares it again
    kind, at = _hold_end(P, "r4b")
    assert kind == "sent" and at - t0 < 8.0, (kind, at - t0)


def test_keys_are_admitted_and_rotated_without_a_restart(
        fleet: tuple[SidecarProcess, SidecarProcess, dict[str, str]], tmp_path: Path) -> None:
    p, _, keys = fleet
    generate_keys(tmp_path / "new")
    new = Member(str(tmp_path / "new"), keys["p"], p.handshake)
    try:
        assert new.ask(HandshakeRequest("nobody", 0), wait_s=3) is None  # not a member yet
    finally:
        new.close()
    admitted = Path(keys["p"]) / "authorized" / "new.key"
    shutil.copy(tmp_path / "new" / "sidecar.key", admitted)
    new = Member(str(tmp_path / "new"), keys["p"], p.handshake)
    try:
        reply = new.ask(HandshakeRequest("nobody", 0))
        assert reply is not None and reply["code"] == "unknown_engine"  # admitted, answered
    finally:
        new.close()
        admitted.unlink()
