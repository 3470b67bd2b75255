"""End to end: several reads, holds and releases in one engine message
(``Batch``, protocol minor 5), each answered on its own."""

from __future__ import annotations

import dataclasses

import pytest

from kvsidecar.ipc.client import BadRequest, Duplicate, HoldSpec, ReadSpec, UnknownEngine
from kvsidecar.ipc.protocol import MAX_BATCH, PROTOCOL_MINOR, Held
from kvsidecar.sim.cluster import fill_shard
from kvsidecar.sim.models import attn, hybrid
from kvsidecar.sim.oracle import Request

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("make,p_tp,d_tp", [(attn(8), 1, 1), (hybrid, 1, 2), (hybrid, 2, 1)],
                         ids=["attention-1-1", "hybrid-1-2", "hybrid-2-1"])
def test_batched_holds_and_reads_move_oracle_exact_bytes(pool, make, p_tp, d_tp) -> None:
    with pool.engines(make, p_tp, d_tp) as (P, (D,)):
        assert D.clients[0].ping().minor == PROTOCOL_MINOR >= 5
        sents = []
        for i in range(6):
            sent = P.prefill(f"b{i}", Request(seed=40 + i, prompt_tokens=8 + 16 * i), hold=False)
            sents.append(sent)
        for rank in range(p_tp):
            held = P.clients[rank].hold_many(P.engine_id, [HoldSpec(s.request_id, s.block_ids)
                                                           for s in sents])
            assert all(isinstance(h, Held) for h in held), held
        D.start_reads(sents)
        rids = [s.request_id for s in sents]
        got = D.wait_for(rids)
        assert {c.kind for per in got.values() for c in per.values()} == {"received"}
        for rid in rids:
            assert not D.verify(rid), rid
        sent_back = P.wait_for(rids)
        assert {c.kind for per in sent_back.values() for c in per.values()} == {"sent"}


def test_a_refused_item_refuses_only_itself(pool) -> None:
    """Good items around a bad one are accepted and complete; the bad ones get
    their own errors, in order."""
    with pool.engines(attn(8), 1, 1) as (P, (D,)):
        c = D.clients[0]
        good = [P.prefill(f"ok{i}", Request(seed=i, prompt_tokens=16)) for i in range(3)]
        ids = [D.alloc(2) for _ in good]
        specs = [
            ReadSpec("ok0", [ids[0]], good[0].remote, good[0].block_ids,
                     remote_tokens=good[0].tokens),
            ReadSpec("far", [[10**6]], good[1].remote, good[1].block_ids,   # out of range
                     remote_tokens=good[1].tokens),
            ReadSpec("ok1", [ids[1]], good[1].remote, good[1].block_ids,
                     remote_tokens=good[1].tokens),
            ReadSpec("ok1", [ids[2]], good[2].remote, good[2].block_ids,   # duplicate id
                     remote_tokens=good[2].tokens),
            ReadSpec("ok2", [ids[2]], good[2].remote, good[2].block_ids,
                     remote_tokens=good[2].tokens),
        ]
        out = c.read_many(D.engine_id, specs)
        assert out[0] is None and out[2] is None and out[4] is None
        assert isinstance(out[1], BadRequest) and "out of range" in str(out[1])
        assert isinstance(out[3], Duplicate)
        got = D.wait_for(["ok0", "ok1", "ok2"])
        assert {per[0].kind for per in got.values()} == {"received"}
        # A batch for an engine nobody registered refuses each item the same way.
        assert all(isinstance(e, UnknownEngine) for e in c.read_many("nobody", specs[:2]))


def test_a_release_in_a_batch_drops_its_hold(pool) -> None:
    with pool.engines(attn(8), 1, 1) as (P, _):
        c = P.clients[0]
        ids = P.blocks_for(16)
        fill_shard(P.buffers[0], P.layout, 0, ids, Request(seed=9, prompt_tokens=16))
        (held,) = c.hold_many(P.engine_id, [HoldSpec("gone", ids, timeout_s=60)])
        assert isinstance(held, Held)
        out = c.release_many(P.engine_id, ["gone", "never-held"])
        assert out[0] is None and isinstance(out[1], BadRequest)
        assert P.wait_for(["gone"])["gone"][0].kind == "aborted"


def test_a_batch_is_bounded(pool) -> None:
    with pool.engines(attn(8), 1, 1) as (P, _):
        spec = HoldSpec("x", [[0]])
        with pytest.raises(ValueError, match=f"at most {MAX_BATCH}"):
            P.clients[0].hold_many(P.engine_id, [spec] * (MAX_BATCH + 1))
        assert P.clients[0].hold_many(P.engine_id, []) == []


def test_reads_planned_and_posted_as_a_group_fail_alone(pool) -> None:
    """16 reads in one read_many are planned in one planning-thread job and
    posted in one worker job. One whose remote block ids lie outside P's cache
    (found only when planning: P's engine issued its token for them, and holds
    nothing under its id, so its claim is granted early) fails alone, one
    aborted right after the batch ends aborted, and the other 14 land
    oracle-exact."""
    with pool.engines(attn(8), 1, 1) as (P, (D,)):
        sents = [P.prefill(f"g{i}", Request(seed=70 + i, prompt_tokens=8 + 3 * i),
                           hold=i != 5)
                 for i in range(16)]
        bad = sents[5]
        far = [[P.layout.num_blocks + 7, *bad.block_ids[0][1:]]]
        sents[5] = dataclasses.replace(bad, block_ids=far, tokens=P.issue_tokens("g5", far))
        recs = D.start_reads(sents)
        D.clients[0].release(D.engine_id, "g9")
        rids = [s.request_id for s in sents]
        got = {rid: per[0] for rid, per in D.wait_for(rids).items()}
        assert got["g5"].kind == "failed" and "out of range" in got["g5"].reason
        assert got["g5"].invalid_block_ids == recs[5].block_ids
        assert got["g9"].kind == "aborted"
        assert got["g9"].invalid_block_ids == recs[9].block_ids
        for rid in rids:
            if rid not in ("g5", "g9"):
                assert got[rid].kind == "received", (rid, got[rid])
                assert not D.verify(rid), rid
        # P's holds of the good reads were all read (the aborted one may have been
        # read before the abort came); P held nothing for the failed one.
        sent_back = {rid: per[0].kind
                     for rid, per in P.wait_for([r for r in rids if r != "g5"]).items()}
        assert {k for rid, k in sent_back.items() if rid != "g9"} == {"sent"}


def test_a_batch_too_long_for_one_packet_waits_and_still_reports_through_poll(pool) -> None:
    """``hold_many_nowait`` of a batch over one packet (40,000 block ids) waits
    for its answer; the refused item still comes as a ``failed`` completion
    from the next poll, the other is placed."""
    with pool.engines(attn(8), 1, 1) as (P, _):
        c = P.clients[0]
        ids = P.blocks_for(16)
        c.hold_many_nowait(P.engine_id, [HoldSpec("long", [list(range(40_000))]),
                                         HoldSpec("fine", ids, timeout_s=60)])
        assert len(c._core.posted) == 0  # answered before the call returned
        got = c.poll(P.engine_id)
        assert [(x.request_id, x.kind) for x in got] == [("long", "failed")]
        assert "(bad_request)" in got[0].reason and "out of range" in got[0].reason
        c.release(P.engine_id, "fine")
        assert P.wait_for(["fine"])["fine"][0].kind == "aborted"
