"""Reads of one flush to the same P agent as one NIXL transfer with one
notification naming them all (issue #12): the pure grouping and the batched
notification's encoding and checks."""

from __future__ import annotations

import msgspec
import pytest

from kvsidecar.daemon import notifications
from kvsidecar.daemon.notifications import (
    MAX_NOTIF_BYTES,
    MAX_NOTIF_READS,
    BadNotification,
    ReadDone,
)
from kvsidecar.daemon.peers.messages import decode_info, encode, make_handshake_info
from kvsidecar.daemon.transport.merging import group_posts
from kvsidecar.ipc.layout import attention_layout


def _note(rid: str, rank: int = 0) -> bytes:
    return notifications.encode("P", rid, "D", rank, 2)


def test_posts_to_one_agent_share_a_group_and_others_stay_apart() -> None:
    keys = ["a", "b", "a", None, "a", "b"]
    assert group_posts(keys, [8] * 6, [10] * 6, 1000) == [[0, 2, 4], [1, 5], [3]]


def test_a_group_closes_at_the_smallest_limit_and_the_byte_bound() -> None:
    assert group_posts(["a"] * 5, [2] * 5, [1] * 5, 1000) == [[0, 1], [2, 3], [4]]
    assert group_posts(["a"] * 4, [64, 3, 64, 64], [1] * 4, 1000) == [[0, 1, 2], [3]]
    assert group_posts(["a"] * 4, [64] * 4, [40] * 4, 100) == [[0, 1], [2, 3]]


def test_a_post_that_cannot_merge_goes_alone() -> None:
    # limit below 2 (an older peer: 0), or one notification over the bound
    assert group_posts(["a", "a", "a"], [0, 0, 0], [1, 1, 1], 100) == [[0], [1], [2]]
    assert group_posts(["a", "a", "a"], [8, 8, 8], [1, 500, 1], 100) == [[0, 2], [1]]


def test_a_read_over_the_byte_bound_goes_alone_and_small_ones_still_merge() -> None:
    assert group_posts(["a"] * 5, [64] * 5, [1] * 5, 1000, [3, 7, 3, 6, 3], 6) == [
        [0, 2, 3, 4], [1]]
    # no bound: one group
    assert group_posts(["a"] * 3, [64] * 3, [1] * 3, 1000, [3, 3, 7], None) == [[0, 1, 2]]


def test_a_batch_round_trips_and_is_told_apart_from_a_single_one() -> None:
    notes = [_note(f"r{i}", i % 2) for i in range(20)]  # past 15: the array16 header
    batch = notifications.join(notes)
    assert notifications.is_batch(batch)
    assert not notifications.is_batch(notes[0])
    got = notifications.decode_batch(batch)
    assert got == [ReadDone(1, "P", f"r{i}", "D", i % 2, 2) for i in range(20)]
    assert notifications.decode(notes[3]).request_id == "r3"


def test_a_bad_item_is_refused_alone() -> None:
    bad_rank = notifications.encode("P", "x", "D", 5, 2)
    bad_version = msgspec.msgpack.encode([9, "P", "y", "D", 0, 2])
    got = notifications.decode_batch(notifications.join([_note("a"), bad_rank, bad_version,
                                                         _note("b")]))
    assert [g.request_id for g in got if isinstance(g, ReadDone)] == ["a", "b"]
    assert [type(g) for g in got] == [ReadDone, BadNotification, BadNotification, ReadDone]
    with pytest.raises(BadNotification):
        notifications.decode(bad_rank)


@pytest.mark.parametrize("data, why", [
    (b"\x92\x02garbage", "undecodable"),
    (b"\x92\x02\x90", "names 0 reads"),
    (notifications.join([_note("a")] * (MAX_NOTIF_READS + 1)), f"limit is {MAX_NOTIF_READS}"),
    (notifications.join([_note("a" * 2000)] * 9), f"limit is {MAX_NOTIF_BYTES}"),
    (b"\x92\x02\x91\x93\x01\x02\x03", "undecodable"),
])
def test_a_malformed_or_oversize_batch_is_refused_whole(data: bytes, why: str) -> None:
    with pytest.raises(BadNotification, match=why):
        notifications.decode_batch(data)


def test_handshake_info_advertises_batched_notifications_and_an_older_one_does_not() -> None:
    info = make_handshake_info(engine_id="e", tp_rank=0, agent_name="a", agent_metadata=b"m",
                               layout=attention_layout(model="m", num_layers=1,
                                                       total_kv_heads=2, head_dim=8,
                                                       block_tokens=4, tp_size=1,
                                                       num_blocks=4),
                               bases=[0], daemon_id="d")
    assert info.notif_batch_reads == MAX_NOTIF_READS
    old = msgspec.msgpack.decode(encode(info))
    del old["notif_batch_reads"]
    assert decode_info(msgspec.msgpack.encode(old)).notif_batch_reads == 0
