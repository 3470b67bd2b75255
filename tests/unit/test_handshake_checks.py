"""A peer's handshake checks, vectorised: the same verdicts and messages as the
loops they replaced, and large infos checked off the event loop.

The loops are kept here verbatim (``_old_*``, from before the change) as the
definition: every verdict of :func:`validate` and :func:`check_bases` on
random, mostly malformed, inputs must be theirs, message for message."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast
from unittest import mock

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.daemon.peers import links as links_module
from kvsidecar.daemon.peers.links import PeerLinks
from kvsidecar.daemon.peers.messages import (
    OFF_LOOP_NUMBERS,
    HandshakeFailed,
    accept_peer,
    check_bases,
    checks_cost,
    make_handshake_info,
)
from kvsidecar.ipc import layout as layout_module
from kvsidecar.ipc.layout import (
    MAX_REGIONS,
    Group,
    Layout,
    LayoutError,
    Segment,
    attention_layout,
    units_local,
    validate,
)

_ADDRESS_LIMIT = 1 << 63


def _old_check_bases(bases: list[int], region_bytes: int,
                     fail: Callable[[str, str], Exception]) -> None:
    if region_bytes <= 0:
        raise fail("bases", f"region size {region_bytes} is not positive")
    for r, base in enumerate(bases):
        if not 0 < base <= _ADDRESS_LIMIT - region_bytes:
            raise fail("bases", f"region {r} at {base:#x} + {region_bytes} B lies outside the "
                                "address space")
    ordered = sorted(bases)
    for lo, hi in itertools.pairwise(ordered):
        if lo + region_bytes > hi:
            raise fail("bases", f"regions at {lo:#x} and {hi:#x} overlap "
                                f"({region_bytes} B each)")


def _old_first_overlap(segments: tuple[Segment, ...], named: object = None) -> int | None:
    everywhere = sorted((s.offset, s.offset + s.nbytes_local) for s in segments
                        if not s.regions)
    for (_, e0), (b1, _) in itertools.pairwise(everywhere):
        if b1 < e0:
            return 0
    starts = [b for b, _ in everywhere]
    by_region: dict[int, list[tuple[int, int]]] = {}
    import bisect
    for s in segments:
        if not s.regions:
            continue
        b, e = s.offset, s.offset + s.nbytes_local
        i = bisect.bisect_right(starts, b)
        if (i and everywhere[i - 1][1] > b) or (i < len(everywhere) and everywhere[i][0] < e):
            return min(s.regions)
        for r in s.regions:
            by_region.setdefault(r, []).append((b, e))
    for r in sorted(by_region):
        sp = sorted(by_region[r])
        for (_, e0), (b1, _) in itertools.pairwise(sp):
            if b1 < e0:
                return r
    return None


def _old_check_segment(layout: Layout, g: Group, s: Segment, sw: str, view: int) -> None:
    tp = layout.tp_size
    if s.units_total < 1:
        raise LayoutError(f"{sw}: units_total must be >= 1")
    if s.sharding == "split" and tp <= s.units_total and s.units_total % tp:
        raise LayoutError(f"{sw}: {s.units_total} units cannot be split evenly over tp {tp}")
    if s.sharding == "split" and tp > s.units_total and tp % s.units_total:
        raise LayoutError(
            f"{sw}: tp {tp} replicates {s.units_total} units unevenly (tp must be a "
            "multiple of the unit count when it exceeds it)"
        )
    n = units_local(s, tp)
    if s.nbytes_local < 1 or s.nbytes_local % n:
        raise LayoutError(f"{sw}: {s.nbytes_local} B is not a whole number of {n} units")
    if g.kind == "attention" and (s.nbytes_local // n) % g.block_tokens:
        raise LayoutError(f"{sw}: a unit is not a whole number of {g.block_tokens} tokens")
    if s.offset < 0 or s.offset + s.nbytes_local > view:
        end = s.offset + s.nbytes_local
        raise LayoutError(f"{sw}: [{s.offset}, {end}) outside its view")
    if s.regions:
        lo, hi = min(s.regions), max(s.regions)
        if lo < 0 or hi >= layout.num_regions:
            raise LayoutError(f"{sw}: region {lo if lo < 0 else hi} out of range")
        seen: set[int] = set()
        for r in s.regions:
            if r in seen:
                raise LayoutError(f"{sw}: region {r} named twice")
            seen.add(r)


@contextlib.contextmanager
def _old_validate() -> Iterator[None]:
    """:func:`validate` with the loops it had (the rest of it did not change)."""
    with mock.patch.object(layout_module, "_check_segment", _old_check_segment), \
            mock.patch.object(layout_module, "_first_overlap", _old_first_overlap):
        yield


def _verdict(fn: Callable[[], object]) -> str:
    try:
        fn()
    except (LayoutError, HandshakeFailed) as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


# Region numbers a peer may send: in range, out of range either way, beyond int64.
_region = st.one_of(st.integers(0, 7), st.integers(0, 7), st.integers(-3, 10),
                    st.sampled_from([-(1 << 63), (1 << 63) - 1, 1 << 63, (1 << 64) - 1]))
_named = st.one_of(st.just(()), st.lists(_region, min_size=1, max_size=9).map(tuple))
_segment = st.tuples(st.integers(-1, 12), st.integers(0, 5), _named)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(_segment, min_size=1, max_size=5), min_size=1, max_size=3),
       st.integers(1, 8))
def test_validate_verdicts_are_the_loops(groups: list[list[tuple[int, int, tuple[int, ...]]]],
                                         num_regions: int) -> None:
    """Out-of-range and repeated regions, overlaps in shared or named regions,
    bad offsets and sizes: the same refusal, word for word, or the same pass."""
    lay = Layout("x", 1, num_regions, 1, 16, tuple(
        Group("mamba", tuple(Segment(f"s{i}", off, n, 1, regions=regions)
                             for i, (off, n, regions) in enumerate(segs)))
        for segs in groups))
    new = _verdict(lambda: validate(lay))
    with _old_validate():
        old = _verdict(lambda: validate(lay))
    assert new == old


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10), st.integers(1, 5),
                          st.permutations(range(8)).flatmap(
                              lambda p: st.integers(0, 8).map(lambda n: tuple(p[:n])))),
                min_size=2, max_size=6))
def test_overlaps_in_named_regions_are_the_loops(segs: list[tuple[int, int, tuple[int, ...]]]
                                                 ) -> None:
    """Segments naming valid regions in any order (none naming any: every
    region), overlapping in several regions: the lowest one is named, as the
    region-by-region loop named it."""
    lay = Layout("x", 1, 8, 1, 16, (Group("mamba", tuple(
        Segment(f"s{i}", off, n, 1, regions=regions)
        for i, (off, n, regions) in enumerate(segs))),))
    new = _verdict(lambda: validate(lay))
    with _old_validate():
        assert new == _verdict(lambda: validate(lay))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=12))
def test_the_first_region_named_twice_is_the_loops(regions: list[int]) -> None:
    lay = Layout("x", 1, 10, 1, 16, (Group("mamba", (
        Segment("s", 0, 4, 1, regions=tuple(regions)),)),))
    new = _verdict(lambda: validate(lay))
    with _old_validate():
        assert new == _verdict(lambda: validate(lay))


def test_validate_verdicts_at_the_largest_layouts() -> None:
    """The audit's shapes (K and V in separate regions, 65,536 in all) and
    each way of breaking one: the same verdicts at full size."""
    good = attention_layout(model="m", num_layers=MAX_REGIONS // 2, total_kv_heads=2,
                            head_dim=8, block_tokens=4, tp_size=1, num_blocks=2,
                            kv_separate=True)
    k, v = good.groups[0].segments
    every = tuple(range(MAX_REGIONS))
    bad = {
        "ok": (k, v),
        "repeat": (k, Segment("v", 0, v.nbytes_local, 2, regions=(*v.regions[:-2], 3, 1))),
        "out of range": (k, Segment("v", 0, v.nbytes_local, 2,
                                    regions=(*v.regions, MAX_REGIONS))),
        "negative": (k, Segment("v", 0, v.nbytes_local, 2, regions=(-1, *v.regions[1:]))),
        "overlap": (k, Segment("v", 0, v.nbytes_local, 2, regions=(*v.regions, 0))),
        "overlap late": (Segment("k", 0, 64, 2, regions=every),
                         Segment("v", 63, 8, 2, regions=every[-1:])),
        "reversed": (Segment("k", 0, k.nbytes_local, 2, regions=every[::-1]),),
    }
    verdicts = {}
    for name, segs in bad.items():
        lay = Layout("x", 1, MAX_REGIONS, 2, good.page_bytes,
                     (Group("attention", segs, 1, good.page_bytes, 4),))
        new = _verdict(lambda lay=lay: validate(lay))  # type: ignore[misc]
        with _old_validate():
            old = _verdict(lambda lay=lay: validate(lay))  # type: ignore[misc]
        assert new == old, name
        verdicts[name] = new
    assert verdicts["ok"] == verdicts["reversed"] == "ok"
    assert "region 3 named twice" in verdicts["repeat"]
    assert f"region {MAX_REGIONS} out of range" in verdicts["out of range"]
    assert "region -1 out of range" in verdicts["negative"]
    assert "segments overlap in region 0" in verdicts["overlap"]
    assert f"segments overlap in region {MAX_REGIONS - 1}" in verdicts["overlap late"]


def _fail(fld: str, reason: str) -> HandshakeFailed:
    return HandshakeFailed("p:1", f"{fld} mismatch: {reason}", field=fld)


_base = st.one_of(
    st.integers(1, 64).map(lambda x: x * 4096),
    st.integers(-2, 2),
    st.integers(_ADDRESS_LIMIT - 70_000, _ADDRESS_LIMIT + 2),
    st.sampled_from([-(1 << 63), -(1 << 63) - 1, (1 << 64) - 1, 1 << 64, 1 << 70]))
_region_bytes = st.one_of(st.integers(-1, 9000), st.sampled_from(
    [4096, 8192, _ADDRESS_LIMIT - 1, _ADDRESS_LIMIT, _ADDRESS_LIMIT + 1, 1 << 64]))


@settings(max_examples=600, deadline=None)
@given(st.lists(_base, max_size=12), _region_bytes)
def test_check_bases_verdicts_are_the_loops(bases: list[int], region_bytes: int) -> None:
    """Bases at 0, negative, past the int64 address space (and past int64
    itself), equal or closer than a region: the same refusal, or both pass
    and the bases come back as int64."""
    new = _verdict(lambda: check_bases(bases, region_bytes, _fail))
    assert new == _verdict(lambda: _old_check_bases(bases, region_bytes, _fail))
    if new == "ok":
        got = check_bases(bases, region_bytes, _fail)
        assert got.dtype == np.int64 and got.tolist() == bases


def test_check_bases_at_the_largest_count() -> None:
    rb = 1 << 20
    good = [(1 << 40) + r * rb for r in range(MAX_REGIONS)][::-1]
    cases = {"ok": good, "close": [*good[:-1], good[0] + rb - 1],
             "zero": [*good[:-1], 0], "huge": [*good[:-1], 1 << 64]}
    for name, bases in cases.items():
        new = _verdict(lambda b=bases: check_bases(b, rb, _fail))  # type: ignore[misc]
        assert new == _verdict(lambda b=bases: _old_check_bases(b, rb, _fail)), name  # type: ignore[misc]
    assert "overlap" in _verdict(lambda: check_bases(cases["close"], rb, _fail))


def _info(layout: Layout) -> Any:
    rb = layout.region_bytes
    return make_handshake_info(engine_id="p", tp_rank=0, agent_name="p-agent",
                               agent_metadata=b"md", layout=layout,
                               bases=[(1 << 30) + r * rb for r in range(layout.num_regions)],
                               daemon_id="d")


def _attn(regions: int) -> Layout:
    return attention_layout(model="m", num_layers=regions // 2, total_kv_heads=2, head_dim=8,
                            block_tokens=4, tp_size=1, num_blocks=2, kv_separate=True)


def test_checks_cost_counts_what_the_checks_visit_and_stops_early() -> None:
    assert checks_cost(_info(_attn(2))) == 2 + 1 + 2 + 2  # bases, group, segments, regions
    big = _info(_attn(MAX_REGIONS))
    assert OFF_LOOP_NUMBERS < checks_cost(big) <= MAX_REGIONS + 2 * (MAX_REGIONS // 2) + 3


def test_checks_cost_counts_groups_without_walking_them() -> None:
    """Empty groups (no segments, no regions) are counted too: an info with many
    of them is checked off the loop, and counting it walks none of them (a
    million of them, ~61 MB, took ~30 ms of the loop to count as 2)."""
    small = _attn(2)
    empty = msgspec.structs.replace(small.groups[0], segments=())
    many = msgspec.structs.replace(small, groups=(empty,) * (OFF_LOOP_NUMBERS * 4))
    assert checks_cost(_info(many)) > OFF_LOOP_NUMBERS


class _Worker:
    agent_name = "d-agent"
    generation = 0
    running = True

    async def add_remote_at(self, metadata: bytes) -> tuple[str, int]:
        return "p-agent", 0


class _Client:
    def __init__(self, info: Any) -> None:
        self.info = info

    async def fetch(self, *args: object) -> Any:
        return self.info

    def forget(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("regions", [2, 1024, MAX_REGIONS])
async def test_a_link_checks_large_infos_off_the_loop(regions: int) -> None:
    """Small infos are checked on the loop (a thread hop costs more); large ones
    on a thread. Either way the link keeps the bases, and a bad info is
    refused with the message the link gave before."""
    lay = _attn(regions)
    loop_thread = threading.get_ident()
    seen: list[int] = []

    def spy(*args: Any, **kw: Any) -> Any:
        seen.append(threading.get_ident())
        return accept_peer(*args, **kw)

    with mock.patch.object(links_module, "accept_peer", spy):
        info = _info(lay)
        peer = await PeerLinks(cast(Any, _Worker()), lay, cast(Any, _Client(info))).get(
            "tcp://p:1", "p", 1, 0)
        assert peer.bases.tolist() == info.bases
        k, v = lay.groups[0].segments
        broken = Layout(lay.family, 1, lay.num_regions, 2, lay.page_bytes, (Group(
            "attention", (k, Segment("v", 0, v.nbytes_local, 2, regions=(*v.regions, 0))),
            1, lay.page_bytes, 4),), lay.model)
        links = PeerLinks(cast(Any, _Worker()), lay, cast(Any, _Client(_info(broken))))
        with pytest.raises(HandshakeFailed) as e:
            await links.get("tcp://p:1", "p", 1, 0)
    assert str(e.value) == ("handshake with tcp://p:1 failed: peer sent an invalid layout: "
                            "group 0 (attention): segments overlap in region 0")
    off_loop = [t != loop_thread for t in seen]
    assert off_loop == [regions == MAX_REGIONS] * len(seen) and len(seen) >= 2
    await asyncio.sleep(0)
