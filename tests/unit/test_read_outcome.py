"""A read's completion figures (bytes, descriptors before coalescing) come from
its posts, whose sums the planning thread took (``posts_of``): they must be
the plan's own, for homogeneous and hetero-TP plans, notify-only ranks, and
the batch path's addresses (``plan_many_addressed``)."""

from __future__ import annotations

import numpy as np
import pytest

from kvsidecar.daemon.d_side.addresses import PostList, build_posts, posts_of
from kvsidecar.daemon.d_side.parts import joined, lane_of, split_post
from kvsidecar.daemon.d_side.posting import outcome_of
from kvsidecar.daemon.planner import plan_many_addressed, plan_read
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


def test_a_large_single_post_is_split_over_the_lanes_byte_for_byte() -> None:
    """A read with bytes from one P rank (homogeneous) of at least the split size
    is cut into one part per lane of about equal bytes, page-aligned cuts, each
    local byte still paired with its remote byte; the parts' outcomes join back
    into the post's (a failure of any part is the post's)."""
    rng = np.random.default_rng(3)
    lens = rng.integers(1, 64, 40).astype(np.int64) * 4096 + 512
    local = np.cumsum(np.append(0, lens[:-1] + 8192)).astype(np.int64) + (1 << 32)
    remote = local + (5 << 36)
    post = PostList(0, local, remote, lens, 40, int(lens.sum()))
    bare = PostList(1, np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))
    assert split_post(2, [post], min_bytes=int(lens.sum()) + 1) is None
    assert split_post(1, [post], min_bytes=1) is None
    assert split_post(2, [post, post], min_bytes=1) is None  # two ranks: lane_of spreads them
    for n in (2, 3):
        got = split_post(n, [bare, post], min_bytes=1)
        assert got is not None
        parts, owner = got
        assert owner == [0] + [1] * n and parts[0] is bare
        cut = parts[1:]
        sizes = [int(p.length.sum()) for p in cut]
        assert sum(sizes) == int(lens.sum()) and max(sizes) - min(sizes) <= n * 4096
        assert all(s % 4096 == 0 for s in np.cumsum(sizes)[:-1])

        def bytes_of(ps: list[PostList]) -> set[tuple[int, int]]:
            # every (local, remote) byte pair, by 512-byte steps (all lengths are multiples)
            out = set()
            for p in ps:
                for a, b, n_ in zip(p.local, p.remote, p.length):
                    out.update((int(a) + k, int(b) + k) for k in range(0, int(n_), 512))
            return out

        assert bytes_of(cut) == bytes_of([post])
    stats = [TransferStats(10, 2, 1.0, 5.0), TransferStats(20, 3, 4.0, 2.0)]
    assert joined([None, *stats], [0, 1, 1], 2) == [None, TransferStats(30, 5, 4.0, 5.0)]
    boom = RuntimeError("lane 1 failed")
    assert joined([None, stats[0], boom], [0, 1, 1], 2)[1] is boom
    assert joined([None, boom, stats[0]], [0, 1, 1], 2)[1] is boom
