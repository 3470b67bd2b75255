"""Plans checked byte for byte against the LAYOUT.md section 6 oracle, without NIXL.

For every (family, P_tp, D_tp) the logical state of one request is sharded
into every P rank's pages (the rest of P's memory is noise), each D rank
starts from poison, applies its plan with plain memcpy and must end up with
exactly its own shard, and nothing outside the named pages.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest

from kvsidecar.daemon.planner import plan_read
from kvsidecar.ipc.layout import (
    Layout,
    attention_layout,
    gdn_hybrid_layout,
    mamba1_layout,
    mamba2_hybrid_layout,
    mla_layout,
)
from kvsidecar.sim.hostcopy import apply_plan
from kvsidecar.sim.oracle import POISON, Request, check_received, fill_shard

Make = Callable[[int, int], Layout]
TPS = (1, 2, 4, 8)
KBS = 4  # tokens per kernel block in these small layouts


def attn(k: int, separate: bool = False) -> Make:
    return lambda tp, nb: attention_layout(
        model="m", num_layers=2, total_kv_heads=k, head_dim=4, block_tokens=KBS,
        tp_size=tp, num_blocks=nb, kv_separate=separate,
    )


def mla() -> Make:
    return lambda tp, nb: mla_layout(model="m", num_layers=2, latent_dim=12, block_tokens=KBS,
                                     tp_size=tp, num_blocks=nb)


def mamba2(k: int, n_groups: int, order: tuple[str, ...] = ("attention", "mamba")) -> Make:
    return lambda tp, nb: mamba2_hybrid_layout(
        model="m", num_layers=2, total_kv_heads=k, head_dim=4, block_tokens=KBS,
        intermediate_size=32, n_groups=n_groups, d_state=4, conv_kernel=4, mamba_heads=8,
        mamba_head_dim=4, tp_size=tp, num_blocks=nb, group_order=order,  # type: ignore[arg-type]
    )


def gdn(k: int) -> Make:
    return lambda tp, nb: gdn_hybrid_layout(
        model="m", num_layers=2, total_kv_heads=k, head_dim=4, block_tokens=KBS,
        num_k_heads=8, num_v_heads=16, head_k_dim=2, head_v_dim=2, conv_kernel=3,
        tp_size=tp, num_blocks=nb,
    )


def mamba1(k: int) -> Make:
    return lambda tp, nb: mamba1_layout(
        model="m", num_layers=3, intermediate_size=16, d_state=4, conv_kernel=4, tp_size=tp,
        num_blocks=nb, total_kv_heads=k, head_dim=4 if k else 0, block_tokens=KBS if k else 0,
    )


FAMILIES: dict[str, Make] = {
    **{f"attn-K{k}": attn(k) for k in (1, 2, 4, 8)},
    **{f"attn-sep-K{k}": attn(k, True) for k in (2, 8)},
    "mla": mla(),
    **{f"mamba2-K{k}-g{g}": mamba2(k, g) for k in (1, 2, 4, 8) for g in (1, 8)},
    "mamba2-mamba-first": mamba2(2, 8, ("mamba", "attention")),
    "gdn-K2": gdn(2),
    "mamba1-pure": mamba1(0),
    "mamba1-hybrid-K4": mamba1(4),
}


def _tokens_per_block(layout: Layout, gi: int) -> int:
    g = layout.groups[gi]
    return g.sub_blocks * g.block_tokens


def run_transfer(
    make: Make,
    p_tp: int,
    d_tp: int,
    *,
    seed: int = 0,
    prompt_tokens: int = 37,
    skip_blocks: int = 0,
    explicit_skip: bool = True,
    mamba_pages: int = 1,
    full_hit: bool = False,
    p_blocks: int = 40,
    d_blocks: int = 48,
    trim: bool = False,
) -> list[tuple[int, int, int]]:
    """Move one request P -> D with every D rank; returns (rank, descs before, after)."""
    rng = np.random.default_rng(seed)
    P, D = make(p_tp, p_blocks), make(d_tp, d_blocks)
    req = Request(seed=seed + 1, prompt_tokens=prompt_tokens)
    # P's block lists cover the whole prompt from token 0.
    p_ids: list[list[int]] = []
    pool = iter(rng.permutation(p_blocks).tolist())
    for gi, g in enumerate(P.groups):
        n = -(-prompt_tokens // _tokens_per_block(P, gi)) if g.kind == "attention" else mamba_pages
        p_ids.append([next(pool) for _ in range(n)])
    p_bufs = {
        p: [rng.integers(0, 256, P.region_bytes, dtype=np.uint8) for _ in range(P.num_regions)]
        for p in range(p_tp)
    }
    for p in range(p_tp):
        fill_shard(p_bufs[p], P, p, p_ids, req)
    out = []
    for j in range(d_tp):
        skip = 0
        d_ids: list[list[int]] = []
        pool = iter(rng.permutation(d_blocks).tolist())
        for gi, g in enumerate(D.groups):
            if full_hit:
                n = 0
            elif g.kind == "attention":
                tpb = _tokens_per_block(D, gi)
                skip = skip_blocks * tpb
                n = -(-(prompt_tokens - skip) // tpb)
            else:
                n = mamba_pages
            d_ids.append([next(pool) for _ in range(n)])
        d_bufs = [np.full(D.region_bytes, POISON, np.uint8) for _ in range(D.num_regions)]
        plan = plan_read(D, j, P, d_ids, p_ids, skip_tokens=skip if explicit_skip else None,
                         num_tokens=prompt_tokens if trim else None)
        apply_plan(plan, d_bufs, p_bufs)
        problems = check_received(d_bufs, D, j, d_ids, req, skip)
        assert not problems, f"P{p_tp}->D{d_tp} rank {j}: " + "; ".join(problems[:3])
        if full_hit:
            assert plan.reads == () and len(plan.notify) >= 1
        out.append((j, plan.descriptors_before_coalescing, plan.descriptors))
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("p_tp", "d_tp"), list(itertools.product(TPS, TPS)))
def test_oracle_matrix(family: str, p_tp: int, d_tp: int) -> None:
    run_transfer(FAMILIES[family], p_tp, d_tp, seed=p_tp * 10 + d_tp)


@pytest.mark.parametrize("family", ["attn-K2", "mamba2-K2-g1", "mamba2-K8-g8", "gdn-K2", "mla"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (2, 8)])
def test_partial_prefix_hit_explicit_skip(family: str, p_tp: int, d_tp: int) -> None:
    run_transfer(FAMILIES[family], p_tp, d_tp, prompt_tokens=90, skip_blocks=1)


@pytest.mark.parametrize("family", ["mamba2-K2-g1", "mamba2-K8-g8", "gdn-K2"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 4), (4, 1), (1, 2), (8, 2)])
@pytest.mark.parametrize("skip_blocks", [0, 1, 2])
def test_skip_inferred_from_num_tokens_when_sub_blocks_differ(
    family: str, p_tp: int, d_tp: int, skip_blocks: int
) -> None:
    run_transfer(FAMILIES[family], p_tp, d_tp, prompt_tokens=150, skip_blocks=skip_blocks,
                 explicit_skip=False, trim=True)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 2), (1, 2), (4, 2)])
def test_partial_prefix_hit_inferred_skip(p_tp: int, d_tp: int) -> None:
    # Pure attention keeps sub_blocks 1 on both sides, so skip may be inferred.
    run_transfer(FAMILIES["attn-K8"], p_tp, d_tp, prompt_tokens=50, skip_blocks=3,
                 explicit_skip=False)


@pytest.mark.parametrize("family", ["attn-K8", "mamba2-K2-g8", "mla"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 4), (4, 1)])
def test_full_prefix_hit_reads_nothing_but_notifies(family: str, p_tp: int, d_tp: int) -> None:
    run_transfer(FAMILIES[family], p_tp, d_tp, full_hit=True)


@pytest.mark.parametrize("family", ["attn-K2", "mamba2-K2-g1", "gdn-K2", "mamba1-hybrid-K4"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 4), (4, 1), (2, 8)])
@pytest.mark.parametrize("skip_blocks", [0, 1])
def test_trimmed_to_prompt_length(family: str, p_tp: int, d_tp: int, skip_blocks: int) -> None:
    run_transfer(FAMILIES[family], p_tp, d_tp, prompt_tokens=93, skip_blocks=skip_blocks,
                 trim=True)


def test_trimming_reads_only_kernel_blocks_holding_tokens() -> None:
    make = FAMILIES["mamba2-K2-g1"]
    P, D = make(1, 8), make(2, 8)
    per_page = D.groups[0].sub_blocks * KBS
    full = plan_read(D, 0, P, [[0], [1]], [[2], [3]], skip_tokens=0)
    short = plan_read(D, 0, P, [[0], [1]], [[2], [3]], skip_tokens=0, num_tokens=KBS + 1)
    kb_read = 2 * P.num_regions * D.groups[0].kernel_block_bytes  # two kernel blocks
    mamba = P.num_regions * sum(s.nbytes_local for s in D.groups[1].segments)
    assert per_page > KBS + 1
    assert short.nbytes == kb_read + mamba < full.nbytes


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (4, 8)])
def test_several_mamba_pages_and_regions(p_tp: int, d_tp: int) -> None:
    run_transfer(FAMILIES["mamba2-K4-g8"], p_tp, d_tp, mamba_pages=3, prompt_tokens=70)


def test_different_sub_blocks_are_exercised() -> None:
    """The matrix really contains P/D pairs whose pages hold different kernel-block counts."""
    make = FAMILIES["mamba2-K2-g8"]
    assert make(1, 8).groups[0].sub_blocks != make(4, 8).groups[0].sub_blocks


def test_homogeneous_consecutive_blocks_coalesce_to_one_descriptor_per_region() -> None:
    P, D = attn(8)(2, 16), attn(8)(2, 16)
    plan = plan_read(D, 1, P, [[3, 4, 5, 6]], [[8, 9, 10, 11]])
    (rr,) = plan.reads
    assert rr.descriptors_before_coalescing == 2 * 4 * 2  # regions * blocks * (k, v)
    assert rr.descriptors == 2
    assert rr.length.tolist() == [4 * D.page_bytes] * 2


def test_oracle_catches_a_wrong_plan() -> None:
    """Mutation check: shifting one descriptor by one unit must be reported."""
    P, D = mamba2(2, 8)(1, 8), mamba2(2, 8)(2, 8)
    req = Request(3, 9)
    p_ids = [[1, 2, 3], [4]]
    d_ids = [[0, 5, 6], [7]]
    pb = {0: [np.zeros(P.region_bytes, np.uint8) for _ in range(P.num_regions)]}
    fill_shard(pb[0], P, 0, p_ids, req)
    plan = plan_read(D, 1, P, d_ids, p_ids, skip_tokens=0)
    rr = plan.reads[0]
    rr.remote_offset[-1] -= 8
    db = [np.full(D.region_bytes, POISON, np.uint8) for _ in range(D.num_regions)]
    apply_plan(plan, db, pb)
    assert check_received(db, D, 1, d_ids, req, 0)
