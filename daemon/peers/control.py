"""D -> P control messages on the peer (handshake) channel: hold leases and abandons.

A reading D rank *claims* the hold of each P rank it will read before it
posts, *renews* the claim while its read is pending (the same message), and
*abandons* when its read failed or was aborted, so that P releases the hold
at once instead of waiting for its deadline. Each is one request/reply on
the DEALER/ROUTER pair the handshake already uses (and that the security
work authenticates), told apart from a handshake request by its ``op`` field.

Lease arithmetic without clock sync: D notes its monotonic ``t0`` before it
sends a claim; P grants ``lease_s`` seconds from the moment it receives it;
D treats the lease as valid until ``t0 + lease_s`` on its own clock, which
cannot be later than P's deadline (receipt happens after ``t0``). For a
claim that travelled in a batch, ``t0`` is when the batch was sent: P
receives (and grants) every item of it later than that.

Wire (msgpack)::

    DEALER -> ROUTER   {"op": "claim"|"abandon", engine_id, tp_rank, agent_name,
                        request_id, reader_engine, reader_rank, reader_tp,
                        [reason], req_id, v, token}
    ROUTER -> DEALER   {"type": "control", granted, lease_s, reason, req_id, v}

    DEALER -> ROUTER   {"op": "digest", <claim's fields>, ranges, chunk_bytes}
    ROUTER -> DEALER   {"type": "control", granted, reason, digest, req_id, v}

    DEALER -> ROUTER   {"op": "batch", items: [claim|abandon, ...], req_id, v}
    ROUTER -> DEALER   {"type": "control_batch", replies: [control, ...], req_id, v}

A *batch* carries 1..:data:`MAX_BATCH_ITEMS` claims and abandons (no polls,
no nested batches) that one D sidecar has for one P sidecar at the same
moment, e.g. the claims of the 16 reads of one engine ``Batch``; P answers
every item on its own, in order, in one reply: one refused item never
refuses the others. Only a batch that cannot be decoded at all (junk, empty,
too many items) is refused as a whole, with one plain control reply.

Compatibility: a P sidecar that answers batches says so in its handshake
info (``HandshakeInfo.control_batch_items``, 0 or absent in an older one), and
D sends a batch only to an address whose last handshake said so; everything
else travels as single messages, exactly as before. Should a batch still get
a plain reply (the peer was replaced by an older one between handshakes), D
sends those items again one by one and stops batching to that address.

Capability and identity: every claim and abandon carries the hold token
(see :mod:`~kvsidecar.ipc.hold_token`), refused without one P's rank issued;
P binds each reading rank to the fleet member (CURVE key) of its first claim
and refuses that rank's claims, renewals and abandons from anyone else.

``agent_name`` is the P rank's NIXL agent that D linked to: a P engine that
re-registered since (new agent, new memory) refuses, so D never takes a
lease on memory other than the memory it will read.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeAlias

import msgspec
from msgspec import Meta

CONTROL_VERSION = 1

#: Most claims/abandons one batch carries (this side's decoder refuses more).
#: D's claims per P rank come in engine batches of up to 256 reads; 64 per
#: message already turns per-read messages into a few per batch.
MAX_BATCH_ITEMS = 64
#: Most bytes of one batch message D builds: half the peer channel's request
#: bound (``peers.server.MAX_REQUEST_BYTES``, 64 KiB), so a batch is never
#: refused for its size. One item is at most ~11 KiB (its strings' bounds).
MAX_BATCH_BYTES = 32 << 10
#: A batch message's bytes besides its items (map, op, items header, req_id, v).
BATCH_OVERHEAD_BYTES = 40

#: Bounds of a :class:`Digest` (see :mod:`~kvsidecar.daemon.digest`).
MAX_DIGEST_RANGES = 2048
MIN_DIGEST_CHUNK = 64 << 10
MAX_DIGEST_CHUNK = 1 << 30

Name = Annotated[str, Meta(min_length=1, max_length=256)]
Rank = Annotated[int, Meta(ge=0, le=1 << 16)]
Tp = Annotated[int, Meta(ge=1, le=1 << 16)]


class _Control(msgspec.Struct, tag_field="op", frozen=True, kw_only=True):
    engine_id: Name
    tp_rank: Rank
    #: the P rank's agent the reader linked to; empty only in an abandon from a
    #: reader that gave up before it linked (P then skips the agent check)
    agent_name: Annotated[str, Meta(max_length=256)]
    request_id: Annotated[str, Meta(max_length=1024)]
    reader_engine: Name
    reader_rank: Rank
    reader_tp: Tp
    #: a claim from a reader that admitted the request but does not read it yet
    #: (see :mod:`kvsidecar.daemon.keeps`): the same lease, but P does not get
    #: ready for a read (an older P ignores the field and does). Meaningless in
    #: an abandon; here so an abandon is made from its claim's fields.
    keep: bool = False
    req_id: int = 0
    v: int = CONTROL_VERSION
    #: the hold token the reader's engine was given (ipc/hold_token.py): P grants
    #: a claim and applies an abandon only with a token its rank issued
    token: Annotated[str, Meta(max_length=160)] = ""


class Claim(_Control, tag="claim", frozen=True, kw_only=True):
    """Claim or renew a lease on the hold of ``request_id`` at P rank ``tp_rank``."""


class Abandon(_Control, tag="abandon", frozen=True, kw_only=True):
    """The reader's read of this P rank failed or was aborted and nothing of it is
    in flight any more: count this reader rank as finished (failed)."""

    reason: Annotated[str, Meta(max_length=1024)] = ""


class Digest(_Control, tag="digest", frozen=True, kw_only=True):
    """Byte verification (:mod:`~kvsidecar.daemon.digest`): the chunk hashes of
    the pieces of this P rank that the reader's plan read, for a hold that
    pins every page they touch. Sent alone, never in a batch: P hashes on a
    thread and answers when done (:class:`ControlReply` ``digest``)."""

    #: ``(region, offset, length)`` int64 LE triples, region-relative on P
    ranges: Annotated[bytes, Meta(min_length=24, max_length=MAX_DIGEST_RANGES * 24)]
    chunk_bytes: Annotated[int, Meta(ge=MIN_DIGEST_CHUNK, le=MAX_DIGEST_CHUNK)]


ControlRequest: TypeAlias = Claim | Abandon


class ControlBatch(msgspec.Struct, tag_field="op", tag="batch", frozen=True, kw_only=True):
    """Several claims and abandons for one P sidecar, answered item by item."""

    items: Annotated[list[ControlRequest], Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]
    req_id: int = 0
    v: int = CONTROL_VERSION


class _RawBatch(msgspec.Struct, tag_field="op", tag="batch", frozen=True, kw_only=True):
    """:class:`ControlBatch` with its items already encoded: same tag and fields,
    hence the same bytes, without encoding each item a second time."""

    items: list[msgspec.Raw]
    req_id: int = 0
    v: int = CONTROL_VERSION


AnyControl: TypeAlias = Claim | Abandon | Digest | ControlBatch


class ControlReply(msgspec.Struct, tag="control", frozen=True, kw_only=True):
    """``granted`` with ``lease_s`` for a claim (True for an accepted abandon);
    refused with ``reason`` otherwise."""

    granted: bool
    lease_s: float = 0.0
    reason: str = ""
    stale_link: bool = False
    """Refused because the engine rank is not (or no longer) the one the reader
    linked to: the reader should re-link before it tries again."""
    req_id: int = 0
    v: int = CONTROL_VERSION
    #: the answer to a :class:`Digest`: its chunk hashes (u64 LE), else empty
    digest: bytes = b""
    #: a :class:`Digest` refused for now: the request's hold is not placed yet (its
    #: claim came early) or P hashes as many digests as it will; ask again shortly
    retry: bool = False


class ControlBatchReply(msgspec.Struct, tag="control_batch", frozen=True, kw_only=True):
    """One :class:`ControlReply` per item of a :class:`ControlBatch`, in its order."""

    replies: list[ControlReply]
    req_id: int = 0
    v: int = CONTROL_VERSION


class _Op(msgspec.Struct):
    op: str = ""
    req_id: int = 0


_encoder = msgspec.msgpack.Encoder()
_request_decoder: msgspec.msgpack.Decoder[AnyControl] = msgspec.msgpack.Decoder(AnyControl)
_reply_decoder = msgspec.msgpack.Decoder(ControlReply)
_op_decoder = msgspec.msgpack.Decoder(_Op)

Op = Literal["claim", "abandon", "digest", "batch"]


class BadControl(ValueError):
    """Bytes that are not a valid control message."""


#: What decoding hostile bytes can raise: msgspec's errors, and UnicodeDecodeError
#: for a str field that is not UTF-8 (msgspec lets that one through).
_UNDECODABLE = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError)


def op_of(frame: bytes) -> str:
    """The ``op`` of a peer-channel request ('' for a handshake request or junk)."""
    try:
        return _op_decoder.decode(frame).op
    except _UNDECODABLE:
        return ""


def request_id_of(frame: bytes) -> int:
    """The ``req_id`` of a control message, as far as it can be read (0 if not)."""
    try:
        return _op_decoder.decode(frame).req_id
    except _UNDECODABLE:
        return 0


def encode(msg: AnyControl | ControlReply | ControlBatchReply) -> bytes:
    return _encoder.encode(msg)


def encode_batch(items: list[bytes], req_id: int) -> bytes:
    """A batch message from items encoded with :func:`encode` (1..MAX_BATCH_ITEMS)."""
    if not 1 <= len(items) <= MAX_BATCH_ITEMS:
        raise ValueError(f"a control batch carries 1..{MAX_BATCH_ITEMS} items, "
                         f"got {len(items)}")
    return _encoder.encode(_RawBatch(items=[msgspec.Raw(i) for i in items], req_id=req_id))


def decode_request(frame: bytes) -> AnyControl:
    """A claim, an abandon or a batch of them; :class:`BadControl` for anything else
    (a batch with no items, more than :data:`MAX_BATCH_ITEMS`, or a batch inside)."""
    try:
        msg: AnyControl = _request_decoder.decode(frame)
    except _UNDECODABLE as e:
        raise BadControl(f"invalid control message: {str(e)[:300]}") from None
    if msg.v != CONTROL_VERSION:
        raise BadControl(f"control message v{msg.v}, this side speaks v{CONTROL_VERSION}")
    return msg


def decode_reply(frame: bytes) -> ControlReply:
    try:
        return _reply_decoder.decode(frame)
    except _UNDECODABLE as e:
        raise BadControl(f"invalid control reply: {e}") from None
