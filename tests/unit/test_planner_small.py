"""The small planner (Python ints) against the planner: the same plans, the
same addresses, the same errors, for every small attention read tried."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest

from kvsidecar.daemon.planner import PlanError, plan_many_addressed, plan_read
from kvsidecar.daemon.planner.cost import plan_cost
from kvsidecar.daemon.planner.small import SMALL_PIECES, plan_small
from kvsidecar.ipc.layout import Group, Layout, Segment, attention_layout, mla_layout, validate
from kvsidecar.sim.models import hybrid

from .test_planner_many import _same

NB = 64


def attn(layers: int, heads: int, *, separate: bool = False):
    return lambda tp: attention_layout(model="m", num_layers=layers, total_kv_heads=heads,
                                       head_dim=16, block_tokens=4, tp_size=tp, num_blocks=NB,
                                       kv_separate=separate)


def mla(tp: int) -> Layout:
    return mla_layout(model="mla", num_layers=3, latent_dim=32, block_tokens=4, tp_size=tp,
                      num_blocks=NB)


def two_kernel_blocks(tp: int) -> Layout:
    """Two attention groups whose pages hold two kernel blocks each (no shipped
    layout has that without a Mamba or sliding-window group)."""
    kv = 4 * 16 * 2 * 4 // tp  # 4 tokens x 16 dims x bf16 x 4 heads
    segs = (Segment("k", 0, kv, 4), Segment("v", kv, kv, 4))
    group = Group("attention", segs, 2, 2 * kv, 4)
    return validate(Layout("attention", tp, 2, NB, 4 * kv, (group, group), {"name": "two"}))


MAKERS = {"1 layer": attn(1, 4), "3 layers, K and V apart": attn(3, 8, separate=True),
          "2 heads (replicated at tp 4)": attn(2, 2), "mla": mla,
          "two groups of two kernel blocks": two_kernel_blocks}
TPS = [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (1, 4)]


def outcome(fn):
    try:
        return fn()
    except PlanError as e:
        return (type(e), str(e))


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize(("p_tp", "d_tp"), TPS)
def test_small_reads_plan_as_the_planner_plans_them(name: str, p_tp: int, d_tp: int) -> None:
    make = MAKERS[name]
    try:
        local, remote = make(d_tp), make(p_tp)
    except Exception:  # this shape cannot split this layout
        pytest.skip("layout does not split at this tp")
    rng = random.Random(f"{name}{p_tp}{d_tp}")
    ngroups = len(local.groups)
    lb = np.arange(local.num_regions, dtype=np.int64) * 10**9 + 10**6
    rb = {p: np.arange(remote.num_regions, dtype=np.int64) * 10**9 + 7 * 10**6 * (p + 1)
          for p in range(p_tp)}
    tokens_per_page = local.groups[0].sub_blocks * local.groups[0].block_tokens
    for case in range(120):
        d_rank = rng.randrange(d_tp)
        most = max(1, SMALL_PIECES // plan_cost(local, p_tp, ngroups))  # pages a group
        nl = rng.randint(0, most)
        nr = rng.randint(nl, most + 2)
        pages = rng.sample(range(NB), nl * ngroups)
        lids = [pages[g * nl:(g + 1) * nl] for g in range(ngroups)]
        rids = [rng.sample(range(NB), nr) for _ in range(ngroups)]
        if case % 17 == 0 and nl:  # an id out of range, or one named twice
            lids[0][0] = NB + case if case % 2 else (lids[0][1] if nl > 1 else -1)
        skip = rng.choice([None, None, 0, tokens_per_page, 3 * tokens_per_page, 5])
        num = rng.choice([None, None, rng.randint(0, nr * tokens_per_page + 3)])
        want = outcome(functools.partial(plan_read, local, d_rank, remote, lids, rids,
                                         skip_tokens=skip, num_tokens=num, check=False))
        got = outcome(functools.partial(plan_small, local, d_rank, remote, lids, rids, skip,
                                        num, local_bases=lb, remote_bases=rb))
        if plan_cost(local, p_tp, nl * ngroups) > SMALL_PIECES:
            assert got is None  # left to the planner
            continue
        if isinstance(want, tuple):
            assert got == want, (case, lids, rids, skip, num)
            continue
        assert got is not None and not isinstance(got[0], type), (case, nl, nr)
        plan, addrs = got
        _same(plan, want)
        (addressed,) = plan_many_addressed(local, d_rank, remote, [(lids, rids, skip, num)],
                                           lb, rb)
        assert not isinstance(addressed, PlanError)
        assert addrs.keys() == addressed[1].keys()
        for p, (la, ra) in addressed[1].items():
            assert np.array_equal(addrs[p][0], la) and np.array_equal(addrs[p][1], ra)


def test_what_is_not_small_is_left_to_the_planner() -> None:
    local = remote = attn(1, 4)(1)
    few = [[1, 2]]
    assert plan_small(local, 0, remote, few, few) is not None
    many = [list(range(SMALL_PIECES // 2 + 1))]  # 2 pieces a page here
    assert plan_small(local, 0, remote, many, many) is None
    deep = attn(40, 4)(1)  # 80 pieces in one page: numpy's pass is cheaper
    assert plan_small(deep, 0, deep, few, few) is None
    assert plan_small(local, 0, remote, [np.array([1, 2])], few) is None
    assert plan_small(local, 0, remote, [[True, 2]], few) is None
    mixed = hybrid(1, NB)  # a Mamba group
    ids = [[1], [2]] if len(mixed.groups) == 2 else [[i] for i in range(len(mixed.groups))]
    assert plan_small(mixed, 0, mixed, ids, ids) is None
