"""PieceCache: the pieces of a pair of layouts are built once while cached,
found by identity (never by an equal copy), and at most ``size`` are kept,
the least recently used out first."""

from __future__ import annotations

import msgspec

from kvsidecar.daemon.planner import PieceCache, plan_read, rank_pieces

from .test_planner_cases import small_hybrid


def test_a_hit_is_the_same_pieces_and_an_equal_copy_is_a_miss() -> None:
    cache = PieceCache()
    P, D = small_hybrid(1), small_hybrid(2)
    first = cache.get(D, 1, P)
    assert cache.get(D, 1, P) is first and len(cache) == 1
    copy = msgspec.structs.replace(D)
    assert copy == D and copy is not D
    again = cache.get(copy, 1, P)
    assert again is not first and len(cache) == 2
    assert cache.get(D, 0, P) is not first and len(cache) == 3  # the D rank is part of the key
    for (p, groups), (q, want) in zip(first, rank_pieces(D, 1, P)):
        assert p == q and [g[0] for g in groups] == [g[0] for g in want]
        assert all(not a.flags.writeable for g in groups for a in g[1:])


def test_the_least_recently_used_goes_first_beyond_the_bound() -> None:
    cache = PieceCache(size=2)
    P = small_hybrid(1)
    a, b, c = small_hybrid(2), small_hybrid(2), small_hybrid(2)
    pa = cache.get(a, 0, P)
    pb = cache.get(b, 0, P)
    assert cache.get(a, 0, P) is pa  # a is now the most recently used
    pc = cache.get(c, 0, P)  # b goes
    assert len(cache) == 2
    assert cache.get(a, 0, P) is pa and cache.get(c, 0, P) is pc
    assert cache.get(b, 0, P) is not pb  # built again


def test_a_plan_uses_the_cache_it_is_given() -> None:
    cache = PieceCache()
    P, D = small_hybrid(1), small_hybrid(2)
    ids = [[i + 1] for i in range(len(D.groups))]
    plan_read(D, 0, P, ids, ids, skip_tokens=0, cache=cache)
    assert len(cache) == 1
    plan_read(D, 0, P, ids, ids, skip_tokens=0, cache=cache)
    assert len(cache) == 1
