"""A read's completion figures (bytes, descriptors before coalescing) come from
its posts, whose sums the planning thread took (``posts_of``): they must be
the plan's own, for homogeneous and hetero-TP plans, notify-only ranks, and
the batch path's addresses (``plan_many_addressed``)."""

from __future__ import annotations

import numpy as np
import pytest

from kvsidecar.daemon.planner import plan_many_addressed, plan_read
from kvsidecar.daemon.reads import PostList, build_posts, lane_of, outcome_of, posts_of
from kvsidecar.daemon.transport.worker import TransferStats
from kvsidecar.sim.models import attn, hybrid


@pytest.mark.parametrize("make,d_tp,p_tp", [(attn(8), 1, 1), (attn(8), 1, 2), (attn(8), 2, 1),
                                            (hybrid, 1, 2), (hybrid, 2, 1)])
def test_outcome_is_the_plans_figures(make, d_tp, p_tp) -> None:  # type: ignore[no-untyped-def]
    D, P = make(d_tp, 64), make(p_tp, 64)
    groups = len(D.groups)
    local = [[1, 2, 3]] + [[4]] * (groups - 1)
    remote = [[7, 8, 9]] + [[10]] * (groups - 1)
    plan = plan_read(D, 0, P, local, remote, skip_tokens=0)
    assert plan.nbytes > 0 and len(plan.notify) == max(1, p_tp // d_tp)
    lb = np.arange(1, 64, dtype=np.int64) << 32
    rb = {r.remote_rank: np.arange(1, 64, dtype=np.int64) << 36 for r in plan.reads}
    posts = build_posts(plan, lb, rb)
    results = [TransferStats(int(p.length.sum()), int(p.length.size), 1.0, 2.0) for p in posts]
    out = outcome_of(plan, posts, results)
    assert (out.nbytes, out.descriptors_before) == (plan.nbytes,
                                                    plan.descriptors_before_coalescing)
    many = plan_many_addressed(D, 0, P, [(local, remote, 0, None)], lb, rb)
    (got,) = many
    assert not isinstance(got, Exception)
    posts2 = posts_of(*got)
    out2 = outcome_of(got[0], posts2, results)
    assert (out2.nbytes, out2.descriptors_before) == (plan.nbytes,
                                                      plan.descriptors_before_coalescing)


def _post(rank: int, n: int) -> PostList:
    a = np.arange(n, dtype=np.int64)
    return PostList(rank, a, a, a)


def test_lanes_spread_p_ranks_with_bytes_and_keep_single_rank_reads_on_lane_0() -> None:
    """``--post-lanes``: the i-th P rank with bytes goes on lane i mod n; bare
    notifications stay on lane 0; a read with bytes from one P rank (homogeneous
    TP, 1→2) is not spread (None: posted on lane 0 with its notification)."""
    two = [_post(0, 5), _post(1, 5)]
    assert lane_of(1, two) is None
    assert lane_of(2, two) == [0, 1]
    four = [_post(r, 3) for r in range(4)]
    assert lane_of(2, four) == [0, 1, 0, 1]
    assert lane_of(3, four) == [0, 1, 2, 0]
    assert lane_of(2, [_post(0, 4)]) is None
    assert lane_of(2, [_post(0, 0), _post(1, 4)]) is None  # one rank has bytes
    assert lane_of(2, [_post(0, 0), _post(1, 4), _post(2, 4)]) == [0, 0, 1]
