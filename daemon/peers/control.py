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
cannot be later than P's deadline (receipt happens after ``t0``).

Wire (msgpack)::

    DEALER -> ROUTER   {"op": "claim"|"abandon", engine_id, tp_rank, agent_name,
                        request_id, reader_engine, reader_rank, reader_tp,
                        [reason], req_id, v}
    ROUTER -> DEALER   {"type": "control", granted, lease_s, reason, req_id, v}

``agent_name`` is the P rank's NIXL agent that D linked to: a P engine that
re-registered since (new agent, new memory) refuses, so D never takes a
lease on memory other than the memory it will read.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeAlias

import msgspec
from msgspec import Meta

CONTROL_VERSION = 1

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
    req_id: int = 0
    v: int = CONTROL_VERSION


class Claim(_Control, tag="claim", frozen=True, kw_only=True):
    """Claim or renew a lease on the hold of ``request_id`` at P rank ``tp_rank``."""


class Abandon(_Control, tag="abandon", frozen=True, kw_only=True):
    """The reader's read of this P rank failed or was aborted and nothing of it is
    in flight any more: count this reader rank as finished (failed)."""

    reason: Annotated[str, Meta(max_length=1024)] = ""


ControlRequest: TypeAlias = Claim | Abandon


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


class _Op(msgspec.Struct):
    op: str = ""
    req_id: int = 0


_encoder = msgspec.msgpack.Encoder()
_request_decoder: msgspec.msgpack.Decoder[ControlRequest] = msgspec.msgpack.Decoder(ControlRequest)
_reply_decoder = msgspec.msgpack.Decoder(ControlReply)
_op_decoder = msgspec.msgpack.Decoder(_Op)

Op = Literal["claim", "abandon"]


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


def encode(msg: ControlRequest | ControlReply) -> bytes:
    return _encoder.encode(msg)


def decode_request(frame: bytes) -> ControlRequest:
    try:
        msg: ControlRequest = _request_decoder.decode(frame)
    except _UNDECODABLE as e:
        raise BadControl(f"invalid control message: {e}") from None
    if msg.v != CONTROL_VERSION:
        raise BadControl(f"control message v{msg.v}, this side speaks v{CONTROL_VERSION}")
    return msg


def decode_reply(frame: bytes) -> ControlReply:
    try:
        return _reply_decoder.decode(frame)
    except _UNDECODABLE as e:
        raise BadControl(f"invalid control reply: {e}") from None
