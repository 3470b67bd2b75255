"""The wire protocol: every message survives a round trip, and bad bytes only
ever produce a readable ProtocolError (never another exception)."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.ipc.layout import attention_layout
from kvsidecar.ipc.protocol import (
    BAD_MESSAGE,
    ERROR_CODES,
    MAX_BATCH,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    VERSION,
    Batch,
    Completion,
    Completions,
    Deregister,
    Error,
    Held,
    Hold,
    Keep,
    KeepItem,
    Ok,
    Ping,
    Poll,
    Pong,
    ProtocolError,
    Read,
    ReaderReport,
    Register,
    Registered,
    Release,
    RemoteEngine,
    Replies,
    Reply,
    Request,
    RequestError,
    ShmRef,
    TransferReport,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)

LAYOUT = attention_layout(model="m", num_layers=2, total_kv_heads=2, head_dim=8, block_tokens=4,
                          tp_size=1, num_blocks=4)
REMOTE = RemoteEngine("prefill-0", 2, ["10.0.0.1:7000", "10.0.0.1:7001"])

REQUESTS: list[Request] = [
    Register("d0", 0, LAYOUT, "attach", [ShmRef("kvs-1", 4096), ShmRef("kvs-2", 10, 4096)],
             id=1),
    Register("d0", 3, LAYOUT, "allocate", keep_on_exit=True, pid=1234, id=2),
    Deregister("d0", id=3),
    Read("d0", "req-1", [[0, 1, 2]], REMOTE, [[5, 6, 7]], id=4),
    Read("d0", "req-2", [[0], [1]], REMOTE, [[2], [3]], remote_request_id="p-req-2",
         skip_tokens=16, id=5),
    Hold("p0", "req-1", [[1, 2]], id=6),
    Hold("p0", "req-1", [[1, 2]], readers=4, timeout_s=2.5, id=7),
    Release("d0", "req-1", id=8),
    Poll("d0", id=9),
    Ping(id=2**40),
    Batch([Read("d0", "req-3", [[0]], REMOTE, [[1]], id=11), Hold("p0", "h", [[2]], id=12),
           Release("d0", "req-1", id=13)], id=10),
    Keep("d0", [KeepItem(REMOTE, "req-1"), KeepItem(REMOTE, "p-req-2")], id=14),
]

REPLIES: list[Reply] = [
    Ok(id=1),
    Registered("d0", "10.0.0.2:7000", "agent-d0", [ShmRef("kvs-3", 100)], id=2),
    Registered("d0", "10.0.0.2:7000", "agent-d0", id=3),
    Completions([], id=4),
    Completions([
        Completion("a", "received", nbytes=1 << 20, descriptors=12,
                   transfers=[TransferReport(0, 1 << 19, 8, 1e-4, 2e-3),
                              TransferReport(1, 1 << 19, 4)]),
        Completion("s", "sent", readers=[ReaderReport("d0", [0, 1], True),
                                         ReaderReport("d1", [2], False, "lease lost")]),
        Completion("b", "failed", "peer gone", [[3, 4], []]),
        Completion("c", "sent"), Completion("d", "expired"), Completion("e", "aborted"),
    ], id=5),
    Pong(PROTOCOL_VERSION, ["d0", "d1"], PROTOCOL_MINOR, id=6),
    Error(BAD_MESSAGE, "nope", id=-1),
    Replies([Ok(id=11), Held(10.0, 60.0, id=12), Error(BAD_MESSAGE, "no", id=13)], id=10),
]


@pytest.mark.parametrize("req", REQUESTS, ids=lambda r: type(r).__name__)
def test_request_round_trip(req: Request) -> None:
    out = decode_request(encode_request(req))
    assert out == req and type(out) is type(req)


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: type(r).__name__)
def test_reply_round_trip(reply: Reply) -> None:
    out = decode_reply(encode_reply(reply))
    assert out == reply and type(out) is type(reply)


def test_version_and_op_are_on_the_wire() -> None:
    raw = msgspec.msgpack.decode(encode_request(Poll("d0", id=7)))
    assert raw == {"op": "poll", "engine_id": "d0", "id": 7, "v": PROTOCOL_VERSION,
                   "ack": None, "epoch": "", "wait_s": 0.0}


def test_region_refs_are_tagged_by_kind() -> None:
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ShmRef("x", 8))) == {
        "kind": "shm", "name": "x", "nbytes": 8, "offset": 0,
    }


def test_completion_defaults_stay_off_the_wire() -> None:
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(Completion("r", "sent"))) == {
        "request_id": "r", "kind": "sent",
    }


class _PollV1_3(msgspec.Struct, tag_field="op", tag="poll", kw_only=True, frozen=True):
    """A poll as a minor-3 daemon declared it (no ``wait_s``)."""

    engine_id: str
    ack: int | None = None
    epoch: str = ""
    id: int
    v: int = 1


class _CompletionV1_0(msgspec.Struct, frozen=True):
    """A completion as a minor-0 client declared it."""

    request_id: str
    kind: str
    reason: str = ""
    invalid_block_ids: list[list[int]] = []
    nbytes: int = 0


class _PongV1_0(msgspec.Struct, tag="pong", tag_field="op"):
    id: int
    version: int
    engines: list[str] = []


def test_minor_additions_are_compatible_both_ways() -> None:
    """Minor 1 (readers, descriptors, Pong.minor): a minor-0 client reads a minor-1
    daemon's replies, ignoring the new fields; a minor-1 client reads a minor-0
    daemon's, seeing the defaults (and minor 0, so it knows they are absent)."""
    new = Completion("s", "sent", readers=[ReaderReport("d0", [0], True)], descriptors=3)
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=_CompletionV1_0)
    assert (old.request_id, old.kind) == ("s", "sent")
    pong_old = msgspec.msgpack.encode(_PongV1_0(5, PROTOCOL_VERSION, ["e"]))
    pong = decode_reply(pong_old)
    assert isinstance(pong, Pong) and (pong.minor, pong.engines) == (0, ["e"])
    plain = decode_reply(encode_reply(Completions([Completion("r", "received")])))
    assert isinstance(plain, Completions)
    assert (plain.items[0].readers, plain.items[0].descriptors) == ([], 0)


def test_reply_id_defaults_so_handlers_can_leave_it_to_the_server() -> None:
    assert Ok().id == -1
    assert Error("internal", "x").id == -1


def test_error_codes() -> None:
    assert set(ERROR_CODES) == {"bad_message", "version", "unknown_engine", "bad_request",
                                "duplicate", "incompatible", "unavailable", "internal", "forbidden"}
    e = RequestError("bad_request", "block 9 out of range")
    assert (e.code, e.message) == ("bad_request", "block 9 out of range")


def _raw(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def _bad(data: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_request(data)
    return info.value


def test_garbage_bytes() -> None:
    e = _bad(b"\xc1\xc1 not msgpack")
    assert e.code == BAD_MESSAGE and e.id == -1 and "malformed" in e.message


def test_empty_and_truncated() -> None:
    whole = encode_request(REQUESTS[3])
    for cut in (0, 1, len(whole) // 2, len(whole) - 1):
        assert _bad(whole[:cut]).code == BAD_MESSAGE


def test_not_an_object() -> None:
    e = _bad(_raw([1, 2, 3]))
    assert e.code == BAD_MESSAGE and e.id == -1 and "object" in e.message


def test_unknown_op_names_the_op_and_keeps_the_id() -> None:
    e = _bad(_raw({"op": "frobnicate", "id": 12, "v": PROTOCOL_VERSION}))
    assert e.code == BAD_MESSAGE and e.id == 12
    assert "frobnicate" in e.message and "read" in e.message


def test_missing_op() -> None:
    e = _bad(_raw({"id": 3, "v": PROTOCOL_VERSION, "engine_id": "d0"}))
    assert e.id == 3 and "op" in e.message


def test_wrong_type_names_the_field() -> None:
    e = _bad(_raw({"op": "poll", "id": 5, "v": PROTOCOL_VERSION, "engine_id": 17}))
    assert e.code == BAD_MESSAGE and e.id == 5 and "$.engine_id" in e.message


def test_bad_block_id_names_its_position() -> None:
    good = msgspec.msgpack.decode(encode_request(REQUESTS[3]))
    good["local_block_ids"] = [[0, "1", 2]]
    e = _bad(_raw(good))
    assert e.id == 4 and "$.local_block_ids[0][1]" in e.message


def test_a_minor_4_poll_decodes_in_a_minor_3_daemon_as_a_plain_poll() -> None:
    """``Poll.wait_s`` is a request field an older daemon ignores (requests do not
    forbid unknown fields): it answers at once, which a waiting client handles."""
    old = msgspec.msgpack.decode(encode_request(Poll("d0", 4, "ep", 2.5, id=3)),
                                 type=_PollV1_3)
    assert (old.engine_id, old.ack, old.epoch, old.id) == ("d0", 4, "ep", 3)
    again = decode_request(encode_request(Poll("d0", 4, "ep", 2.5, id=3)))
    assert isinstance(again, Poll) and again.wait_s == 2.5


def test_deregister_mode_defaults_to_drop_and_refuses_other_words() -> None:
    """Minor 6: ``Deregister.mode``. A minor-5 client's deregister (no mode) means
    what it always meant (drop); anything but drain or drop is a bad_message."""
    old = decode_request(msgspec.msgpack.encode(
        {"op": "deregister", "id": 1, "v": PROTOCOL_VERSION, "engine_id": "p0"}))
    assert isinstance(old, Deregister) and old.mode == "drop"
    assert decode_request(encode_request(Deregister("p0", "drain", id=3))) == Deregister(
        "p0", "drain", id=3)
    e = _bad(_raw({"op": "deregister", "id": 2, "v": PROTOCOL_VERSION, "engine_id": "p0",
                   "mode": "later"}))
    assert e.code == BAD_MESSAGE and "$.mode" in e.message, e.message


def test_a_batch_carries_reads_holds_and_releases_only() -> None:
    """No empty batch, no batch over MAX_BATCH, and nothing but reads, holds and
    releases inside (no nesting, no polls): each is a readable bad_message."""
    poll = msgspec.msgpack.decode(encode_request(Poll("d0", id=2)))
    batch = msgspec.msgpack.decode(encode_request(REQUESTS[-1]))
    rel = msgspec.msgpack.decode(encode_request(Release("d0", "r", id=3)))
    for requests in ([], [poll], [batch], [rel] * (MAX_BATCH + 1)):
        e = _bad(_raw({"op": "batch", "id": 1, "v": PROTOCOL_VERSION, "requests": requests}))
        assert e.code == BAD_MESSAGE and "$.requests" in e.message, e.message


def test_constraints() -> None:
    for op, field, value in [("hold", "readers", 0), ("hold", "timeout_s", 0.0),
                             ("read", "skip_tokens", -1), ("register", "tp_rank", -1),
                             ("poll", "wait_s", -0.5), ("poll", "wait_s", 61.0),
                             ("poll", "wait_s", float("nan"))]:
        raw = msgspec.msgpack.decode(encode_request(
            next(r for r in REQUESTS if r.__struct_config__.tag == op)))
        raw[field] = value
        assert f"$.{field}" in _bad(_raw(raw)).message


def test_unknown_region_kind_is_rejected_readably() -> None:
    raw = msgspec.msgpack.decode(encode_request(REQUESTS[0]))
    raw["regions"][0]["kind"] = "rdma_dmabuf"
    e = _bad(_raw(raw))
    assert "rdma_dmabuf" in e.message and "$.regions[0]" in e.message


def test_unknown_layout_field_is_rejected() -> None:
    raw = msgspec.msgpack.decode(encode_request(REQUESTS[0]))
    raw["layout"]["surprise"] = 1
    assert "surprise" in _bad(_raw(raw)).message


def test_missing_id() -> None:
    e = _bad(_raw({"op": "ping", "v": PROTOCOL_VERSION}))
    assert e.code == BAD_MESSAGE and e.id == -1 and "id" in e.message


def test_other_version_of_a_valid_message() -> None:
    raw = msgspec.msgpack.decode(encode_request(Ping(id=9)))
    raw["v"] = PROTOCOL_VERSION + 1
    e = _bad(_raw(raw))
    assert e.code == VERSION and e.id == 9
    assert f"v={PROTOCOL_VERSION + 1}" in e.message and f"v={PROTOCOL_VERSION}" in e.message


def test_other_version_with_another_shape_is_still_a_version_error() -> None:
    e = _bad(_raw({"op": "read2", "id": 4, "v": 2, "blocks": b"\x00\x01"}))
    assert e.code == VERSION and e.id == 4 and "v=2" in e.message


def test_decode_reply_errors() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_reply(_raw({"op": "pong", "id": 3}))
    assert info.value.id == 3 and "version" in info.value.message
    with pytest.raises(ProtocolError):
        decode_reply(b"\xff")
    with pytest.raises(ProtocolError) as info:
        decode_reply(_raw({"op": "completions", "id": 1, "items": [{"request_id": "r",
                                                                      "kind": "lost"}]}))
    assert "$.items[0].kind" in info.value.message


def test_accepts_memoryview() -> None:
    data = encode_request(Ping(id=1))
    assert decode_request(memoryview(data)) == Ping(id=1)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_raise_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_request(data)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([r.__struct_config__.tag for r in REQUESTS]),
       st.dictionaries(st.sampled_from(["id", "v", "engine_id", "request_id", "layout",
                                        "local_block_ids", "remote", "block_ids", "readers",
                                        "regions", "mode", "tp_rank"]), _json))
def test_wrong_typed_objects_only_raise_protocol_error(op: str, fields: dict[str, object]) -> None:
    try:
        decode_request(_raw({"op": op, **fields}))
    except ProtocolError as e:
        assert e.message and e.code in (BAD_MESSAGE, VERSION)


def test_deep_nesting_is_a_protocol_error() -> None:
    head = _raw({"op": "poll", "id": 1, "v": 1, "engine_id": "d0"})
    # one more map entry: "junk" -> [[[[...0...]]]], 100k levels deep
    data = bytes([head[0] + 1]) + head[1:] + _raw("junk") + b"\x91" * 100_000 + b"\x00"
    e = _bad(data)
    assert e.code == BAD_MESSAGE and "recursion" in e.message


def test_a_ping_names_the_engines_it_keeps_alive_and_an_older_pong_states_no_lease() -> None:
    """Minor 6: ``Ping.engines`` round-trips (bounded), a minor-5 daemon ignores it
    (requests do not forbid unknown fields), and a minor-5 Pong decodes with
    ``engine_lease_s`` 0 (the keepalive then pings every 10 s)."""
    from kvsidecar.ipc.keepalive import DEFAULT_PERIOD_S, period_for
    from kvsidecar.ipc.protocol import MAX_PING_ENGINES

    ping = Ping(engines=["P-0", "D-1"], id=3)
    assert decode_request(encode_request(ping)) == ping
    with pytest.raises(ProtocolError):
        decode_request(encode_request(Ping(engines=["e"] * (MAX_PING_ENGINES + 1), id=4)))
    pong = decode_reply(msgspec.msgpack.encode(_PongV1_0(5, PROTOCOL_VERSION, ["e"])))
    assert isinstance(pong, Pong) and pong.engine_lease_s == 0.0
    assert period_for(pong.engine_lease_s) == DEFAULT_PERIOD_S
    assert period_for(30.0) == 10.0
