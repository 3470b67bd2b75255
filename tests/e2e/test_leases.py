"""End to end: hold leases both sides know (issue #7 item 2), real sidecars.

A D sidecar claims the hold on each P rank before it posts, renews while it
reads, and abandons on failure; P refuses claims for holds that ended."""

from __future__ import annotations

import socket

import pytest

from kvsidecar.ipc.protocol import RemoteEngine
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


def test_a_read_aborted_before_its_first_claim_still_tells_p(pool) -> None:
    """The read links to both P ranks before it claims; P rank 1's address is a
    socket that never answers, so the read is still linking when the engine
    releases it. It ends ``aborted`` and abandons every P rank at once: the
    hold on rank 0 (which would live 1000 s) ends ``aborted`` naming the abort,
    not by its deadline."""
    with pool.engines(attn(8), 2, 1) as (P, (D,)):
        sent = P.prefill("early-abort", Request(seed=3, prompt_tokens=24), timeout_s=1000)
        silent = socket.socket()  # accepts TCP connections, never speaks ZMQ
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        try:
            good = sent.remote
            sent.remote = RemoteEngine(good.engine_id, 2,
                                       [good.handshake[0], f"127.0.0.1:{silent.getsockname()[1]}"])
            rec = D.start_read(sent)
            D.clients[0].release(D.engine_id, "early-abort")
            got = D.wait_for(["early-abort"])["early-abort"][0]
            assert got.kind == "aborted" and "nothing had been posted" in got.reason, got
            assert got.invalid_block_ids == rec.block_ids
            # Rank 1's abandon went to the silent socket: the engine releases that rank.
            P.clients[1].release(P.engine_id, "early-abort")
            held = P.wait_for(["early-abort"], timeout_s=60)["early-abort"]
            assert held[0].kind == "aborted", held[0]
            assert "gave up" in held[0].reason and "aborted" in held[0].reason, held[0]
            assert held[1].kind == "aborted" and "released by the engine" in held[1].reason
        finally:
            silent.close()
