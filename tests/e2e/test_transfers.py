"""End to end: real sidecar processes, real NIXL (UCX, host DRAM in shared memory),
every byte checked with the LAYOUT.md oracle."""

from __future__ import annotations

import time

import pytest

from kvsidecar.ipc.protocol import Completion, ReaderReport
from kvsidecar.sim.cluster import SimEngine
from kvsidecar.sim.models import MakeLayout, attn, hybrid, mla
from kvsidecar.sim.oracle import Request

pytestmark = pytest.mark.e2e

FAMILIES: dict[str, MakeLayout] = {"attn-K8": attn(8), "attn-K2": attn(2), "hybrid": hybrid,
                                   "mla": mla}
PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]
FAST = {(1, 2), (4, 1)}


def assert_received(D: SimEngine, rids: list[str]) -> dict[str, dict[int, Completion]]:
    got = D.wait_for(rids)
    for rid in rids:
        kinds = {r: c.kind for r, c in got[rid].items()}
        assert set(kinds.values()) == {"received"}, (rid, got[rid])
        problems = D.verify(rid)
        assert not problems, f"{rid}: " + "; ".join(problems[:3])
    return got


def assert_sent(P: SimEngine, rids: list[str]) -> None:
    got = P.wait_for(rids)
    for rid in rids:
        assert {c.kind for c in got[rid].values()} == {"sent"}, got[rid]


def _pair_params() -> list:
    out = []
    for fam in FAMILIES:
        for pair in PAIRS:
            marks = [] if pair in FAST and fam in ("hybrid", "attn-K2") else [pytest.mark.slow]
            out.append(pytest.param(fam, *pair, marks=marks, id=f"{fam}-{pair[0]}p{pair[1]}d"))
    return out


@pytest.mark.parametrize(("family", "p_tp", "d_tp"), _pair_params())
def test_hetero_tp_transfer(pool, family: str, p_tp: int, d_tp: int) -> None:
    with pool.engines(FAMILIES[family], p_tp, d_tp) as (P, (D,)):
        rids = []
        for i, tokens in enumerate((5, 77, 200)):
            rid = f"{family}-{i}"
            D.start_read(P.prefill(rid, Request(seed=100 * p_tp + 10 * d_tp + i,
                                                prompt_tokens=tokens)))
            rids.append(rid)
        assert_received(D, rids)
        assert_sent(P, rids)


def test_many_requests_in_flight(pool) -> None:
    with pool.engines(hybrid, 1, 2, blocks=256) as (P, (D,)):
        rids = [f"many-{i}" for i in range(24)]
        sents = [P.prefill(rid, Request(seed=i, prompt_tokens=40 + 13 * i))
                 for i, rid in enumerate(rids)]
        for s in sents:
            D.start_read(s)
        assert_received(D, rids)
        assert_sent(P, rids)


def test_hold_for_two_decode_engines(pool) -> None:
    with pool.engines(hybrid, 1, 2, n_d=2) as (P, (D1, D2)):
        sent = P.prefill("shared", Request(seed=5, prompt_tokens=90), readers=2)
        D1.start_read(sent)
        # Every rank read bytes, in descriptors it reports with the completion,
        # in one transfer from P's only rank.
        for c in assert_received(D1, ["shared"])["shared"].values():
            assert c.nbytes > 0 and c.descriptors > 0, c
            assert [t.remote_rank for t in c.transfers] == [0]
            assert (c.transfers[0].nbytes, c.transfers[0].descriptors) == (c.nbytes,
                                                                            c.descriptors)
        time.sleep(0.5)
        P.poll()
        assert not any(c.request_id == "shared" for cs in P.completions.values() for c in cs), \
            "released after one of two readers"
        D2.start_read(sent)
        assert_received(D2, ["shared"])
        got = P.wait_for(["shared"])["shared"]
        # The sent completion says who was served: both engines, each from both ranks.
        want = [ReaderReport(D.engine_id, [0, 1], finished=True) for D in (D1, D2)]
        assert [(c.kind, c.readers) for c in got.values()] == [("sent", want)]


def test_notification_before_hold_completes_hold_at_once(pool) -> None:
    """Asynchronous scheduling: D can finish before P calls hold."""
    with pool.engines(attn(2), 2, 1) as (P, (D,)):
        sent = P.prefill("early", Request(seed=9, prompt_tokens=30), hold=False)
        D.start_read(sent)
        assert_received(D, ["early"])
        for rank in range(P.tp):
            P.clients[rank].hold(P.engine_id, "early", sent.block_ids)
        assert_sent(P, ["early"])


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)])
def test_partial_prefix_hit_with_different_sub_blocks(pool, p_tp: int, d_tp: int) -> None:
    with pool.engines(hybrid, p_tp, d_tp) as (P, (D,)):
        assert P.layout.groups[0].sub_blocks != D.layout.groups[0].sub_blocks
        per_block = D.layout.groups[0].sub_blocks * D.layout.groups[0].block_tokens
        sent = P.prefill("hit", Request(seed=3, prompt_tokens=3 * per_block + 5))
        D.start_read(sent, skip_blocks=2)
        assert_received(D, ["hit"])
        assert_sent(P, ["hit"])


def test_partial_prefix_hit_inferred_skip(pool) -> None:
    with pool.engines(attn(8), 2, 2) as (P, (D,)):
        sent = P.prefill("tail", Request(seed=4, prompt_tokens=8 * 6))
        D.start_read(sent, skip_blocks=4, explicit_skip=False)
        assert_received(D, ["tail"])
        assert_sent(P, ["tail"])


def test_full_prefix_hit_reads_nothing_and_notifies(pool) -> None:
    with pool.engines(hybrid, 4, 1) as (P, (D,)):
        sent = P.prefill("full", Request(seed=2, prompt_tokens=64))
        D.start_read(sent, full_hit=True)
        got = D.wait_for(["full"])
        assert {c.kind for c in got["full"].values()} == {"received"}
        assert all(c.nbytes == 0 for c in got["full"].values())
        assert not D.verify("full")
        assert_sent(P, ["full"])


def test_attach_mode_engine_owned_memory(pool) -> None:
    with pool.engines(hybrid, 2, 1, attach=True) as (P, (D,)):
        D.start_read(P.prefill("attached", Request(seed=8, prompt_tokens=33)), trim=False)
        assert_received(D, ["attached"])
        assert_sent(P, ["attached"])
