"""Byte verification (``--verify-bytes``): digests of exactly the bytes a read's plan moves.

What is digested: the pieces of one D rank's plan for one P rank, each
``(region, offset, length)`` relative to the start of the region on that
side (:class:`~kvsidecar.daemon.planner.RankRead`: P's side is
``remote_offset``, D's is ``local_offset``, the same region index and length),
concatenated in the plan's order into one byte stream. The stream is cut
into chunks of ``chunk_bytes`` and each chunk hashed with XXH3-64; a digest
is those hashes, packed little-endian. Coalescing or cutting a piece in two
changes nothing (the stream is the same bytes in the same order), and the
chunks let a large read hash on several threads.

So P digests its side of the plan and D digests its side once everything
landed (staged pieces scattered): equal digests mean every byte of every
piece arrived where the plan put it, whatever the TP pair (a slice of P, a
gather from several P ranks, Mamba's 3-read conv state, a prefix skip).

A :class:`Digester` reads one kind of memory. Host memory (DRAM) has
:class:`HostDigester`; GPU memory will want a CUDA kernel over the device
pointers (the same stream, the same chunks) and has none yet:
:func:`digester_for` says so, and ``--verify-bytes`` with ``--device cuda:N``
is refused at start-up.

Pure functions and a thin blocking shell (the caller runs :func:`digest` on
a thread); nothing here touches the event loop.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Final, Protocol

import numpy as np
import xxhash
from numpy.typing import NDArray

from kvsidecar.daemon.peers.control import MAX_DIGEST_CHUNK, MAX_DIGEST_RANGES, MIN_DIGEST_CHUNK

I64 = NDArray[np.int64]

#: Stream bytes per chunk hash (D's choice, sent with each request; P accepts
#: MIN_CHUNK_BYTES..MAX_CHUNK_BYTES). 8 MiB: a 256 MiB read is 32 hashes, a
#: 16-block read one.
CHUNK_BYTES: Final = 8 << 20
MIN_CHUNK_BYTES: Final = MIN_DIGEST_CHUNK
MAX_CHUNK_BYTES: Final = MAX_DIGEST_CHUNK
#: Pieces one digest request names (24 bytes each: 48 KiB, under the peer
#: channel's 64 KiB request bound); a plan with more is asked in several requests.
MAX_RANGES: Final = MAX_DIGEST_RANGES
RANGE_BYTES: Final = 24
#: Chunk hashes one reply carries: MAX_RANGES pieces of at most a region each
#: could name more bytes than any registration holds; a request that would need
#: more hashes is refused (D asks with a larger chunk).
MAX_CHUNKS: Final = 4096

#: FAKE FAULT, tests only: D flips one byte of what landed before it digests,
#: for reads whose request id starts with this variable's value. It stands for
#: corruption on the wire, which cannot be caused for real on one host.
FAKE_FAULT_ENV: Final = "KVSIDECAR_FAKE_FAULT_FLIP_LANDED_BYTE"


class DigestUnavailable(RuntimeError):
    """This kind of memory has no digester (yet)."""


class BadRanges(ValueError):
    """Pieces a digest request may not name (malformed, outside the regions or the hold)."""


class Digester(Protocol):
    """Hashes one chunked stream of pieces of one engine rank's regions."""

    name: str

    def digest(self, regions: Sequence[NDArray[np.uint8]], region: I64, offset: I64,
               length: I64, chunk_bytes: int) -> bytes:
        """The packed chunk hashes of the stream (blocking; run it on a thread)."""


class HostDigester:
    """XXH3-64 over host memory (numpy views of the regions); releases the GIL."""

    name = "xxh3-64"

    def digest(self, regions: Sequence[NDArray[np.uint8]], region: I64, offset: I64,
               length: I64, chunk_bytes: int) -> bytes:
        return chunk_digests(regions, region, offset, length, chunk_bytes)


_HOST = HostDigester()


def digester_for(mem_type: str) -> Digester:
    """The digester of a memory type (``DRAM``, ``VRAM``); DigestUnavailable names why not."""
    if mem_type == "DRAM":
        return _HOST
    if mem_type == "VRAM":
        raise DigestUnavailable(
            "byte verification (--verify-bytes, read(verify=True)) is not available for GPU "
            "memory yet: it needs a CUDA digest kernel; host memory only")
    raise DigestUnavailable(f"byte verification knows no memory type {mem_type!r}")


def chunk_digests(regions: Sequence[NDArray[np.uint8]], region: I64, offset: I64,
                  length: I64, chunk_bytes: int) -> bytes:
    """XXH3-64 of each ``chunk_bytes`` of the pieces' concatenation, packed (u64 LE).

    An empty stream has no chunk: ``b""``."""
    out: list[int] = []
    h = xxhash.xxh3_64()
    update = h.update
    room = chunk_bytes
    # memoryview slices cost less than numpy's (~25 % of a small piece's time)
    views = [memoryview(v) for v in regions]  # type: ignore[arg-type]
    for r, o, n in zip(region.tolist(), offset.tolist(), length.tolist()):
        view = views[r]
        while n > 0:
            take = min(n, room)
            update(view[o:o + take])
            o += take
            n -= take
            room -= take
            if room == 0:
                out.append(h.intdigest())
                h.reset()
                room = chunk_bytes
    if room != chunk_bytes:
        out.append(h.intdigest())
    return np.asarray(out, dtype="<u8").tobytes()


def split_stream(region: I64, offset: I64, length: I64, chunk_bytes: int, parts: int
                 ) -> list[tuple[I64, I64, I64]]:
    """The pieces cut into up to ``parts`` runs of whole chunks (each run's
    :func:`chunk_digests`, concatenated in order, are the whole stream's), so
    several threads can hash one read. Pure and vectorised."""
    cuts = chunk_cuts(length, chunk_bytes, parts)
    if not cuts.size:
        return [(region, offset, length)]
    idx, off, size, run = cut_stream(length, cuts)
    reg, at = region[idx], offset[idx] + off
    return [(reg[run == k], at[run == k], size[run == k]) for k in range(cuts.size + 1)]


def chunk_cuts(length: I64, chunk_bytes: int, parts: int) -> I64:
    """Stream positions that cut it into up to ``parts`` runs of whole chunks
    (the last run may end in a partial chunk); empty when it is one run."""
    chunks = -(-int(length.sum()) // chunk_bytes)
    if parts < 2 or chunks < 2:
        return np.empty(0, np.int64)
    per = -(-chunks // min(parts, chunks))
    return np.arange(per, chunks, per, dtype=np.int64) * chunk_bytes


def cut_stream(length: I64, cuts: I64) -> tuple[I64, I64, I64, I64]:
    """Pieces of ``length`` bytes, in order, cut at the stream positions ``cuts``
    (sorted, inside the stream): per output piece the input piece it comes from,
    its offset in it, its size and its run (how many cuts lie at or before it).
    Apply to any arrays parallel to ``length`` (``x[idx] + off``)."""
    total = int(length.sum())
    ends = np.cumsum(length)
    starts = ends - length
    points = np.union1d(starts, cuts)
    points = points[points < total]
    idx = np.searchsorted(ends, points, side="right")
    off = points - starts[idx]
    size = np.append(points[1:], total) - points
    return idx, off, size, np.searchsorted(cuts, points, side="right")


def chunk_count(length: I64, chunk_bytes: int) -> int:
    """How many chunk hashes a digest of pieces of ``length`` bytes has."""
    return -(-int(length.sum()) // chunk_bytes)


def pack_ranges(region: NDArray[np.integer], offset: I64, length: I64) -> bytes:
    """Pieces as the wire carries them: ``(region, offset, length)`` int64 LE triples."""
    out = np.empty((length.size, 3), dtype="<i8")
    out[:, 0] = region
    out[:, 1] = offset
    out[:, 2] = length
    return out.tobytes()


def unpack_ranges(data: bytes) -> tuple[I64, I64, I64]:
    """:func:`pack_ranges` undone; BadRanges for a length that is no whole number of pieces."""
    if len(data) % RANGE_BYTES:
        raise BadRanges(f"{len(data)} bytes of pieces are not whole {RANGE_BYTES}-byte pieces")
    a = np.frombuffer(data, dtype="<i8").reshape(-1, 3).astype(np.int64)
    return a[:, 0], a[:, 1], a[:, 2]


def check_ranges(region: I64, offset: I64, length: I64, *, num_regions: int,
                 region_bytes: int, page_bytes: int, held_pages: I64) -> None:
    """Refuse pieces that reach past what the hold lets a reader read.

    Every piece must be non-empty and lie inside one region, in pages the hold
    pins (``held_pages``: sorted, unique page ids; a piece may span several
    consecutive held pages, as coalesced descriptors do). A digest is as
    revealing as the bytes (the hash of one byte is that byte), so a reader
    gets digests of nothing it could not read. Together the pieces name at most
    the bytes the hold pins (a plan reads each byte once), which bounds one
    request's hashing by its hold. Raises :class:`BadRanges`."""
    if not region.size:
        raise BadRanges("a digest request names no piece")
    if int(region.min()) < 0 or int(region.max()) >= num_regions:
        raise BadRanges(f"a piece names a region outside 0..{num_regions - 1}")
    if int(length.min()) <= 0 or int(offset.min()) < 0:
        raise BadRanges("a piece has a negative offset or a length that is not positive")
    if int(offset.max()) >= region_bytes or int(length.max()) > region_bytes:
        # checked first: a peer's offset + length near 2**63 would wrap negative below
        raise BadRanges(f"a piece reaches past the end of its region ({region_bytes} B)")
    end = offset + length  # no overflow: both are at most region_bytes now
    if int(end.max()) > region_bytes:
        raise BadRanges(f"a piece reaches past the end of its region ({region_bytes} B)")
    first = offset // page_bytes
    last = (end - 1) // page_bytes
    at = np.searchsorted(held_pages, first)
    stop = at + (last - first)
    ok = stop < held_pages.size
    ok[ok] &= (held_pages[at[ok]] == first[ok]) & (held_pages[stop[ok]] == last[ok])
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise BadRanges(f"a piece (region {int(region[bad])}, offset {int(offset[bad])}, "
                        f"{int(length[bad])} B) lies outside the pages the hold pins")
    # A reader's plan names each byte once: more than the hold pins in all regions
    # is the same bytes again (one request would hash a page up to MAX_RANGES times).
    pinned = int(held_pages.size) * page_bytes * num_regions
    if sum(length.tolist()) > pinned:
        raise BadRanges(f"the pieces name more bytes than the hold pins ({pinned} B)")


def held_pages(block_ids: Sequence[Sequence[int]]) -> I64:
    """The sorted, unique pages a hold's block ids (one list per group) name."""
    ids = [np.asarray(g, dtype=np.int64) for g in block_ids if len(g)]
    if not ids:
        return np.empty(0, np.int64)
    return np.unique(np.concatenate(ids))


def unpack_digest(data: bytes) -> NDArray[np.uint64]:
    return np.frombuffer(data[:len(data) // 8 * 8], dtype="<u8")


def first_difference(a: bytes, b: bytes) -> int:
    """The first chunk whose hashes differ (-1 when equal; a count mismatch
    differs at the shorter one's end)."""
    x, y = unpack_digest(a), unpack_digest(b)
    n = min(x.size, y.size)
    diff = np.flatnonzero(x[:n] != y[:n])
    if diff.size:
        return int(diff[0])
    return -1 if x.size == y.size else n


def fake_fault_prefix() -> str:
    """The FAKE FAULT's request id prefix ('' when off): see :data:`FAKE_FAULT_ENV`."""
    return os.environ.get(FAKE_FAULT_ENV, "")


def flip_one_byte(regions: Sequence[NDArray[np.uint8]], region: I64, offset: I64) -> None:
    """FAKE FAULT: invert the first byte of the first piece (what a bad wire would do)."""
    if region.size:
        view = regions[int(region[0])]
        o = int(offset[0])
        view[o] ^= 0xFF
