"""Control batches (issue #12): the wire types and their bounds, the pure
per-address outbox, and the client's coalescing against a scripted peer.

The peer in the client tests is a plain ZMQ ROUTER driven by the test (a named
fake): it decides when to answer, so "sent while a message was in flight" and
"an older peer answers a batch with a single reply" are set up exactly, not
hoped for. The daemon's own answers are in tests/e2e/test_control_batch.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvsidecar.daemon.peers import control
from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.peers.coalesce import Outbox
from kvsidecar.daemon.peers.control import (
    BATCH_OVERHEAD_BYTES,
    MAX_BATCH_BYTES,
    MAX_BATCH_ITEMS,
    Abandon,
    BadControl,
    Claim,
    ControlBatch,
    ControlBatchReply,
    ControlReply,
)
from kvsidecar.daemon.peers.messages import (
    HandshakeFailed,
    HandshakeInfo,
    RawReply,
    decode_info,
    decode_request,
    encode,
    make_handshake_info,
    new_daemon_id,
)
from kvsidecar.daemon.peers.server import MAX_REQUEST_BYTES
from kvsidecar.ipc.layout import attention_layout

pytestmark = pytest.mark.timeout(60)


def claim(rid: str) -> Claim:
    return Claim(engine_id="P", tp_rank=0, agent_name="agent-p",
                 request_id=rid, reader_engine="D", reader_rank=0, reader_tp=1)


# ------------------------------------------------------------------ wire types


def test_a_batch_round_trips_in_order_with_each_items_kind() -> None:
    items = [claim("a"), Abandon(**msgspec.structs.asdict(claim("b")), reason="gave up"),
             claim("c")]
    msg = control.decode_request(control.encode_batch([control.encode(i) for i in items], 7))
    assert isinstance(msg, ControlBatch) and msg.req_id == 7
    assert msg.items == items
    # the raw form and the typed form are the same bytes
    assert control.encode(msg) == control.encode_batch([control.encode(i) for i in items], 7)


@pytest.mark.parametrize("items,why", [
    ([], "length >= 1"),
    ([control.encode(claim("x"))] * (MAX_BATCH_ITEMS + 1), f"length <= {MAX_BATCH_ITEMS}"),
    ([control.encode_batch([control.encode(claim("x"))], 1)], "items[0]"),  # nested
    ([msgspec.msgpack.encode({"op": "poll"})], "items[0]"),  # not a claim or abandon
])
def test_malformed_batches_are_bad_control_with_a_clear_reason(items: list[bytes],
                                                               why: str) -> None:
    frame = msgspec.msgpack.encode({"op": "batch", "items": [msgspec.Raw(i) for i in items],
                                    "req_id": 3, "v": 1})
    assert control.op_of(frame) == "batch" and control.request_id_of(frame) == 3
    with pytest.raises(BadControl, match=r"invalid control message") as e:
        control.decode_request(frame)
    assert why in str(e.value)


def test_encode_batch_refuses_what_a_peer_would_refuse() -> None:
    with pytest.raises(ValueError, match=r"1\.\.64"):
        control.encode_batch([], 1)
    with pytest.raises(ValueError, match=r"1\.\.64"):
        control.encode_batch([control.encode(claim("x"))] * (MAX_BATCH_ITEMS + 1), 1)


def test_the_largest_item_fits_a_batch_and_a_full_batch_fits_the_peers_limit() -> None:
    """Strings at their bounds, 4 bytes per character in UTF-8: one item alone
    always fits a batch message, and a batch never exceeds the request bound
    of the peer channel (so it is never refused for its size)."""
    huge = Abandon(engine_id="\U0001f600" * 256, tp_rank=1 << 16, agent_name="\U0001f600" * 256,
                   request_id="\U0001f600" * 1024, reader_engine="\U0001f600" * 256,
                   reader_rank=1 << 16, reader_tp=1 << 16, reason="\U0001f600" * 1024,
                   req_id=2**63 - 1)
    size = len(control.encode(huge))
    assert size + BATCH_OVERHEAD_BYTES <= MAX_BATCH_BYTES
    assert MAX_BATCH_BYTES + size <= MAX_REQUEST_BYTES  # a batch at the bound plus one item
    full = control.encode_batch([control.encode(huge)], 2**63 - 1)
    assert len(full) - size <= BATCH_OVERHEAD_BYTES


def test_an_older_peers_info_decodes_as_no_batches() -> None:
    layout = attention_layout(model="m", num_layers=2, total_kv_heads=8, head_dim=64,
                              block_tokens=16, tp_size=1, num_blocks=8)
    info = make_handshake_info(engine_id="P", tp_rank=0, agent_name="a", agent_metadata=b"m",
                               layout=layout, bases=[1 << 20, 1 << 30],
                               daemon_id=new_daemon_id())
    assert info.control_batch_items == MAX_BATCH_ITEMS
    old = msgspec.msgpack.decode(encode(info))
    del old["control_batch_items"]
    assert decode_info(msgspec.msgpack.encode(old)).control_batch_items == 0


# ------------------------------------------------------------------ the outbox


def test_the_first_item_starts_a_flush_and_later_ones_join_it() -> None:
    box: Outbox[str] = Outbox(max_items=4, max_bytes=1000)
    assert box.add("a", 10, now=0.0) is True
    assert [box.add(x, 10, now=0.0) for x in "bcdef"] == [False] * 5
    assert box.take(now=0.0, max_wait_s=5).items == ["a", "b", "c", "d"]
    assert box.busy  # the flush still owns the address: a new item joins it
    assert box.add("g", 10, now=0.1) is False
    assert box.take(now=0.1, max_wait_s=5).items == ["e", "f", "g"]
    taken = box.take(now=0.2, max_wait_s=5)
    assert taken.items == [] and taken.expired == []
    assert not box.busy and box.idle
    assert box.add("h", 10, now=0.3) is True  # a lone item after idle: a new flush


def test_the_byte_bound_splits_messages_and_an_oversize_item_leaves_alone() -> None:
    box: Outbox[str] = Outbox(max_items=64, max_bytes=100, overhead=10)
    for name, size in [("a", 40), ("b", 40), ("c", 40), ("big", 500), ("d", 10)]:
        box.add(name, size, now=0.0)
    assert box.take(0.0, 5).items == ["a", "b"]  # 10 + 40 + 40; c would make 130
    assert box.take(0.0, 5).items == ["c"]  # big does not fit next to c
    assert box.take(0.0, 5).items == ["big"]  # alone, whatever its size
    assert box.take(0.0, 5).items == ["d"]


def test_items_that_waited_too_long_are_handed_back_not_sent() -> None:
    box: Outbox[str] = Outbox(max_items=8, max_bytes=1000)
    box.add("old", 1, now=0.0)
    box.add("older-too", 1, now=0.5)
    box.add("fresh", 1, now=5.5)
    taken = box.take(now=6.0, max_wait_s=5.0)
    assert taken.expired == ["old", "older-too"] and taken.items == ["fresh"]


def test_outbox_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Outbox(max_items=0, max_bytes=1)


# ------------------------------------------------------------------ the client


class ScriptedPeer:
    """A ROUTER the test drives: answers the handshake with an info advertising
    ``batch_items``; control messages are received and answered by the test."""

    def __init__(self, batch_items: int) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        self.address = endpoint.decode().removeprefix("tcp://")
        layout = attention_layout(model="m", num_layers=2, total_kv_heads=8, head_dim=64,
                                  block_tokens=16, tp_size=1, num_blocks=8)
        self.info: HandshakeInfo = make_handshake_info(
            engine_id="P", tp_rank=0, agent_name="agent-p", agent_metadata=b"m",
            layout=layout, bases=[1 << 20, 1 << 30], daemon_id=new_daemon_id(),
            control_batch_items=batch_items)

    async def handshake(self) -> None:
        ident, frame = await self.sock.recv_multipart()
        req = decode_request(frame)
        await self.sock.send_multipart([ident, encode(RawReply(msgspec.Raw(encode(self.info)),
                                                               req.req_id))])

    async def receive(self) -> tuple[bytes, control.AnyControl]:
        ident, frame = await self.sock.recv_multipart()
        return ident, control.decode_request(frame)

    async def answer(self, ident: bytes, msg: control.AnyControl,
                     grant: bool = True) -> None:
        """Grant (or refuse) every item; a refused item's reason names it."""
        def one(item: control.ControlRequest) -> ControlReply:
            ok = grant and item.request_id != "refuse-me"
            return ControlReply(granted=ok, lease_s=10.0 if ok else 0.0,
                                reason="" if ok else f"no hold {item.request_id}",
                                req_id=item.req_id)
        if isinstance(msg, ControlBatch):
            reply = control.encode(ControlBatchReply(replies=[one(i) for i in msg.items],
                                                     req_id=msg.req_id))
        else:
            reply = control.encode(one(msg))
        await self.sock.send_multipart([ident, reply])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
async def client() -> AsyncIterator[tuple[HandshakeClient, list[int]]]:
    sent: list[int] = []
    cli = HandshakeClient(timeout_s=10.0, on_control_sent=sent.append)
    yield cli, sent
    await cli.close()


async def linked(cli: HandshakeClient, batch_items: int) -> ScriptedPeer:
    peer = ScriptedPeer(batch_items)
    answering = asyncio.ensure_future(peer.handshake())
    await cli.fetch(peer.address, "P", 0)
    await answering
    return peer


async def test_claims_issued_together_travel_as_one_batch_answered_item_by_item(
        client: tuple[HandshakeClient, list[int]]) -> None:
    cli, sent = client
    peer = await linked(cli, MAX_BATCH_ITEMS)
    try:
        rids = [f"r{i}" for i in range(16)]
        rids[5] = "refuse-me"
        calls = [asyncio.ensure_future(cli.control(peer.address, claim(r))) for r in rids]
        ident, msg = await peer.receive()
        assert isinstance(msg, ControlBatch)
        assert [i.request_id for i in msg.items] == rids
        await peer.answer(ident, msg)
        answers = await asyncio.gather(*calls)
        assert [a.reply.granted for a in answers] == [r != "refuse-me" for r in rids]
        assert answers[5].reply.reason == "no hold refuse-me"
        assert len({a.sent_at for a in answers}) == 1  # every item: the batch's send time
        assert sent == [16]
        assert [a.reply.req_id for a in answers] == [i.req_id for i in msg.items]
    finally:
        peer.close()


async def test_a_lone_claim_goes_alone_as_a_plain_claim(
        client: tuple[HandshakeClient, list[int]]) -> None:
    cli, sent = client
    peer = await linked(cli, MAX_BATCH_ITEMS)
    try:
        call = asyncio.ensure_future(cli.control(peer.address, claim("solo")))
        ident, msg = await peer.receive()
        assert isinstance(msg, Claim) and msg.request_id == "solo"  # old wire form
        await peer.answer(ident, msg)
        assert (await call).reply.granted and sent == [1]
    finally:
        peer.close()


async def test_a_claim_sent_now_leaves_before_control_soon_returns_unless_others_wait(
        client: tuple[HandshakeClient, list[int]]) -> None:
    """``now``: the claim is on the wire when the call returns (the caller's
    very next step may hand the GIL to the NIXL worker); while it is in
    flight, what follows to that peer (``now`` or not) waits in the outbox
    and goes as the next batch, as any control message does."""
    cli, sent = client
    peer = await linked(cli, MAX_BATCH_ITEMS)
    try:
        first = cli.control_soon(peer.address, claim("now"), now=True)
        assert sent == [1]  # sent on the spot, not at the next loop iteration
        ident, msg = await peer.receive()
        assert isinstance(msg, Claim) and msg.request_id == "now"
        queued = [cli.control_soon(peer.address, claim(f"q{i}")) for i in range(2)]
        late = cli.control_soon(peer.address, claim("late"), now=True)
        await asyncio.sleep(0)
        assert sent == [1]  # all three wait behind the claim in flight
        await peer.answer(ident, msg)
        assert (await first).reply.granted
        ident, batch = await peer.receive()
        assert isinstance(batch, ControlBatch)
        assert [i.request_id for i in batch.items] == ["q0", "q1", "late"]
        await peer.answer(ident, batch)
        assert all(a.reply.granted for a in await asyncio.gather(*queued, late))
        assert sent == [1, 3]
    finally:
        peer.close()


async def test_what_is_issued_while_a_batch_is_in_flight_leaves_as_the_next_one(
        client: tuple[HandshakeClient, list[int]]) -> None:
    cli, sent = client
    peer = await linked(cli, MAX_BATCH_ITEMS)
    try:
        first = [asyncio.ensure_future(cli.control(peer.address, claim(f"a{i}")))
                 for i in range(3)]
        ident, msg1 = await peer.receive()
        later = [asyncio.ensure_future(cli.control(peer.address, claim(f"b{i}")))
                 for i in range(100)]
        await asyncio.sleep(0)  # every later call is queued before the first reply goes
        await peer.answer(ident, msg1)
        ident, msg2 = await peer.receive()
        assert isinstance(msg2, ControlBatch) and len(msg2.items) == MAX_BATCH_ITEMS
        await peer.answer(ident, msg2)
        ident, msg3 = await peer.receive()
        assert isinstance(msg3, ControlBatch) and len(msg3.items) == 100 - MAX_BATCH_ITEMS
        await peer.answer(ident, msg3)
        assert all(a.reply.granted for a in await asyncio.gather(*first, *later))
        assert sent == [3, MAX_BATCH_ITEMS, 100 - MAX_BATCH_ITEMS]
    finally:
        peer.close()


async def test_a_peer_that_did_not_advertise_batches_gets_single_messages(
        client: tuple[HandshakeClient, list[int]]) -> None:
    cli, sent = client
    peer = await linked(cli, 0)  # an older sidecar: its info has no batch field
    try:
        calls = [asyncio.ensure_future(cli.control(peer.address, claim(f"r{i}")))
                 for i in range(4)]
        for _ in range(4):
            ident, msg = await peer.receive()
            assert isinstance(msg, Claim)
            await peer.answer(ident, msg)
        assert all(a.reply.granted for a in await asyncio.gather(*calls))
        assert sent == [1, 1, 1, 1]
    finally:
        peer.close()


async def test_a_batch_answered_with_a_single_reply_is_resent_item_by_item(
        client: tuple[HandshakeClient, list[int]]) -> None:
    """An older sidecar took the address after its handshake advertised batches:
    it answers the batch as the undecodable control message it is to it. D sends
    those items again one by one, and sends singles from then on."""
    cli, sent = client
    peer = await linked(cli, MAX_BATCH_ITEMS)
    try:
        calls = [asyncio.ensure_future(cli.control(peer.address, claim(f"r{i}")))
                 for i in range(3)]
        ident, msg = await peer.receive()
        assert isinstance(msg, ControlBatch)
        await peer.sock.send_multipart([ident, control.encode(ControlReply(
            granted=False, reason="invalid control message: Invalid value 'batch'",
            req_id=msg.req_id))])
        for _ in range(3):
            ident, one = await peer.receive()
            assert isinstance(one, Claim)
            await peer.answer(ident, one)
        assert all(a.reply.granted for a in await asyncio.gather(*calls))
        call = asyncio.ensure_future(cli.control(peer.address, claim("next")))
        ident, one = await peer.receive()
        assert isinstance(one, Claim)
        await peer.answer(ident, one)
        await call
        assert sent == [3, 1, 1, 1, 1]
    finally:
        peer.close()


async def test_a_reply_with_the_wrong_number_of_answers_fails_every_item(
        client: tuple[HandshakeClient, list[int]]) -> None:
    cli, _ = client
    peer = await linked(cli, MAX_BATCH_ITEMS)
    try:
        calls = [asyncio.ensure_future(cli.control(peer.address, claim(f"r{i}")))
                 for i in range(3)]
        ident, msg = await peer.receive()
        await peer.sock.send_multipart([ident, control.encode(ControlBatchReply(
            replies=[ControlReply(granted=True, lease_s=10)], req_id=msg.req_id))])
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            assert isinstance(outcome, HandshakeFailed)
            assert "batch of 3 control messages with 1 answers" in outcome.reason
    finally:
        peer.close()


async def test_an_unanswered_batch_fails_its_items_and_a_cancelled_caller_is_skipped() -> None:
    cli = HandshakeClient(timeout_s=0.5)
    peer = await linked(cli, MAX_BATCH_ITEMS)
    try:
        gone = asyncio.ensure_future(cli.control(peer.address, claim("gone")))
        await asyncio.sleep(0)
        gone.cancel()
        calls = [asyncio.ensure_future(cli.control(peer.address, claim(f"r{i}")))
                 for i in range(2)]
        _, msg = await peer.receive()  # never answered
        assert isinstance(msg, ControlBatch)
        assert [i.request_id for i in msg.items] == ["r0", "r1"]
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            assert isinstance(outcome, HandshakeFailed) and "no answer" in outcome.reason
    finally:
        peer.close()
        await cli.close()
