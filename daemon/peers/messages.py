"""The sidecar-to-sidecar handshake: who a peer rank is and what its KV memory looks like.

A D sidecar must learn a P rank's NIXL agent metadata, layout and region base
addresses before it can read from it. That exchange is one small request/reply
over ZMQ TCP, kept separate from the transfer path so that a slow or dead peer
costs a bounded wait (the client's timeout) and nothing else.

Wire protocol (msgpack via msgspec, one frame each way)::

    DEALER -> ROUTER   HandshakeRequest{engine_id, tp_rank, v, req_id}
    ROUTER -> DEALER   {"type": "reply", info, req_id, v}          (HandshakeReply)
                     | {"type": "error", code, message, req_id, v}  (HandshakeError)

``req_id`` lets one DEALER per peer address carry many concurrent requests;
``v`` is checked before anything else so that a version skew is reported as
such instead of as an undecodable message.

This module holds the messages and the checks on them; ``server.py`` answers
requests, ``client.py`` sends them, ``links.py`` turns answers into NIXL peers.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection
from typing import Literal

import msgspec
import numpy as np
from numpy.typing import NDArray

from kvsidecar import __version__
from kvsidecar.daemon.notifications import MAX_NOTIF_READS
from kvsidecar.daemon.peers.control import MAX_BATCH_ITEMS, ControlBatchReply, ControlReply
from kvsidecar.ipc.layout import (
    Fingerprinted,
    IncompatibleLayout,
    Layout,
    LayoutError,
    as_fingerprinted,
    compare_facts,
    fingerprint_fields,
    fingerprint_of,
    validate,
)
from kvsidecar.ipc.region_checks import as_int64, first_close_pair, first_outside

HANDSHAKE_VERSION = 1

ErrorCode = Literal["unknown_engine", "bad_message", "version", "internal"]

__all__ = [
    "HANDSHAKE_VERSION",
    "ErrorCode",
    "HandshakeError",
    "HandshakeFailed",
    "HandshakeInfo",
    "HandshakeReply",
    "HandshakeRequest",
    "IncompatibleLayout",
    "RawReply",
    "Reader",
    "accept_peer",
    "check_peer",
    "checks_cost",
    "decode_info",
    "decode_reply",
    "decode_request",
    "encode",
    "make_handshake_info",
    "new_daemon_id",
    "refuse_mem_type",
    "salvage",
]


class HandshakeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a peer needs to read this rank's KV memory with NIXL.

    Keyword-only so the field order can follow meaning rather than defaults.
    ``bases[r]`` is the base address of region ``r``; ``fingerprint`` is
    ``fingerprint(layout)``, sent so a peer can compare models without
    rebuilding the fields. ``mem_type`` (``DRAM``/``VRAM``), ``dev_id`` (the
    CUDA ordinal in the peer's process, what its NIXL descriptors carry) and
    ``device_uuid`` (the GPU, '' for host memory) say what kind of memory the
    regions are, so the reader builds remote descriptors of that type.
    ``daemon_id`` changes on every daemon start, which is how a client notices
    that the addresses it cached are stale. ``control_batch_items`` is the most
    claims/abandons this sidecar answers in one control batch (see
    :mod:`~kvsidecar.daemon.peers.control`); 0, which is what an older
    sidecar's info decodes to, means single messages only.
    ``notif_batch_reads`` is the most reads this sidecar accepts named in one
    batched completion notification (see :mod:`~kvsidecar.daemon.notifications`);
    a reader merges the reads it posts to this rank in one flush into one NIXL
    transfer only when it is 2 or more. 0 (an older sidecar) means one
    notification per read. ``sidecar_version`` is the answering sidecar's
    ``kvsidecar.__version__`` (for logs and ``kvsidecar status``; nothing
    depends on it); an older sidecar's info decodes to "".
    """

    engine_id: str
    tp_rank: int
    tp_size: int
    agent_name: str
    agent_metadata: bytes
    layout: Layout
    bases: list[int]
    mem_type: str = "DRAM"
    dev_id: int = 0
    device_uuid: str = ""
    fingerprint: str
    protocol: int = HANDSHAKE_VERSION
    daemon_id: str
    control_batch_items: int = 0
    notif_batch_reads: int = 0
    sidecar_version: str = ""
    #: the checking half of this rank's hold key (:mod:`~kvsidecar.ipc.hold_token`):
    #: a reader checks the hold token of every read against it before posting;
    #: empty from a sidecar that issues no tokens (its reads are refused)
    hold_key: bytes = b""


class HandshakeRequest(msgspec.Struct, frozen=True):
    """Ask a sidecar for one rank's :class:`HandshakeInfo`.

    The ``reader_*`` fields declare who will read: the asking sidecar's engine,
    rank and the NIXL agent name that rank reads (and notifies) with. The
    answering sidecar accepts completion notifications for ``engine_id`` from
    that reader only when NIXL reports them sent by that agent.
    """

    engine_id: str
    tp_rank: int
    v: int = HANDSHAKE_VERSION
    req_id: int = 0
    reader_engine: str = ""
    reader_rank: int = -1
    reader_agent: str = ""


class Reader(msgspec.Struct, frozen=True):
    """A reading engine rank as declared in a handshake request."""

    engine_id: str
    tp_rank: int
    agent: str


class HandshakeReply(msgspec.Struct, frozen=True, tag="reply"):
    """The success branch of the reply union."""

    info: HandshakeInfo
    req_id: int = 0
    v: int = HANDSHAKE_VERSION


class HandshakeError(msgspec.Struct, frozen=True, tag="error"):
    """The failure branch of the reply union; ``message`` is meant for humans."""

    code: ErrorCode
    message: str
    req_id: int = 0
    v: int = HANDSHAKE_VERSION


class RawReply(msgspec.Struct, frozen=True, tag="reply"):
    """:class:`HandshakeReply` with ``info`` left encoded.

    Same tag and fields, hence the same bytes: the server splices in its cached
    encoding of the info, and the client checks ``v`` and ``req_id`` before
    trusting the info's schema.
    """

    info: msgspec.Raw
    req_id: int = 0
    v: int = HANDSHAKE_VERSION


class _Envelope(msgspec.Struct):
    """Whatever can be salvaged from a message that failed to decode, to route the error."""

    req_id: int = 0
    v: int = -1


_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode
_request_decoder = msgspec.msgpack.Decoder(HandshakeRequest)
decode_request = _request_decoder.decode
AnyReply = RawReply | HandshakeError | ControlReply | ControlBatchReply
"""What comes back on the peer channel: a handshake reply or a control reply."""
_reply_decoder: msgspec.msgpack.Decoder[AnyReply] = msgspec.msgpack.Decoder(AnyReply)
decode_reply = _reply_decoder.decode
_info_decoder = msgspec.msgpack.Decoder(HandshakeInfo)
decode_info = _info_decoder.decode
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


def salvage(frame: bytes) -> _Envelope:
    try:
        return _envelope_decoder.decode(frame)
    except Exception:  # DecodeError, UnicodeDecodeError, anything: there is no envelope
        return _Envelope()


def short(text: str, n: int = 64) -> str:
    """A prefix of input quoted back to a peer, never the whole of it."""
    return repr(text) if len(text) <= n else f"{text[:n]!r}... ({len(text)} characters)"


def new_daemon_id() -> str:
    """A fresh random id for one daemon start."""
    return secrets.token_hex(8)


def make_handshake_info(
    *,
    engine_id: str,
    tp_rank: int,
    agent_name: str,
    agent_metadata: bytes,
    layout: Layout | Fingerprinted,
    bases: list[int],
    daemon_id: str,
    mem_type: str = "DRAM",
    dev_id: int = 0,
    device_uuid: str = "",
    control_batch_items: int = MAX_BATCH_ITEMS,
    notif_batch_reads: int = MAX_NOTIF_READS,
    sidecar_version: str = __version__,
    hold_key: bytes = b"",
) -> HandshakeInfo:
    """Build a :class:`HandshakeInfo` whose ``tp_size`` and ``fingerprint`` come
    from ``layout``, so they cannot drift from the layout actually sent (a
    :class:`Fingerprinted` one brings its fingerprint, computed once)."""
    facts = as_fingerprinted(layout)
    return HandshakeInfo(
        engine_id=engine_id,
        tp_rank=tp_rank,
        tp_size=facts.layout.tp_size,
        agent_name=agent_name,
        agent_metadata=agent_metadata,
        layout=facts.layout,
        bases=list(bases),
        mem_type=mem_type,
        dev_id=dev_id,
        device_uuid=device_uuid,
        fingerprint=facts.fingerprint,
        daemon_id=daemon_id,
        control_batch_items=control_batch_items,
        sidecar_version=sidecar_version,
        notif_batch_reads=notif_batch_reads,
        hold_key=hold_key,
    )




class HandshakeFailed(RuntimeError):
    """A handshake could not produce a usable peer; ``reason`` says why.

    ``field`` names the mismatching field when the peer answered but does not
    fit (engine_id, tp_size, bases...), so callers can report it precisely.
    """

    def __init__(self, address: str, reason: str, *, field: str | None = None) -> None:
        where = f"handshake with {address} failed" if address else "handshake failed"
        super().__init__(f"{where}: {reason}")
        self.address = address
        self.reason = reason
        self.field = field


def check_peer(
    info: HandshakeInfo,
    expected_engine_id: str,
    expected_tp_size: int,
    local_layout: Layout | Fingerprinted,
    *,
    address: str = "",
    readable: Collection[str] = ("DRAM",),
) -> NDArray[np.int64]:
    """Refuse a peer that is not the engine we were told about, or holds another model;
    return its region bases as int64 (:func:`check_bases`).

    Called once per peer rank, before any NIXL setup, because a mismatch found
    later shows up as silently wrong KV bytes rather than an error. With
    ``local_layout`` :class:`Fingerprinted` (the registration's), a peer that
    fits costs O(groups + segments + the regions its segments name + its
    bases), never a fingerprint: equal facts hash alike, so the peer's claimed
    fingerprint is checked against the local one. Only a peer that does not
    fit has its layout hashed, to say which of the two it got wrong.
    """

    def fail(fld: str, reason: str) -> HandshakeFailed:
        return HandshakeFailed(address, f"{fld} mismatch: {reason}", field=fld)

    if info.protocol != HANDSHAKE_VERSION:
        raise fail("protocol", f"peer speaks v{info.protocol}, we speak v{HANDSHAKE_VERSION}")
    if info.engine_id != expected_engine_id:
        raise fail("engine_id", f"expected {expected_engine_id!r}, peer is {info.engine_id!r}")
    if info.tp_size != expected_tp_size:
        raise fail(
            "tp_size",
            f"engine {expected_engine_id!r} was announced with tp_size {expected_tp_size}, "
            f"the peer reports tp_size {info.tp_size}",
        )
    if info.layout.tp_size != info.tp_size:
        raise fail(
            "tp_size",
            f"peer reports tp_size {info.tp_size} but its layout says {info.layout.tp_size}",
        )
    if info.mem_type not in readable:
        raise fail("mem_type", refuse_mem_type(info.mem_type, info.device_uuid, readable))
    if info.mem_type == "VRAM" and not info.device_uuid:
        raise fail("device_uuid", "peer serves VRAM without naming its GPU")
    if not 0 <= info.tp_rank < info.tp_size:
        raise fail("tp_rank", f"rank {info.tp_rank} outside tp_size {info.tp_size}")
    local = as_fingerprinted(local_layout)
    remote = fingerprint_fields(info.layout)
    remote_fp = info.fingerprint
    if remote_fp != local.fingerprint:  # it does not fit: find out how, at any cost
        remote_fp = fingerprint_of(remote)
        if info.fingerprint != remote_fp:
            raise fail(
                "fingerprint",
                f"peer sent fingerprint {info.fingerprint} but its layout hashes to {remote_fp}",
            )
    # compare_facts names the field; it also checks tp divisibility, which
    # the fingerprint deliberately leaves out, so it runs even on a match.
    compare_facts(local.fields, remote, local.layout.tp_size, info.layout.tp_size)
    if local.fingerprint != remote_fp:  # pragma: no cover - equal facts, unequal reprs
        raise IncompatibleLayout("fingerprint", local.fingerprint, remote_fp)
    if len(info.bases) != info.layout.num_regions:
        raise fail(
            "bases",
            f"{len(info.bases)} base addresses for {info.layout.num_regions} regions",
        )
    return check_bases(info.bases, info.layout.region_bytes, fail)


#: An info whose checks visit more numbers than this (bases, named regions,
#: segments) is checked off the event loop (:func:`checks_cost`): ~0.3 ms of
#: checks, about what a hop to a thread and back costs.
OFF_LOOP_NUMBERS = 4096


def checks_cost(info: HandshakeInfo, enough: int = OFF_LOOP_NUMBERS) -> int:
    """About how many numbers :func:`accept_peer` visits for ``info``: its bases,
    its groups, its segments and the regions they name; counting stops past
    ``enough``, so this visits at most ``enough`` groups and segments whatever
    the peer sent (a million empty groups, which :func:`validate` refuses at
    once, are not walked on the loop)."""
    groups = info.layout.groups
    n = len(info.bases) + len(groups)
    if n > enough:
        return n
    for g in groups:  # at most ``enough`` of them
        n += len(g.segments)
        for s in g.segments:
            n += len(s.regions)
            if n > enough:
                return n
    return n


def accept_peer(
    info: HandshakeInfo,
    expected_engine_id: str,
    expected_tp_size: int,
    local_layout: Layout | Fingerprinted,
    *,
    address: str = "",
    readable: Collection[str] = ("DRAM",),
) -> NDArray[np.int64]:
    """Everything a link checks of a peer's answer before loading its agent:
    its layout is valid (:func:`~kvsidecar.ipc.layout.validate`), then
    :func:`check_peer`; returns its bases as int64. Pure and thread-safe
    (``local_layout`` is immutable): a large info is checked on a thread."""
    try:
        validate(info.layout)
    except LayoutError as e:
        raise HandshakeFailed(address, f"peer sent an invalid layout: {e}") from None
    return check_peer(info, expected_engine_id, expected_tp_size, local_layout,
                      address=address, readable=readable)


def refuse_mem_type(mem_type: str, device_uuid: str, readable: Collection[str]) -> str:
    """Why a sidecar that reads ``readable`` memory cannot serve a peer's ``mem_type``.

    A host-memory sidecar has no CUDA context: UCX could at best stage GPU
    bytes through a software path, silently 100x slower, or fail mid-read. It
    refuses at the handshake instead, saying what would make it work.
    """
    where = f" on GPU {device_uuid}" if device_uuid else ""
    if mem_type == "VRAM":
        return (f"peer serves VRAM{where}; this sidecar reads {'/'.join(readable)} only "
                "(run the reading side with --device cuda:N and the gpu extra)")
    return f"peer serves memory of unknown type {mem_type!r}; this sidecar reads " \
           f"{'/'.join(readable)}"


#: Descriptors are int64 on the way into NIXL: a region must end below 2**63.
_ADDRESS_LIMIT = 1 << 63


def check_bases(bases: list[int], region_bytes: int,
                fail: Callable[[str, str], Exception]) -> NDArray[np.int64]:
    """Each region ``[base, base + region_bytes)`` lies inside the int64 address
    space, above 0, and no two overlap. Checked before any descriptor is built
    from them: a peer's numbers are input, and an overflowing or overlapping
    region would otherwise surface as a NIXL error (or a read of the wrong bytes).

    Returns the bases as int64 (what a link keeps). Vectorised
    (:mod:`~kvsidecar.ipc.region_checks`); the first bad region and the first
    overlapping pair in address order are the ones a loop over them names."""
    if region_bytes <= 0:
        raise fail("bases", f"region size {region_bytes} is not positive")
    arr = as_int64(bases)
    bad = (next(r for r, b in enumerate(bases) if not 0 < b <= _ADDRESS_LIMIT - region_bytes)
           if arr is None else first_outside(arr, 0, _ADDRESS_LIMIT - region_bytes))
    if bad is not None:
        raise fail("bases", f"region {bad} at {bases[bad]:#x} + {region_bytes} B lies outside "
                            "the address space")
    assert arr is not None  # every base fits (0, 2**63): so does the array
    pair = first_close_pair(arr, region_bytes)
    if pair is not None:
        lo, hi = pair
        raise fail("bases", f"regions at {lo:#x} and {hi:#x} overlap "
                            f"({region_bytes} B each)")
    return arr
