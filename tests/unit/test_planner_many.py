"""plan_many: several requests planned in one pass give each request exactly
the bytes LAYOUT.md section 6 says (oracle), and the very plan plan_read gives
it alone; a request that cannot be planned fails alone."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvsidecar.daemon.d_side.addresses import build_posts, posts_of
from kvsidecar.daemon.planner import (
    PlanError,
    ReadPlan,
    plan_many,
    plan_many_addressed,
    plan_read,
)
from kvsidecar.daemon.planner.pairing import _attention_pairs_many
from kvsidecar.ipc.layout import Layout
from kvsidecar.sim.hostcopy import apply_plan
from kvsidecar.sim.oracle import POISON, Request, check_received, fill_shard

from .test_planner_oracle import FAMILIES, Make, _tokens_per_block

PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2)]


def _ids(rng: np.random.Generator, layout: Layout, tokens: int, skip: int = 0,
         consecutive: bool = False) -> list[list[int]]:
    """Block ids per group (the groups share pages: no id twice)."""
    counts = [-(-(tokens - skip) // _tokens_per_block(layout, gi)) if g.kind == "attention"
              else 1 for gi, g in enumerate(layout.groups)]
    nb = layout.num_blocks
    if consecutive:
        start = int(rng.integers(0, nb - sum(counts) + 1))
        pool = iter(range(start, start + sum(counts)))
    else:
        pool = iter(rng.permutation(nb).tolist())
    return [[next(pool) for _ in range(n)] for n in counts]


def _same(a: ReadPlan, b: ReadPlan) -> None:
    assert a.notify == b.notify
    assert len(a.reads) == len(b.reads)
    for x, y in zip(a.reads, b.reads):
        assert x.remote_rank == y.remote_rank
        assert x.descriptors_before_coalescing == y.descriptors_before_coalescing
        for f in ("region", "local_offset", "remote_offset", "length"):
            u, v = getattr(x, f), getattr(y, f)
            assert u.dtype == v.dtype and np.array_equal(u, v), f


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("p_tp", "d_tp"), PAIRS)
@pytest.mark.parametrize("with_bad", [True, False], ids=["one-bad", "all-good"])
def test_each_request_gets_the_oracle_bytes_and_plan_reads_plan(family: str, p_tp: int,
                                                                d_tp: int,
                                                                with_bad: bool) -> None:
    """With a bad request among them the batch is planned one by one; all good
    and all attention, in one pass per group (_attention_pairs_many)."""
    make: Make = FAMILIES[family]
    rng = np.random.default_rng(p_tp * 10 + d_tp)
    P, D = make(p_tp, 40), make(d_tp, 48)
    tokens = 37
    req = Request(seed=7, prompt_tokens=tokens)
    p_ids = _ids(rng, P, tokens)
    p_bufs = {p: [rng.integers(0, 256, P.region_bytes, dtype=np.uint8)
                  for _ in range(P.num_regions)] for p in range(p_tp)}
    for p in range(p_tp):
        fill_shard(p_bufs[p], P, p, p_ids, req)
    for j in range(d_tp):
        d_ids = _ids(rng, D, tokens)
        # Other requests around it: consecutive ids (they coalesce), a bad one, an empty one.
        others = [(_ids(rng, D, tokens, consecutive=True), _ids(rng, P, tokens,
                                                                consecutive=True), 0, None),
                  ([[D.num_blocks]] + [[0]] * (len(D.groups) - 1), p_ids, 0, None),
                  ([[] for _ in D.groups], p_ids, 0, None),
                  (_ids(rng, D, tokens), _ids(rng, P, tokens), None, None)]
        reqs = [others[0], others[1], (d_ids, p_ids, 0, None), others[2], others[3]]
        if not with_bad:
            reqs[1] = (_ids(rng, D, tokens), _ids(rng, P, tokens), 0, tokens)  # trimmed
        fast = _attention_pairs_many(D, P, reqs)
        attention = all(g.kind == "attention" for g in D.groups)
        assert (fast is not None) == (attention and not with_bad)
        many = plan_many(D, j, P, reqs)
        assert isinstance(many[1], PlanError) == with_bad
        for (lb, rb, skip, num), got in zip(reqs, many):
            if isinstance(got, PlanError):
                with pytest.raises(PlanError, match=re.escape(str(got))):
                    plan_read(D, j, P, lb, rb, skip_tokens=skip, num_tokens=num, check=False)
                continue
            _same(plan_read(D, j, P, lb, rb, skip_tokens=skip, num_tokens=num, check=False),
                  got)
        plan = many[2]
        assert isinstance(plan, ReadPlan)
        d_bufs = [np.full(D.region_bytes, POISON, np.uint8) for _ in range(D.num_regions)]
        apply_plan(plan, d_bufs, p_bufs)
        problems = check_received(d_bufs, D, j, d_ids, req, 0)
        assert not problems, f"P{p_tp}->D{d_tp} rank {j}: " + "; ".join(problems[:3])


def test_only_failures_and_nothing() -> None:
    make = FAMILIES["attn-K2"]
    D, P = make(1, 8), make(1, 8)
    assert plan_many(D, 0, P, []) == []
    (bad,) = plan_many(D, 0, P, [([[9]], [[0]], None, None)])
    assert isinstance(bad, PlanError) and "out of range" in str(bad)


def test_neighbouring_requests_never_merge() -> None:
    """Request 2's first block continues request 1's last on both sides: each
    still gets its own descriptors (coalescing stops at a request's end)."""
    make = FAMILIES["attn-K2"]
    D, P = make(1, 16), make(1, 32)
    reqs = [([[0, 1, 2, 3]], [[10, 11, 12, 13]], None, None),
            ([[4, 5, 6, 7]], [[14, 15, 16, 17]], None, None)]
    many = plan_many(D, 0, P, reqs)
    for (lb, rb, _, _), got in zip(reqs, many):
        assert isinstance(got, ReadPlan)
        _same(plan_read(D, 0, P, lb, rb, check=False), got)
        assert got.nbytes == plan_read(D, 0, P, lb, rb, check=False).nbytes


def test_a_check_one_request_fails_sends_the_batch_one_by_one() -> None:
    """Duplicate local ids or a bad skip in one request: the one-pass pairing
    declines (None) and that request alone fails, with plan_read's error."""
    make = FAMILIES["attn-K2"]
    D, P = make(1, 16), make(1, 32)
    good = ([[0, 1]], [[10, 11]], None, None)
    for bad in (([[3, 3]], [[12, 13]], None, None), ([[5, 6]], [[12, 13]], 3, None)):
        reqs = [good, bad]
        assert _attention_pairs_many(D, P, reqs) is None
        got = plan_many(D, 0, P, reqs)
        assert isinstance(got[0], ReadPlan) and isinstance(got[1], PlanError)
        with pytest.raises(PlanError, match=re.escape(str(got[1]))):
            plan_read(D, 0, P, bad[0], bad[1], skip_tokens=bad[2], check=False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("p_tp", "d_tp"), PAIRS)
def test_addresses_added_in_one_pass_are_each_plans_own(family: str, p_tp: int,
                                                         d_tp: int) -> None:
    """plan_many_addressed: the plans of plan_many, and per P rank the addresses
    build_posts adds to each plan_read plan on its own (bases per region, and
    per P rank on the remote side); a bad request fails alone."""
    make: Make = FAMILIES[family]
    rng = np.random.default_rng(p_tp * 7 + d_tp)
    P, D = make(p_tp, 40), make(d_tp, 48)
    tokens = 37
    local_bases = rng.integers(1, 1 << 40, D.num_regions).astype(np.int64) * 4096
    remote_bases = {p: rng.integers(1, 1 << 40, P.num_regions).astype(np.int64) * 4096
                    for p in range(p_tp)}
    for j in range(d_tp):
        reqs = [(_ids(rng, D, tokens, consecutive=c), _ids(rng, P, tokens, consecutive=c),
                 0, None) for c in (True, False, False)]
        reqs.append(([[D.num_blocks]] + [[0]] * (len(D.groups) - 1), reqs[0][1], 0, None))
        got = plan_many_addressed(D, j, P, reqs, local_bases, remote_bases)
        assert isinstance(got[3], PlanError) and "out of range" in str(got[3])
        for (lb, rb, skip, num), one in zip(reqs[:3], got[:3]):
            assert not isinstance(one, PlanError)
            plan, addrs = one
            alone = plan_read(D, j, P, lb, rb, skip_tokens=skip, num_tokens=num, check=False)
            _same(alone, plan)
            want = build_posts(alone, local_bases, remote_bases)
            have = posts_of(plan, addrs)
            assert [w.rank for w in want] == [h.rank for h in have]
            for w, h in zip(want, have):
                for f in ("local", "remote", "length"):
                    assert np.array_equal(getattr(w, f), getattr(h, f)), f
                assert w.descriptors_before == h.descriptors_before
