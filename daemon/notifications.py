"""The completion notification a D rank sends each candidate P rank once per request.

It rides on the NIXL READ (delivered when the read completes) or goes alone
through ``send_notif`` when nothing was read from that rank. It names the P
engine and request it is for (one P sidecar may serve several engines), and
the reading engine, rank and tp size, so the P side knows how many
notifications to expect from that engine without having been told.
"""

from __future__ import annotations

import msgspec

NOTIF_VERSION = 1


class ReadDone(msgspec.Struct, array_like=True, frozen=True):
    v: int
    target_engine: str
    request_id: str
    reader_engine: str
    reader_rank: int
    reader_tp: int


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(ReadDone)


class BadNotification(ValueError):
    """Bytes from a peer that are not a notification of ours."""


def encode(
    target_engine: str, request_id: str, reader_engine: str, reader_rank: int, reader_tp: int
) -> bytes:
    return _enc.encode(
        ReadDone(NOTIF_VERSION, target_engine, request_id, reader_engine, reader_rank, reader_tp)
    )


def decode(data: bytes) -> ReadDone:
    try:
        msg = _dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadNotification(f"undecodable notification ({len(data)} bytes): {e}") from None
    if msg.v != NOTIF_VERSION:
        raise BadNotification(f"notification version {msg.v}, expected {NOTIF_VERSION}")
    if msg.reader_tp < 1 or not 0 <= msg.reader_rank < msg.reader_tp:
        raise BadNotification(f"reader rank {msg.reader_rank} outside tp {msg.reader_tp}")
    return msg
