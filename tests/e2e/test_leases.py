"""End to end: hold leases both sides know (issue #7 item 2), real sidecars.

A D sidecar claims the hold on each P rank before it posts, renews while it
reads, and abandons on failure; P refuses claims for holds that ended."""

from __future__ import annotations

import pytest

from kvsidecar.sim.models import attn
from kvsidecar.sim.oracle import Request

pytestmark = pytest.mark.e2e


def test_a_read_after_the_hold_expired_is_refused_before_anything_is_posted(pool) -> None:
    with pool.engines(attn(8), 2, 1) as (P, (D,)):
        sent = P.prefill("late", Request(seed=1, prompt_tokens=24), timeout_s=0.3)
        got_p = P.wait_for(["late"])["late"]
        assert {c.kind for c in got_p.values()} == {"expired"}
        D.start_read(sent)
        got = D.wait_for(["late"])["late"][0]
        assert got.kind == "failed", got
        assert "refused the lease" in got.reason and "has ended (expired)" in got.reason
        assert got.invalid_block_ids


def test_a_failed_read_releases_the_hold_at_once_not_at_its_deadline(pool) -> None:
    """The hold would live 1000 s; the reader's abandon ends it (aborted, naming
    the failure) as soon as the read failed."""
    with pool.engines(attn(8), 1, 2) as (P, (D,)):
        sent = P.prefill("doomed", Request(seed=2, prompt_tokens=24), timeout_s=1000)
        n = P.layout.num_blocks
        for c in D.clients:
            c.read(D.engine_id, "doomed", [D.alloc(1)], sent.remote, [[n + 5]])
        got = D.wait_for(["doomed"])["doomed"]
        assert {c.kind for c in got.values()} == {"failed"}
        held = P.wait_for(["doomed"])["doomed"][0]
        assert held.kind == "aborted", held
        assert "gave up" in held.reason and "block id" in held.reason


def test_the_hold_reply_carries_the_lease_for_the_decode_side(pool) -> None:
    with pool.engines(attn(8), 1, 1) as (P, _):
        ids = P.blocks_for(8)
        held = P.clients[0].hold(P.engine_id, "h", ids, timeout_s=5)
        assert held.lease_s == 10.0 and held.timeout_s == 5
        P.clients[0].release(P.engine_id, "h")
