"""End to end: D's lease claims for the reads of one engine ``Batch`` reach P
as a few batched control messages, not one per read (issue #12), real sidecars.

Each test starts its own P and D sidecar (with metrics) so that P's counters
count this test's messages only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvsidecar.daemon.peer_auth import load_keys
from kvsidecar.daemon.peers import control
from kvsidecar.daemon.peers.control import MAX_BATCH_ITEMS, Claim
from kvsidecar.sim.cluster import SidecarProcess, SimEngine, fleet_keys
from kvsidecar.sim.models import attn
from kvsidecar.sim.oracle import Request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ANSWERED = "kvsidecar_control_items_per_message"


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[SidecarProcess, SidecarProcess]]:
    p = SidecarProcess(tmp_path, "cb-p", args=["--metrics-port", "0"]).start()
    d = SidecarProcess(tmp_path, "cb-d", args=["--metrics-port", "0"]).start()
    try:
        yield p, d
    finally:
        codes = {"p": p.stop(), "d": d.stop()}
        assert codes == {"p": 0, "d": 0}, codes


def _answered(p: SidecarProcess) -> tuple[float, float]:
    """(control messages P answered, items they carried)."""
    return (p.metric(f"{ANSWERED}_count", side="answered"),
            p.metric(f"{ANSWERED}_sum", side="answered"))


def _claims(p: SidecarProcess, result: str) -> float:
    return p.metric("kvsidecar_lease_requests_total", op="claim", result=result)


def test_sixteen_reads_claim_in_a_few_messages_and_a_refused_item_fails_only_its_read(
        pair: tuple[SidecarProcess, SidecarProcess]) -> None:
    p, d = pair
    P = SimEngine("cb-P", attn(8), 1, 96, [p])
    D = SimEngine("cb-D", attn(8), 1, 96, [d])
    try:
        # One read first: D links to P and learns from P's handshake that it batches.
        D.start_read(P.prefill("warm", Request(seed=1, prompt_tokens=16)))
        assert D.wait_for(["warm"])["warm"][0].kind == "received"
        assert D.verify("warm") == []
        D.finish("warm")
        messages0, items0 = _answered(p)
        granted0, refused0 = _claims(p, "granted"), _claims(p, "refused")

        sents = [P.prefill(f"r{i}", Request(seed=10 + i, prompt_tokens=8 + 4 * i))
                 for i in range(15)]
        # Held, then released by P's engine: P refuses this read's claim (the
        # blocks may be reused), and only this one.
        ghost = P.prefill("ghost", Request(seed=99, prompt_tokens=16))
        P.clients[0].release(P.engine_id, "ghost")
        assert P.wait_for(["ghost"])["ghost"][0].kind == "aborted"
        batch = [*sents[:7], ghost, *sents[7:]]
        D.start_reads(batch)  # one read_many of 16 reads, all from P rank 0
        rids = [s.request_id for s in batch]
        got = D.wait_for(rids)
        kinds = {rid: got[rid][0].kind for rid in rids}
        assert kinds == {rid: "failed" if rid == "ghost" else "received" for rid in rids}
        assert "refused the lease" in got["ghost"][0].reason, got["ghost"][0].reason
        assert "has ended" in got["ghost"][0].reason, got["ghost"][0].reason
        for s in sents:
            assert D.verify(s.request_id) == [], s.request_id
        sent_back = P.wait_for([s.request_id for s in sents])
        assert {per[0].kind for per in sent_back.values()} == {"sent"}

        # Every claim was answered on its own: 15 granted, the ghost's refused ...
        assert _claims(p, "granted") - granted0 == 15
        assert _claims(p, "refused") - refused0 == 1
        messages, items = _answered(p)
        # ... the 16 claims and the failed read's abandon (17 items) in a handful of
        # messages: the claims of one engine batch leave together, and whatever is
        # issued while a message is in flight waits for it and joins the next.
        assert items - items0 == 17
        assert messages - messages0 <= 4, (messages - messages0, items - items0)
        sent_n = d.metric(f"{ANSWERED}_count", side="sent")
        sent_items = d.metric(f"{ANSWERED}_sum", side="sent")
        assert sent_items >= 18 and sent_n <= 5  # the warm claim alone, then the batch
    finally:
        D.close()
        P.close()


def test_a_malformed_or_oversize_batch_is_refused_and_p_keeps_serving(
        pair: tuple[SidecarProcess, SidecarProcess]) -> None:
    """Raw batches over the authenticated peer channel, as a buggy or newer D could
    send them: each gets one clear refusal; P's engines keep being read."""
    p, d = pair
    P = SimEngine("cb-P2", attn(8), 1, 96, [p])
    D = SimEngine("cb-D2", attn(8), 1, 96, [d])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    load_keys(fleet_keys()).dial_with(sock)
    sock.connect(f"tcp://{p.handshake}")
    try:
        item = control.encode(Claim(engine_id="cb-P2", tp_rank=0, agent_name="x",
                                    request_id="none", reader_engine="e", reader_rank=0,
                                    reader_tp=1))

        def ask(frame: bytes) -> dict[str, object]:
            sock.send(frame)
            assert sock.poll(30_000), "P did not answer"
            reply: dict[str, object] = msgspec.msgpack.decode(sock.recv())
            return reply

        over = msgspec.msgpack.encode({"op": "batch", "items": [msgspec.Raw(item)] *
                                       (MAX_BATCH_ITEMS + 1), "req_id": 7, "v": 1})
        reply = ask(over)
        assert reply["type"] == "control" and reply["granted"] is False
        assert f"length <= {MAX_BATCH_ITEMS}" in str(reply["reason"]) and reply["req_id"] == 7
        empty = msgspec.msgpack.encode({"op": "batch", "items": [], "req_id": 8, "v": 1})
        reply = ask(empty)
        assert reply["granted"] is False and "length >= 1" in str(reply["reason"])
        nested = control.encode_batch([control.encode_batch([item], 1)], 9)
        reply = ask(nested)
        assert reply["granted"] is False and reply["req_id"] == 9
        # A well-formed batch is answered item by item, each on its own merits.
        reply = ask(control.encode_batch([item, item], 10))
        assert reply["type"] == "control_batch" and reply["req_id"] == 10
        replies = reply["replies"]
        assert isinstance(replies, list) and len(replies) == 2
        # The item names an agent P's engine never had: refused as a stale link.
        assert [(r["granted"], r["stale_link"]) for r in replies] == [(False, True)] * 2
        assert p.metric("kvsidecar_lease_requests_total", op="batch", result="bad") == 3
        # P keeps serving: a real read still moves oracle-exact bytes.
        D.start_read(P.prefill("after", Request(seed=5, prompt_tokens=24)))
        assert D.wait_for(["after"])["after"][0].kind == "received"
        assert D.verify("after") == []
    finally:
        sock.close(0)
        ctx.term()
        D.close()
        P.close()
