"""Byte verification's pure parts: digests of pieces, the pieces a hold allows,
the wire message, the flag (real sidecars: tests/e2e/test_verify_bytes.py)."""

from __future__ import annotations

import argparse

import msgspec
import numpy as np
import pytest
import xxhash

from kvsidecar.daemon import digest, settings
from kvsidecar.daemon.holds import HoldBook
from kvsidecar.daemon.peers import control

RNG = np.random.default_rng(7)
REGIONS = [RNG.integers(0, 256, 1 << 20, dtype=np.uint8) for _ in range(3)]


def _arrays(*rows: tuple[int, int, int]) -> tuple[digest.I64, digest.I64, digest.I64]:
    a = np.array(rows, dtype=np.int64).reshape(-1, 3)
    return a[:, 0], a[:, 1], a[:, 2]


def _reference(pieces: tuple[digest.I64, digest.I64, digest.I64], chunk: int) -> bytes:
    """XXH3-64 of each chunk of the pieces' bytes joined: what a digest must be."""
    stream = b"".join(REGIONS[r][o:o + n].tobytes() for r, o, n in zip(*pieces))
    return np.array([xxhash.xxh3_64_intdigest(stream[i:i + chunk])
                     for i in range(0, len(stream), chunk)], dtype="<u8").tobytes()


PIECES = _arrays((0, 100, 300_000), (2, 5_000, 200_000), (1, 0, 100), (0, 700_000, 90_000))


def test_digest_is_the_chunked_hash_of_the_pieces_joined() -> None:
    got = digest.chunk_digests(REGIONS, *PIECES, 65536)
    assert got == _reference(PIECES, 65536)
    assert len(got) == 8 * digest.chunk_count(PIECES[2], 65536) == 8 * 10


@pytest.mark.parametrize("parts", [2, 3, 5, 64])
def test_split_over_threads_gives_the_same_digest(parts: int) -> None:
    runs = digest.split_stream(*PIECES, 65536, parts)
    assert 1 < len(runs) <= parts
    assert b"".join(digest.chunk_digests(REGIONS, *r, 65536) for r in runs) == \
        _reference(PIECES, 65536)


def test_cutting_a_piece_in_two_changes_nothing() -> None:
    """Coalesced or cut descriptors hash the same (P and D may cut differently)."""
    cut = _arrays((0, 100, 1_000), (0, 1_100, 299_000), (2, 5_000, 200_000), (1, 0, 100),
                  (0, 700_000, 90_000))
    assert digest.chunk_digests(REGIONS, *cut, 65536) == \
        digest.chunk_digests(REGIONS, *PIECES, 65536)


def test_one_flipped_byte_changes_its_chunk_only() -> None:
    before = digest.chunk_digests(REGIONS, *PIECES, 65536)
    region = [r.copy() for r in REGIONS]
    region[2][5_000 + 70_000] ^= 1  # stream byte 300,000 + 70,000: chunk 5
    after = digest.chunk_digests(region, *PIECES, 65536)
    assert digest.first_difference(before, after) == 5
    assert digest.first_difference(before, before) == -1
    assert digest.first_difference(before, before[:16]) == 2


def test_empty_stream_has_no_chunk() -> None:
    assert digest.chunk_digests(REGIONS, *_arrays(), 65536) == b""


def test_pieces_round_trip_the_wire() -> None:
    data = digest.pack_ranges(*PIECES)
    assert len(data) == 4 * digest.RANGE_BYTES
    for a, b in zip(digest.unpack_ranges(data), PIECES):
        assert a.tolist() == b.tolist()
    with pytest.raises(digest.BadRanges, match="whole 24-byte pieces"):
        digest.unpack_ranges(data[:-1])


PAGE = 4096
LAYOUT = {"num_regions": 2, "region_bytes": 64 * PAGE, "page_bytes": PAGE}
HELD = digest.held_pages([[3, 4, 9], [], [4, 20]])


def test_held_pages_are_sorted_and_unique() -> None:
    assert HELD.tolist() == [3, 4, 9, 20]
    assert digest.held_pages([[], []]).size == 0


def test_pieces_inside_held_pages_pass() -> None:
    # one page; two consecutive held pages in one piece (coalesced); a slice of a page
    digest.check_ranges(*_arrays((0, 3 * PAGE, PAGE), (1, 3 * PAGE + 8, 2 * PAGE - 8),
                                 (1, 20 * PAGE + 100, 50)), held_pages=HELD, **LAYOUT)


@pytest.mark.parametrize(("piece", "why"), [
    ((0, 5 * PAGE, 10), "outside the pages the hold pins"),          # page 5 not held
    ((0, 4 * PAGE, 2 * PAGE), "outside the pages the hold pins"),    # 4 held, 5 not
    ((0, 8 * PAGE, 2 * PAGE), "outside the pages the hold pins"),    # 8 not, 9 held
    ((0, 20 * PAGE, 44 * PAGE + 1), "past the end of its region"),
    ((2, 3 * PAGE, 10), "region outside"),
    ((-1, 3 * PAGE, 10), "region outside"),
    ((0, 3 * PAGE, 0), "not positive"),
    ((0, -5, 10), "negative offset"),
])
def test_pieces_beyond_the_hold_are_refused(piece: tuple[int, int, int], why: str) -> None:
    with pytest.raises(digest.BadRanges, match=why):
        digest.check_ranges(*_arrays((0, 3 * PAGE, PAGE), piece), held_pages=HELD, **LAYOUT)


@pytest.mark.parametrize("piece", [
    (0, 3 * PAGE, 2**63 - 1),         # offset + length wraps past int64
    (0, 63 * PAGE, 2**63 - 1),
    (0, 2**62, 2**62),
    (0, 3 * PAGE, 64 * PAGE + 1),     # longer than a region
])
def test_pieces_whose_end_overflows_are_refused(piece: tuple[int, int, int]) -> None:
    """A peer's huge offset or length is a clear refusal, not an IndexError from a
    wrapped ``offset + length`` (answered 'internal error', its traceback logged)."""
    with pytest.raises(digest.BadRanges):
        digest.check_ranges(*_arrays(piece), held_pages=HELD, **LAYOUT)


def test_pieces_naming_more_bytes_than_the_hold_pins_are_refused() -> None:
    """One request may not make P hash the same held page over and over (up to
    2,048 pieces: 2,048 times the hold, on one thread, while every other digest
    waits behind its bytes): its pieces together name at most what the hold pins."""
    whole = 4 * PAGE * LAYOUT["num_regions"]  # HELD: 4 pages, in each region
    every = [(r, p * PAGE, PAGE) for r in range(2) for p in HELD.tolist()]
    digest.check_ranges(*_arrays(*every), held_pages=HELD, **LAYOUT)  # exactly the hold
    assert sum(n for *_, n in every) == whole
    with pytest.raises(digest.BadRanges, match="more bytes than the hold pins"):
        digest.check_ranges(*_arrays(*every, (0, 3 * PAGE, 1)), held_pages=HELD, **LAYOUT)
    with pytest.raises(digest.BadRanges, match="more bytes than the hold pins"):
        digest.check_ranges(*_arrays(*[(0, 3 * PAGE, PAGE)] * control.MAX_DIGEST_RANGES),
                            held_pages=HELD, **LAYOUT)


def test_nothing_held_refuses_everything() -> None:
    with pytest.raises(digest.BadRanges, match="outside the pages"):
        digest.check_ranges(*_arrays((0, 0, 1)), held_pages=np.empty(0, np.int64), **LAYOUT)
    with pytest.raises(digest.BadRanges, match="names no piece"):
        digest.check_ranges(*_arrays(), held_pages=HELD, **LAYOUT)


def test_gpu_memory_has_no_digester_yet() -> None:
    assert digest.digester_for("DRAM").name == "xxh3-64"
    with pytest.raises(digest.DigestUnavailable, match="not available for GPU memory yet"):
        digest.digester_for("VRAM")


def _digest_msg(ranges: bytes, chunk: int = digest.CHUNK_BYTES) -> control.Digest:
    return control.Digest(engine_id="P", tp_rank=0, agent_name="a", request_id="r",
                          reader_engine="D", reader_rank=1, reader_tp=2, ranges=ranges,
                          chunk_bytes=chunk)


def test_digest_message_round_trips_and_is_bounded() -> None:
    msg = _digest_msg(digest.pack_ranges(*PIECES))
    assert control.decode_request(control.encode(msg)) == msg
    too_many = digest.pack_ranges(*_arrays(*[(0, 0, 1)] * (digest.MAX_RANGES + 1)))
    with pytest.raises(control.BadControl):
        control.decode_request(control.encode(_digest_msg(too_many)))
    with pytest.raises(control.BadControl):
        control.decode_request(control.encode(_digest_msg(b"x" * 24, chunk=1)))
    # never inside a batch: a batch carries claims and abandons only
    batch = control.encode_batch([control.encode(msg)], 1)
    with pytest.raises(control.BadControl):
        control.decode_request(batch)
    reply = control.ControlReply(granted=True, digest=b"\x01" * 8)
    assert msgspec.msgpack.decode(control.encode(reply), type=control.ControlReply) == reply


def test_hold_knows_its_blocks_while_it_lives() -> None:
    done: list[object] = []
    book = HoldBook(default_timeout_s=10, grace_s=5, on_done=done.append, lease_s=4)
    book.add("P", "r", 1, 1, None, 0.0, block_ids=[[3, 4], [9]])
    assert book.blocks("P", "r") == [[3, 4], [9]]
    assert book.blocks("P", "other") is None
    assert book.claim("P", "r", 1.0).granted
    assert book.release("P", "r", 2.0)  # a lease still runs: released, not ended
    assert book.blocks("P", "r") is None
    assert book.claim("P", "early", 0.0).granted and book.waiting("P", "early")


def _parse(argv: list[str]) -> settings.Settings:
    p = argparse.ArgumentParser()
    settings.add_arguments(p)
    return settings.from_args(p.parse_args(argv))


def test_verify_bytes_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSIDECAR_VERIFY_BYTES", raising=False)
    assert _parse([]).verify_bytes is False
    assert _parse(["--verify-bytes"]).verify_bytes is True
    monkeypatch.setenv("KVSIDECAR_VERIFY_BYTES", "1")
    assert _parse([]).verify_bytes is True
    with pytest.raises(settings.ConfigError, match="not available for GPU memory yet"):
        _parse(["--device", "cuda:0"])


def test_pipeline_cuts_a_large_post_into_parts_of_whole_chunks() -> None:
    """A verified read's large post, cut for hashing as it lands: the parts carry
    exactly the post's bytes (same local and remote addresses), and their pieces'
    digests joined equal the digest P computes of the whole post."""
    from kvsidecar.daemon.d_side.addresses import build_posts
    from kvsidecar.daemon.d_side.parts import pipeline
    from kvsidecar.daemon.planner import plan_read
    from kvsidecar.ipc.layout import attention_layout

    layout = attention_layout(model="pipe", num_layers=2, total_kv_heads=8, head_dim=64,
                              block_tokens=16, tp_size=1, num_blocks=64)
    ids = [[b for b in range(64) if b % 5 != 3]]  # gaps: several descriptors
    plan = plan_read(layout, 0, layout, ids, ids)
    bases = np.arange(1, layout.num_regions + 1, dtype=np.int64) << 32
    posts = build_posts(plan, bases, {0: bases + (1 << 40)})
    chunk = 64 << 10
    got = pipeline(posts, plan, chunk, min_bytes=256 << 10)
    assert got is not None
    parts, owner, mine, pieces = got
    assert owner == [0] * len(parts) and mine == list(range(len(parts))) and len(parts) > 2
    post, rr = posts[0], plan.reads[0]
    # the parts' bytes, in order, are the post's bytes
    for field in ("local", "remote"):
        whole = np.concatenate([getattr(p, field) for p in parts])
        lengths = np.concatenate([p.length for p in parts])
        ends = np.cumsum(lengths)
        assert ends[-1] == post.nbytes == sum(p.nbytes for p in parts)
        src = np.repeat(np.arange(post.length.size), post.length)  # byte -> descriptor
        at = getattr(post, field)[src] + (np.arange(post.nbytes) - np.repeat(
            np.cumsum(post.length) - post.length, post.length))
        mine_at = np.repeat(whole, lengths) + (np.arange(post.nbytes) - np.repeat(
            ends - lengths, lengths))
        assert np.array_equal(at, mine_at), field
    # every part but the last holds whole chunks; digests of parts joined = whole
    assert all(p.nbytes % chunk == 0 for p in parts[:-1])
    regions = [RNG.integers(0, 256, layout.region_bytes, dtype=np.uint8)
               for _ in range(layout.num_regions)]
    whole_digest = digest.chunk_digests(regions, rr.region.astype(np.int64), rr.local_offset,
                                        rr.length, chunk)
    assert b"".join(digest.chunk_digests(regions, *p, chunk) for p in pieces) == whole_digest
    for p, (region, loff, _) in zip(parts, pieces):
        assert np.array_equal(p.local, bases[region] + loff)
    # small posts, several posts with bytes, too many pieces: not cut
    assert pipeline(posts, plan, chunk, min_bytes=post.nbytes + 1) is None
    assert pipeline([*posts, *posts], plan, chunk, min_bytes=256 << 10) is None
