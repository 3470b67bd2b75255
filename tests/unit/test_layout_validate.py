"""Layout validation: its bounds, and a cost that does not grow with ``num_regions``."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.ipc import layout as layout_module
from kvsidecar.ipc.layout import (
    MAX_GROUPS,
    MAX_REGIONS,
    MAX_SEGMENTS_PER_GROUP,
    Group,
    Layout,
    LayoutError,
    Segment,
    segment_regions,
    validate,
)


def _mamba(segs: list[Segment], *, regions: int = 1, groups: int = 1,
           page: int | None = None) -> Layout:
    page = page if page is not None else max(s.offset + s.nbytes_local for s in segs)
    return Layout("x", 1, regions, 1, page, (Group("mamba", tuple(segs)),) * groups)


def _one_byte(n: int) -> list[Segment]:
    return [Segment(f"s{i}", i, 1, 1) for i in range(n)]


def test_an_overlap_in_every_region_is_found_without_visiting_every_region(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The audit's layout (defect 1): one-byte segments in all MAX_REGIONS regions
    # and one overlapping segment. Visiting every region per segment took ~18 ms
    # and ~5 MB per segment; the shared spans are checked once, so validating
    # never lists a segment's regions (segment_regions: every region of it).
    def every_region(*args: object) -> None:
        raise AssertionError("validate listed a segment's regions one by one")

    monkeypatch.setattr(layout_module, "segment_regions", every_region)
    segs = [*_one_byte(MAX_SEGMENTS_PER_GROUP - 1), Segment("dup", 0, 1, 1)]
    layout = _mamba(segs, regions=MAX_REGIONS)
    with pytest.raises(LayoutError, match=r"group 0 \(mamba\): segments overlap in region 0"):
        validate(layout)
    ok = _mamba(_one_byte(MAX_SEGMENTS_PER_GROUP), regions=MAX_REGIONS)
    assert validate(ok) is ok


def test_segments_per_group_are_bounded() -> None:
    assert validate(_mamba(_one_byte(MAX_SEGMENTS_PER_GROUP)))
    with pytest.raises(LayoutError, match=rf"group 0 \(mamba\): {MAX_SEGMENTS_PER_GROUP + 1} "
                                          rf"segments exceed the limit "
                                          rf"\({MAX_SEGMENTS_PER_GROUP} per group\)"):
        validate(_mamba(_one_byte(MAX_SEGMENTS_PER_GROUP + 1)))


def test_groups_are_bounded() -> None:
    assert validate(_mamba(_one_byte(1), groups=MAX_GROUPS))
    with pytest.raises(LayoutError, match=rf"{MAX_GROUPS + 1} groups exceed the limit "
                                          rf"\({MAX_GROUPS}\)"):
        validate(_mamba(_one_byte(1), groups=MAX_GROUPS + 1))


def test_named_regions_in_range_and_each_once() -> None:
    with pytest.raises(LayoutError, match=r"segment 'a': region 4 out of range"):
        validate(_mamba([Segment("a", 0, 1, 1, regions=(0, 4))], regions=4))
    with pytest.raises(LayoutError, match=r"segment 'a': region -1 out of range"):
        validate(_mamba([Segment("a", 0, 1, 1, regions=(-1, 2))], regions=4))
    with pytest.raises(LayoutError, match=r"segment 'a': region 2 named twice"):
        validate(_mamba([Segment("a", 0, 1, 1, regions=(2, 1, 2))], regions=4))


def test_segments_in_disjoint_regions_may_share_offsets() -> None:
    # kv_separate: K in even regions, V in odd ones, both at offset 0
    k = Segment("k", 0, 4, 1, regions=(0, 2))
    v = Segment("v", 0, 4, 1, regions=(1, 3))
    assert validate(_mamba([k, v], regions=4))
    with pytest.raises(LayoutError, match="segments overlap in region 3"):
        validate(_mamba([k, Segment("v", 2, 4, 1, regions=(1, 3)),
                         Segment("w", 5, 1, 1, regions=(3,))], regions=4))
    # a named segment shares every region with one that lives everywhere
    with pytest.raises(LayoutError, match="segments overlap in region 1"):
        validate(_mamba([Segment("all", 2, 2, 1), Segment("v", 3, 4, 1, regions=(3, 1))],
                        regions=4))


def _overlap_per_region(layout: Layout) -> bool:
    """The definition, region by region (the check as it was before)."""
    for g in layout.groups:
        spans: dict[int, list[tuple[int, int]]] = {}
        for s in g.segments:
            for r in segment_regions(s, layout.num_regions):
                spans.setdefault(r, []).append((s.offset, s.offset + s.nbytes_local))
        for sp in spans.values():
            sp.sort()
            if any(b1 < e0 for (_, e0), (b1, _) in itertools.pairwise(sp)):
                return True
    return False


_segment = st.builds(
    lambda off, n, regions: (off, n, regions),
    st.integers(0, 12), st.integers(1, 4),
    st.one_of(st.just(()), st.sets(st.integers(0, 3), min_size=1).map(tuple)))


@settings(max_examples=300, deadline=None)
@given(st.lists(_segment, min_size=1, max_size=6))
def test_overlaps_found_exactly_as_region_by_region(raw: list[tuple[int, int, tuple[int, ...]]]
                                                    ) -> None:
    segs = [Segment(f"s{i}", off, n, 1, regions=regions)
            for i, (off, n, regions) in enumerate(raw)]
    layout = _mamba(segs, regions=4, page=16)
    if _overlap_per_region(layout):
        with pytest.raises(LayoutError, match="segments overlap in region"):
            validate(layout)
    else:
        assert validate(layout) is layout
