"""Staging plans (pure) and the staging pool's allocator and scatter: the READ of
the staged plan, simulated with numpy over a fake remote buffer, then the
scatter, must put exactly the scattered post's bytes into the engine's memory."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar.daemon.d_side.addresses import plan_and_address
from kvsidecar.daemon.staging import Extents, scatter, strided_runs
from kvsidecar.daemon.staging_plan import MAX_WIRE_OVERHEAD, CostModel, plan_staging
from kvsidecar.ipc.layout import attention_layout
from kvsidecar.ipc.protocol import Read, RemoteEngine

REMOTE = 1 << 20
LOCAL = 1 << 20


@st.composite
def posts(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Non-overlapping local pieces, remote pieces anywhere (possibly overlapping),
    sizes like the planner's (multiples of a unit)."""
    unit = draw(st.sampled_from([1, 64, 512, 2048]))
    n = draw(st.integers(1, 60))
    lens = np.array(draw(st.lists(st.integers(1, 8), min_size=n, max_size=n)), np.int64) * unit
    # local: a shuffled packing with random gaps
    gaps = np.array(draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)), np.int64) * unit
    perm = np.array(draw(st.permutations(list(range(n)))), np.int64)
    starts = np.cumsum(np.concatenate(([0], (lens[perm] + gaps)[:-1])))
    local = np.empty(n, np.int64)
    local[perm] = starts
    rem_slots = np.array(draw(st.lists(st.integers(0, (REMOTE // unit) - 8), min_size=n,
                                       max_size=n)), np.int64) * unit
    assert local.max() + lens.max() < LOCAL
    return local, rem_slots, lens


def _simulate(local, remote, length, plan, remote_mem):
    """What the engine memory holds after the scattered post, and after the staged one."""
    want = np.zeros(LOCAL, np.uint8)
    for lo, ro, ln in zip(local, remote, length):
        want[lo:lo + ln] = remote_mem[ro:ro + ln]
    got = np.zeros(LOCAL, np.uint8)
    stage = np.zeros(plan.staging_bytes, np.uint8)
    post_local = plan.post_local(0)
    for lo, ro, ln, into in zip(post_local, plan.remote, plan.length, plan.into_staging):
        (stage if into else got)[lo:lo + ln] = remote_mem[ro:ro + ln]
    scatter(stage, plan.src, plan.dst, plan.size, np.array([0], np.int64), [got])
    return want, got


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(posts(), st.sampled_from(["auto", "always"]), st.sampled_from([None, 0, 100, 5000]))
def test_staged_plan_delivers_exactly_the_scattered_bytes(post, mode, gap) -> None:
    local, remote, length = post
    plan = plan_staging(local, remote, length, mode=mode, merge_gap=gap)
    if plan is None:
        assert mode == "auto"
        return
    remote_mem = np.random.default_rng(int(length.sum())).integers(0, 256, REMOTE, np.uint8)
    want, got = _simulate(local, remote, length, plan, remote_mem)
    assert np.array_equal(want, got)
    # every wanted piece is either posted directly or scattered exactly once
    direct = {(int(lo), int(ln)) for lo, ln, s in
              zip(plan.local, plan.length, plan.into_staging) if not s}
    scattered = sorted(zip(plan.dst.tolist(), plan.size.tolist()))
    assert len(scattered) == len(set(scattered))
    assert sorted(direct | set(scattered)) == sorted(zip(local.tolist(), length.tolist()))
    assert not direct & set(scattered)
    # staging areas of runs never overlap and stay inside staging_bytes
    runs = sorted((int(lo), int(lo + ln)) for lo, ln, s in
                  zip(plan.local, plan.length, plan.into_staging) if s)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(runs))
    assert runs[-1][1] <= plan.staging_bytes
    assert (plan.src >= 0).all() and (plan.src + plan.size <= plan.staging_bytes).all()
    if mode == "always":
        assert plan.into_staging.all()


def test_hetero_shapes_merge_into_few_runs_and_auto_weighs_the_foreign_bytes() -> None:
    """1→2 attention: every other 2 KiB of a run is wanted (gap = piece). One run;
    the model finds it cheaper, but it carries as many foreign bytes as wanted
    ones, so ``auto`` posts it scattered (MAX_WIRE_OVERHEAD). 2→1: the same
    pieces packed on the remote side (whole pages): no foreign bytes, staged."""
    n = 3000
    remote = np.arange(n, dtype=np.int64) * 4096
    local = np.random.default_rng(0).permutation(n).astype(np.int64) * 2048
    length = np.full(n, 2048, np.int64)
    plan = plan_staging(local, remote, length, mode="always")
    assert plan is not None
    assert plan.length.size == 1 and plan.wire_bytes == (n - 1) * 4096 + 2048
    assert plan.staged_s < plan.scattered_s
    assert plan_staging(local, remote, length) is None
    plan = plan_staging(local, remote // 2, length)
    assert plan is not None and plan.length.size == 1 and plan.wire_bytes == n * 2048
    # big pieces far apart: nothing to merge, scattered it stays
    far = np.arange(8, dtype=np.int64) << 24
    assert plan_staging(far, far, np.full(8, 1 << 20, np.int64)) is None
    # a gap larger than the model's threshold splits runs
    m = CostModel()
    two = np.array([0, 2048, 2048 + m.merge_gap + 4096, 2 * 2048 + m.merge_gap + 4096])
    plan = plan_staging(np.arange(4, dtype=np.int64) * 8192, two, np.full(4, 2048, np.int64))
    assert plan is not None and plan.length.size == 2


def test_off_and_bad_mode() -> None:
    a = np.arange(4, dtype=np.int64) * 4096
    assert plan_staging(a, a, np.full(4, 2048, np.int64), mode="off") is None
    with pytest.raises(ValueError, match="staging mode"):
        plan_staging(a, a, np.full(4, 2048, np.int64), mode="sometimes")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 50)), max_size=80))
def test_extents_never_overlap_and_never_exceed_capacity(ops) -> None:
    ext = Extents(200)
    held: list[tuple[int, int]] = []
    for take, n in ops:
        if take or not held:
            off = ext.take(n)
            if off is not None:
                assert off >= 0 and off + n <= 200
                assert all(off + n <= o or o + s <= off for o, s in held)
                held.append((off, n))
        else:
            ext.give(*held.pop(n % len(held)))
        assert ext.used == sum(s for _, s in held) <= 200
    for h in held:
        ext.give(*h)
    assert ext.take(200) == 0


def test_extents_refuse_double_free() -> None:
    ext = Extents(100)
    off = ext.take(10)
    assert off is not None
    ext.give(off, 10)
    with pytest.raises(ValueError, match="overlaps"):
        ext.give(off, 10)


def test_scatter_vectorises_aligned_pieces_and_spans_regions() -> None:
    rng = np.random.default_rng(1)
    area = rng.integers(0, 256, 1 << 16, np.uint8)
    regions = [np.zeros(1 << 15, np.uint8), np.zeros(1 << 15, np.uint8)]
    bases = np.array([1 << 30, 1 << 20], np.int64)
    src = np.arange(32, dtype=np.int64) * 2048
    slots = rng.permutation(32)
    dst = np.where(np.arange(32) % 2 == 0, bases[0], bases[1]) + slots * 1024
    size = np.full(32, 1024, np.int64)
    assert scatter(area, src, dst, size, bases, regions) == 2
    for s, d in zip(src, dst):
        r = 0 if d >= bases[0] else 1
        o = d - bases[r]
        assert np.array_equal(regions[r][o:o + 1024], area[s:s + 1024])
    # unaligned pieces at constant steps: one strided copy, still right
    src2 = np.arange(20, dtype=np.int64) * 1001
    dst2 = bases[1] + np.arange(20, dtype=np.int64) * 1200
    assert scatter(area, src2, dst2, np.full(20, 999, np.int64), bases, regions) == 1
    for s, d in zip(src2, dst2):
        o = d - bases[1]
        assert np.array_equal(regions[1][o:o + 999], area[s:s + 999])
    # unaligned pieces at irregular places take the loop and are still right
    regions[1][:] = 0
    src3 = np.cumsum(rng.integers(999, 1100, 20)).astype(np.int64)
    dst3 = bases[1] + rng.permutation(20).astype(np.int64) * 1200
    assert scatter(area, src3, dst3, np.full(20, 999, np.int64), bases, regions) == 0
    for s, d in zip(src3, dst3):
        o = d - bases[1]
        assert np.array_equal(regions[1][o:o + 999], area[s:s + 999])


def test_strided_runs_finds_constant_step_runs_once_each() -> None:
    # pieces 0-4: steps (10, 20); 5-8: steps (7, 30); 9-10 irregular; 11-13: 3 pieces only
    s = np.array([0, 10, 20, 30, 40, 47, 54, 61, 68, 500, 900, 1000, 1100, 1200], np.int64)
    d = np.array([0, 20, 40, 60, 80, 110, 140, 170, 200, 999, 2000, 3000, 3100, 3200],
                 np.int64)
    starts, stops = strided_runs(s, d, 10, 4)
    # 0..4 is a run; 4 is also the first piece of (4..8) at (7, 30): it stays with the first
    assert list(zip(starts.tolist(), stops.tolist())) == [(0, 5), (5, 9)]
    # destination step shorter than the piece (overlapping writes): never a run
    assert strided_runs(np.arange(8, dtype=np.int64) * 16, np.arange(8, dtype=np.int64) * 8,
                        16, 4)[0].size == 0
    # a run shortened below min_run by its neighbour is dropped, and nothing is lost
    starts, stops = strided_runs(s, d, 10, 5)
    assert list(zip(starts.tolist(), stops.tolist())) == [(0, 5)]
    assert strided_runs(s[:1], d[:1], 10, 1)[0].size == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 4), st.integers(2, 6)),
                min_size=1, max_size=12), st.integers(2, 6))
def test_strided_runs_are_disjoint_constant_and_long_enough(parts, min_run) -> None:
    """Random concatenations of arithmetic progressions: every returned run has
    constant steps, a destination step of at least the length, ``min_run`` pieces,
    and no piece is in two runs."""
    s_list: list[int] = []
    d_list: list[int] = []
    for ss, dd, k in parts:
        s0 = (s_list[-1] + 5) if s_list else 0
        d0 = (d_list[-1] + 7) if d_list else 0
        s_list += [s0 + i * ss for i in range(k)]
        d_list += [d0 + i * dd for i in range(k)]
    s, d = np.array(s_list, np.int64), np.array(d_list, np.int64)
    starts, stops = strided_runs(s, d, 2, min_run)
    seen = np.zeros(s.size, int)
    for a, b in zip(starts.tolist(), stops.tolist()):
        assert b - a >= min_run
        assert len(set(np.diff(s[a:b]).tolist())) == 1 and np.diff(s[a:b])[0] > 0
        assert len(set(np.diff(d[a:b]).tolist())) == 1 and np.diff(d[a:b])[0] >= 2
        seen[a:b] += 1
    assert seen.max(initial=0) <= 1


def _demo_posts(p_tp: int, d_tp: int, tokens: int) -> list[tuple[np.ndarray, ...]]:
    """The real planner's posts for one request of the demo's hybrid shapes
    (Nemotron-like, 4 layers), D rank 0, scattered block ids, distinct bases."""
    from kvsidecar.daemon.d_side.addresses import build_posts
    from kvsidecar.daemon.planner import plan_read
    from kvsidecar.sim.models import nemotron_like

    nb = 40
    make = nemotron_like(4)
    P, D = make(p_tp, nb), make(d_tp, nb)
    rng = np.random.default_rng(tokens)

    def ids(layout) -> list[list[int]]:
        order = [int(b) for b in rng.permutation(nb)]
        out = []
        for g in layout.groups:
            per = g.sub_blocks * g.block_tokens
            k = -(-tokens // per) if g.kind == "attention" else 1
            out.append(order[:k])
            order = order[k:]
        return out

    plan = plan_read(D, 0, P, ids(D), ids(P), num_tokens=tokens)
    local = np.arange(D.num_regions, dtype=np.int64) * (1 << 34) + (1 << 40)
    remote = {p: np.arange(P.num_regions, dtype=np.int64) * (1 << 34) + (1 << 44)
              for p in range(p_tp)}
    return [(p.local, p.remote, p.length) for p in build_posts(plan, local, remote)
            if p.length.size]


def test_auto_stages_the_demo_shapes_2_to_1() -> None:
    """The hetero demo's 2→1 posts of a long prompt (thousands of 2 KiB pieces,
    each P rank's whole pages) are staged by the calibrated model, into few runs
    that carry no foreign bytes: the choice behind the measured A/B (docs/performance.md).
    A model that drifts into declining them fails here."""
    for local, remote, length in _demo_posts(2, 1, 5000):
        assert length.size > 1000
        plan = plan_staging(local, remote, length)
        assert plan is not None, "auto declined a demo post"
        assert plan.length.size <= 64 and plan.staged_s < plan.scattered_s
        assert plan.wire_bytes == int(length.sum())


def test_auto_leaves_the_demo_shapes_1_to_2_scattered() -> None:
    """1→2: the runs would carry the other D rank's halves too (wire 1.36-1.66x
    the pieces); the model alone would stage them, but measured, staging them
    did not beat posting them scattered (MAX_WIRE_OVERHEAD). ``always`` still can."""
    for local, remote, length in _demo_posts(1, 2, 5000):
        assert length.size > 1000
        staged = plan_staging(local, remote, length, mode="always")
        assert staged is not None and staged.staged_s < staged.scattered_s
        assert staged.wire_bytes > (1 + MAX_WIRE_OVERHEAD) * int(length.sum())
        assert plan_staging(local, remote, length) is None


def test_auto_leaves_big_pieces_scattered() -> None:
    """Homogeneous reads of whole blocks (64 KiB pieces, every other block of a
    run): the extra bytes and the copy cost more than the descriptors saved."""
    n = 512
    remote = np.arange(n, dtype=np.int64) * 2 * 65536
    local = np.arange(n, dtype=np.int64) * 65536
    assert plan_staging(local, remote, np.full(n, 65536, np.int64)) is None
    # and 8 KiB pieces with 8 KiB gaps, the measured tie (bench_staging 1.00x): scattered
    remote = np.arange(n, dtype=np.int64) * 2 * 8192
    assert plan_staging(local // 8, remote, np.full(n, 8192, np.int64)) is None


@pytest.mark.parametrize("gap", [0, 4096], ids=["adjacent", "a-page-apart"])
def test_a_staged_run_never_spans_two_remote_regions(gap: int) -> None:
    """P's regions are separate registrations, but may lie next to each other
    (anonymous mappings placed one below the other; the views of one
    reservation a page apart). A read of P's last block and its first ones
    then has pieces a few bytes apart across a region boundary: a staged run
    merging them was one READ descriptor over two registrations, which NIXL
    refuses (NIXL_ERR_NOT_FOUND) on every attempt. Each run reads one region,
    and the staged plan still delivers exactly the scattered post's bytes."""
    layout = attention_layout(model="edge", num_layers=3, total_kv_heads=2, head_dim=16,
                              block_tokens=8, tp_size=1, num_blocks=64)
    rb = layout.region_bytes
    top = 1 << 30
    # region i just below region i - 1, as mmap places fresh mappings
    remote_bases = np.array([top - i * (rb + gap) for i in range(layout.num_regions)], np.int64)
    local_bases = np.array([i * (rb + 8192) for i in range(layout.num_regions)], np.int64)
    req = Read(id=1, engine_id="D", request_id="edge", local_block_ids=[[0, 1, 2, 3]],
               remote=RemoteEngine(engine_id="P", tp_size=1, handshake=["h:1"]),
               remote_block_ids=[[63, 0, 1, 2]], num_tokens=30)
    _, posts, staged = plan_and_address(layout, 0, layout, req, local_bases, {0: remote_bases},
                                        {0: "always"})
    sp = staged[0]
    assert sp is not None
    for start, n in zip(sp.remote.tolist(), sp.length.tolist()):
        inside = [b for b in remote_bases.tolist() if b <= start and start + n <= b + rb]
        assert inside, f"a staged READ of {n} B at {start:#x} spans two remote regions"
    # the staged plan moves exactly what the scattered post does (addresses rebased)
    lo, hi = int(remote_bases.min()), int(remote_bases.max()) + rb
    mem = np.random.default_rng(5).integers(0, 255, hi - lo, dtype=np.uint8)
    post = posts[0]
    want = {int(a): mem[r - lo:r - lo + n].tobytes()
            for a, r, n in zip(post.local.tolist(), post.remote.tolist(), post.length.tolist())}
    stage = np.zeros(sp.staging_bytes, np.uint8)
    for off, r, n in zip(sp.post_local(0).tolist(), sp.remote.tolist(), sp.length.tolist()):
        stage[off:off + n] = mem[r - lo:r - lo + n]
    got = {int(d): stage[s:s + n].tobytes()
           for s, d, n in zip(sp.src.tolist(), sp.dst.tolist(), sp.size.tolist())}
    assert got == want


def test_a_pool_says_which_areas_could_never_fit_once_rounded_to_pages() -> None:
    """The fallback's reason: ``full`` only for what an empty pool would take; an
    area that fits by its bytes but not once rounded up to pages is too large."""
    import mmap

    from kvsidecar.daemon.staging import StagingPool

    page = mmap.PAGESIZE
    pool = StagingPool(2 * page, worker=None)  # type: ignore[arg-type]  # never started
    assert pool.fits(2 * page) and pool.fits(1)
    assert not pool.fits(2 * page + 1)  # three pages once rounded
