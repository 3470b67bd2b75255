"""Where a read is planned: :func:`plan_cost` (pieces) against what the planner
really cuts a read into, and the loop's share (``INLINE_PLAN_PIECES``)."""

from __future__ import annotations

import random

import pytest

from kvsidecar.daemon.d_side.addresses import INLINE_PLAN_PIECES, INLINE_PLAN_PIECES_ALONE
from kvsidecar.daemon.planner import plan_read
from kvsidecar.daemon.planner.cost import plan_cost
from kvsidecar.ipc.layout import Layout, attention_layout
from kvsidecar.sim.models import attn, hybrid


def _separate(tp: int, num_blocks: int) -> Layout:
    """K and V in regions of their own (two per layer)."""
    return attention_layout(model="m", num_layers=3, total_kv_heads=8, head_dim=64,
                            block_tokens=8, tp_size=tp, num_blocks=num_blocks,
                            kv_separate=True)


SHAPES = [(attn(8), 1, 1), (attn(8), 2, 1), (attn(8), 1, 2), (attn(8), 4, 2),
          (_separate, 1, 1), (_separate, 2, 1), (_separate, 1, 2),
          (hybrid, 1, 1), (hybrid, 2, 1), (hybrid, 1, 2)]


@pytest.mark.parametrize(("make", "p_tp", "d_tp"), SHAPES)
def test_the_cost_bounds_the_pieces_the_planner_cuts(make, p_tp: int, d_tp: int) -> None:
    """Never below the pieces the plan has before coalescing (a read judged
    cheap must be cheap), and exact for a homogeneous attention read, K and V
    in one region or in two."""
    rng = random.Random(p_tp * 10 + d_tp)
    local = make(d_tp, 128)
    for blocks in (1, 2, 7, 16, 64):
        for rank in range(d_tp):
            remote = make(p_tp, 128)
            n = len(local.groups)
            if blocks * n > 128:
                continue
            pages = rng.sample(range(128), blocks * n)  # the groups share the pages
            ids = [pages[g * blocks:(g + 1) * blocks] for g in range(n)]
            rids = [rng.sample(range(128), blocks) for _ in remote.groups]
            g0 = local.groups[0]
            plan = plan_read(local, rank, remote, ids, rids, skip_tokens=0,
                             num_tokens=blocks * g0.sub_blocks * g0.block_tokens)
            cost = plan_cost(local, p_tp, blocks * n)
            assert plan.descriptors_before_coalescing <= cost, (blocks, rank)
            if make is not hybrid and p_tp == d_tp:
                assert plan.descriptors_before_coalescing == cost


def test_small_reads_of_small_models_plan_on_the_loop_large_ones_on_the_thread() -> None:
    one = attention_layout(model="m", num_layers=1, total_kv_heads=4, head_dim=128,
                           block_tokens=8, tp_size=1, num_blocks=4096)
    deep = attention_layout(model="m", num_layers=32, total_kv_heads=8, head_dim=128,
                            block_tokens=16, tp_size=1, num_blocks=4096)
    assert plan_cost(one, 1, 16) == 32 <= INLINE_PLAN_PIECES
    assert plan_cost(deep, 1, 16) == 1024 <= INLINE_PLAN_PIECES  # in a job of several
    assert plan_cost(deep, 1, 128) == 8192 <= INLINE_PLAN_PIECES_ALONE  # a job of one
    assert plan_cost(deep, 1, 129) > INLINE_PLAN_PIECES_ALONE
    assert plan_cost(deep, 2, 64) == 8192  # read from two P ranks: twice the pieces
