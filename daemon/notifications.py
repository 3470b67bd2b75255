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
    checked = _check(msg)
    if isinstance(checked, BadNotification):
        raise checked
    return checked


# -- several reads in one notification ------------------------------------------------------------
#
# A D rank that reads several requests' blocks from one P agent in one loop
# iteration posts them as ONE NIXL transfer (the cost of a transfer is per
# call, not per descriptor), so that transfer carries ONE notification naming
# every read in it: ``[BATCH_VERSION, [ReadDone, ...]]``. Only peers whose
# handshake advertised ``notif_batch_reads`` get one, never more reads than
# that in it and never more than MAX_NOTIF_BYTES. A single notification starts
# with the 6-element array header, a batch with a 2-element one and
# BATCH_VERSION, so the first two bytes tell them apart without a trial decode.

BATCH_VERSION = 2
#: the most reads one batched notification may name (what P advertises)
MAX_NOTIF_READS = 64
#: the largest batched notification D builds and P accepts (NIXL sends it as
#: one UCX active message; this keeps it small and P's decoding cost bounded)
MAX_NOTIF_BYTES = 16384
_BATCH_HEAD = bytes((0x92, BATCH_VERSION))
#: what join() adds to its items' bytes at most (head + array32 header)
JOIN_OVERHEAD = len(_BATCH_HEAD) + 5


class ReadsDone(msgspec.Struct, array_like=True, frozen=True):
    v: int
    items: list[ReadDone]


_batch_dec = msgspec.msgpack.Decoder(ReadsDone)


def join(notes: list[bytes]) -> bytes:
    """One batched notification from single encoded ones (``encode`` output),
    spliced without decoding them: the msgpack array header, then their bytes."""
    n = len(notes)
    if n < 16:
        head = bytes((0x90 | n,))
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return b"".join([_BATCH_HEAD, head, *notes])


def is_batch(data: bytes) -> bool:
    return data[:2] == _BATCH_HEAD


def decode_batch(data: bytes, max_reads: int = MAX_NOTIF_READS
                 ) -> list[ReadDone | BadNotification]:
    """The reads a batched notification names, each checked on its own: an item
    that fails its checks comes back as its BadNotification (refused alone, the
    others still count). Raises BadNotification when the whole message is
    malformed or over the bounds (then none of it counts)."""
    if len(data) > MAX_NOTIF_BYTES:
        raise BadNotification(f"batched notification of {len(data)} bytes, "
                              f"the limit is {MAX_NOTIF_BYTES}")
    try:
        msg = _batch_dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadNotification(f"undecodable batched notification ({len(data)} bytes): "
                              f"{e}") from None
    if not 0 < len(msg.items) <= max_reads:
        raise BadNotification(f"batched notification names {len(msg.items)} reads, "
                              f"the limit is {max_reads}")
    return [_check(item) for item in msg.items]


def _check(msg: ReadDone) -> ReadDone | BadNotification:
    if msg.v != NOTIF_VERSION:
        return BadNotification(f"notification version {msg.v}, expected {NOTIF_VERSION}")
    if msg.reader_tp < 1 or not 0 <= msg.reader_rank < msg.reader_tp:
        return BadNotification(f"reader rank {msg.reader_rank} outside tp {msg.reader_tp}")
    return msg
