"""Which P ranks each D rank keeps (daemon/keeps.py): every P rank by exactly one D rank."""

from __future__ import annotations

import pytest

from kvsidecar.daemon.keeps import ranks_kept


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (8, 8), (3, 8)])
def test_every_p_rank_is_kept_by_exactly_one_d_rank(p_tp: int, d_tp: int) -> None:
    kept = [p for d in range(d_tp) for p in ranks_kept(p_tp, d_tp, d)]
    assert sorted(kept) == list(range(p_tp))


def test_a_wider_d_leaves_some_ranks_nothing_to_keep() -> None:
    assert [list(ranks_kept(1, 2, d)) for d in range(2)] == [[0], []]
    assert [list(ranks_kept(4, 2, d)) for d in range(2)] == [[0, 2], [1, 3]]
