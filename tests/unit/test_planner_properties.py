"""Property tests: over random valid layouts, ranks and block lists, a plan stays
inside registered regions, writes no local byte twice, and writes every byte
D needs exactly once (and nothing else)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar.daemon.planner import plan_read
from kvsidecar.ipc.layout import (
    Layout,
    attention_layout,
    gdn_hybrid_layout,
    mamba1_layout,
    mamba2_hybrid_layout,
    mla_layout,
)

TP = st.sampled_from([1, 2, 4, 8])


@st.composite
def layouts(draw: st.DrawFn) -> tuple[object, int, int]:
    """A builder closure over random model facts, plus P and D tp sizes."""
    fam = draw(st.sampled_from(["attn", "attn-sep", "mla", "mamba2", "gdn", "mamba1"]))
    k = draw(st.sampled_from([1, 2, 4, 8]))
    hd = draw(st.sampled_from([2, 4, 8]))
    kbs = draw(st.sampled_from([1, 2, 4]))
    layers = draw(st.integers(1, 3))
    ng = draw(st.sampled_from([1, 2, 8]))
    ds = draw(st.sampled_from([1, 2, 4]))
    ck = draw(st.sampled_from([2, 3, 4]))
    dt = draw(st.sampled_from(["bfloat16", "fp8", "float32"]))

    def make(tp: int, nb: int) -> Layout:
        if fam in ("attn", "attn-sep"):
            return attention_layout(model="p", num_layers=layers, total_kv_heads=k, head_dim=hd,
                                    block_tokens=kbs, tp_size=tp, num_blocks=nb, dtype=dt,
                                    kv_separate=fam == "attn-sep")
        if fam == "mla":
            return mla_layout(model="p", num_layers=layers, latent_dim=hd * 3, block_tokens=kbs,
                              tp_size=tp, num_blocks=nb, dtype=dt)
        if fam == "mamba2":
            return mamba2_hybrid_layout(
                model="p", num_layers=layers, total_kv_heads=k, head_dim=hd, block_tokens=kbs,
                intermediate_size=32, n_groups=ng, d_state=ds, conv_kernel=ck, mamba_heads=8,
                mamba_head_dim=4, tp_size=tp, num_blocks=nb, kv_dtype=dt)
        if fam == "gdn":
            return gdn_hybrid_layout(
                model="p", num_layers=layers, total_kv_heads=k, head_dim=hd, block_tokens=kbs,
                num_k_heads=8, num_v_heads=8, head_k_dim=ds, head_v_dim=2, conv_kernel=ck,
                tp_size=tp, num_blocks=nb)
        return mamba1_layout(model="p", num_layers=layers, intermediate_size=16, d_state=ds,
                             conv_kernel=ck, tp_size=tp, num_blocks=nb,
                             total_kv_heads=k if ng > 1 else 0, head_dim=hd, block_tokens=kbs)

    return make, draw(TP), draw(TP)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=layouts(), data=st.data())
def test_plans_are_in_bounds_disjoint_and_complete(spec: tuple, data: st.DataObject) -> None:
    make, p_tp, d_tp = spec
    p_nb, d_nb = data.draw(st.integers(4, 24)), data.draw(st.integers(4, 24))
    P, D = make(p_tp, p_nb), make(d_tp, d_nb)
    d_rank = data.draw(st.integers(0, d_tp - 1))
    d_perm = data.draw(st.permutations(range(d_nb)))
    p_ids, d_ids, d_pos = [], [], 0
    explicit = None
    for gi, g in enumerate(D.groups):
        assert g.kind == P.groups[gi].kind
        if g.kind == "mamba":
            n = data.draw(st.integers(0, 2))
            p_ids.append(data.draw(st.lists(st.integers(0, p_nb - 1), min_size=n, max_size=n)))
            d_ids.append(list(d_perm[d_pos : d_pos + n]))
        else:
            nr = data.draw(st.integers(0, 4))
            nl = data.draw(st.integers(0, min(4, d_nb - d_pos - 2)))
            p_ids.append(data.draw(st.lists(st.integers(0, p_nb - 1), min_size=nr, max_size=nr)))
            d_ids.append(list(d_perm[d_pos : d_pos + nl]))
            explicit = 0
            n = nl
        d_pos += n
    plan = plan_read(D, d_rank, P, d_ids, p_ids, skip_tokens=explicit)

    # Needed local bytes: every segment byte of every paired local view.
    need = [np.zeros(D.region_bytes, np.int8) for _ in range(D.num_regions)]
    for gi, g in enumerate(D.groups):
        ids = np.asarray(d_ids[gi], np.int64)
        if ids.size == 0:
            continue
        if g.kind == "mamba":
            views = ids * D.page_bytes
        else:
            rg = P.groups[gi]
            views = (ids[:, None] * D.page_bytes
                     + np.arange(g.sub_blocks)[None, :] * g.kernel_block_bytes).reshape(-1)
            views = views[: min(views.size, len(p_ids[gi]) * rg.sub_blocks)]
        for s in g.segments:
            for r in s.regions or range(D.num_regions):
                for v in views.tolist():
                    need[r][v + s.offset : v + s.offset + s.nbytes_local] = 1

    got = [np.zeros(D.region_bytes, np.int64) for _ in range(D.num_regions)]
    for rr in plan.reads:
        assert rr.remote_rank in plan.notify
        assert (rr.length > 0).all()
        assert (rr.region >= 0).all() and (rr.region < D.num_regions).all()
        assert (rr.local_offset >= 0).all() and (rr.remote_offset >= 0).all()
        assert (rr.local_offset + rr.length <= D.region_bytes).all()
        assert (rr.remote_offset + rr.length <= P.region_bytes).all()
        for reg, lo, n in zip(rr.region.tolist(), rr.local_offset.tolist(), rr.length.tolist()):
            got[reg][lo : lo + n] += 1
    for r in range(D.num_regions):
        assert got[r].max(initial=0) <= 1, f"region {r}: a local byte is written twice"
        assert np.array_equal(got[r] == 1, need[r] == 1), f"region {r}: coverage differs"


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(st.integers(-3, 40), max_size=30), min_size=1, max_size=3),
       st.sampled_from(["local", "remote", "held"]), st.booleans())
def test_check_block_ids_agrees_with_validate_block_ids(ids, side, big) -> None:
    """The event loop's array-free check raises exactly what the planner's does
    (type and message), and passes exactly what it passes."""
    from kvsidecar.daemon.planner import PlanError, check_block_ids, validate_block_ids
    from kvsidecar.ipc.layout import attention_layout

    layout = attention_layout(model="m", num_layers=1, total_kv_heads=1, head_dim=8,
                              block_tokens=8, tp_size=1, num_blocks=32)
    layout = layout.with_blocks(32)
    groups = ids[:1] if not big else [ids[0] * 40]  # > 512 ids: the sorting path
    results = []
    for fn in (validate_block_ids, check_block_ids):
        try:
            fn(layout, groups, side)
            results.append(None)
        except PlanError as e:
            results.append((type(e), str(e)))
    assert results[0] == results[1]
    wrong = ids if len(ids) > 1 else [*ids, []]  # group count differs from the layout's
    with pytest.raises(PlanError, match="groups"):
        check_block_ids(layout, wrong, side)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(st.integers(-3, 40), max_size=30), min_size=1, max_size=3),
       st.sampled_from(["local", "remote", "held"]), st.booleans())
def test_block_ids_give_one_outcome_in_every_form(ids, side, big) -> None:
    """Plain lists of ints (checked without numpy), integer arrays and lists of
    numpy ints (converted first) pass or fail alike: same type and message."""
    from kvsidecar.daemon.planner import PlanError, check_block_ids
    from kvsidecar.ipc.layout import attention_layout

    layout = attention_layout(model="m", num_layers=1, total_kv_heads=1, head_dim=8,
                              block_tokens=8, tp_size=1, num_blocks=32)
    groups = ids[:1] if not big else [ids[0] * 40]  # > 512 ids: duplicates named by value
    forms = (groups, [np.asarray(g, np.int64) for g in groups],
             [[np.int64(i) for i in g] for g in groups])
    results = []
    for form in forms:
        try:
            check_block_ids(layout, form, side)
            results.append(None)
        except PlanError as e:
            results.append((type(e), str(e)))
    assert results[0] == results[1] == results[2]


@st.composite
def _requests(draw: st.DrawFn, D: Layout, P: Layout) -> tuple:
    """One request between D and P: mostly valid ids, now and then a local id
    out of range or named twice, a Mamba count mismatch, a bad skip."""
    d_perm = draw(st.permutations(range(D.num_blocks)))
    lb, rb, pos = [], [], 0
    for g in D.groups:
        n = draw(st.integers(0, min(3, D.num_blocks - pos)))
        lb.append(list(d_perm[pos:pos + n]))
        pos += n
        m = n if g.kind == "mamba" and draw(st.booleans()) else draw(st.integers(0, 4))
        rb.append(draw(st.lists(st.integers(0, P.num_blocks - 1), min_size=m, max_size=m)))
    flaw = draw(st.sampled_from([*[None] * 8, "range", "twice"]))
    if flaw == "range":
        lb[0] = [*lb[0], D.num_blocks]
    elif flaw == "twice" and pos:
        lb[-1] = [*lb[-1], d_perm[0]]
    skip = draw(st.sampled_from([None, None, None, 0, 3]))
    num = draw(st.one_of(st.none(), st.integers(1, 64)))
    return lb, rb, skip, num


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=layouts(), data=st.data())
def test_plan_read_and_plan_many_agree(spec: tuple, data: st.DataObject) -> None:
    """Each request of a batch gets byte for byte the plan (or the error) that
    plan_read gives it alone, whichever way the batch is paired (all attention
    and valid: in one pass; otherwise one by one)."""
    from kvsidecar.daemon.planner import PlanError, plan_many, plan_many_addressed

    from .test_planner_many import _same

    make, p_tp, d_tp = spec
    P, D = make(p_tp, data.draw(st.integers(4, 16))), make(d_tp, data.draw(st.integers(4, 16)))
    d_rank = data.draw(st.integers(0, d_tp - 1))
    reqs = data.draw(st.lists(_requests(D, P), min_size=1, max_size=4))
    bases = (np.arange(D.num_regions, dtype=np.int64) << 32,
             {p: np.arange(P.num_regions, dtype=np.int64) << 40 for p in range(p_tp)})
    many = plan_many(D, d_rank, P, reqs)
    addressed = plan_many_addressed(D, d_rank, P, reqs, *bases)
    for (lb, rb, skip, num), got, with_addrs in zip(reqs, many, addressed):
        try:
            alone = plan_read(D, d_rank, P, lb, rb, skip_tokens=skip, num_tokens=num)
        except PlanError as e:
            assert isinstance(got, PlanError) and isinstance(with_addrs, PlanError)
            assert (type(got), str(got)) == (type(e), str(e)) == (type(with_addrs),
                                                                 str(with_addrs))
            continue
        assert not isinstance(got, PlanError) and not isinstance(with_addrs, PlanError)
        _same(alone, got)
        _same(alone, with_addrs[0])
        for rr in alone.reads:
            la, ra = with_addrs[1][rr.remote_rank]
            assert np.array_equal(la, bases[0][rr.region] + rr.local_offset)
            assert np.array_equal(ra, bases[1][rr.remote_rank][rr.region] + rr.remote_offset)
