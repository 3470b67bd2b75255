"""D's side of a handoff (a request whose prompt P computed), through vLLM
0.33's real scheduler and real sidecars: the scenarios of vLLM's own
``test_remote_prefill_lifecycle.py`` and the scheduler-side NixlConnector
cases, put to KvSidecarConnector with the bytes checked by the oracle.

The contract, as vLLM's tests state it: while the read runs the request waits
(``WAITING_FOR_REMOTE_KVS``) on blocks that are allocated but not yet in the
prefix cache; once a worker reports it in ``finished_recving`` the scheduler
caches the full blocks and runs the rest of the prompt; when it ends, every
block is back in the pool and nothing is left in the scheduler.
"""

from __future__ import annotations

import os
import signal

import pytest

if os.environ.get("KVSIDECAR_REQUIRE_VLLM"):
    import vllm  # noqa: F401  # make test (CI) installed it: fail, never skip
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm==0.33.0)")

from vllm.v1.request import RequestStatus

from .flows import (
    assert_drained,
    closing,
    engines,
    finish_prefill,
    finished,
    reads_end_in_their_step,
    record_metadata,
    step_until,
    waiting_for_kv,
)
from .harness import BLOCK, request
from .test_connector import Sidecars, verify

pytestmark = pytest.mark.vllm

SEED = 3


def test_read_lifecycle(sidecars: Sidecars, models: dict[bool, str]) -> None:
    """Two and a half blocks read from P: the step that starts the read
    schedules nothing and leaves the blocks out of the prefix cache; the read
    names exactly the request's blocks; once it is reported the two full blocks
    are cached, the rest of the prompt runs, and both engines end empty."""
    P, D = engines(sidecars, models[False], seed=SEED)
    tokens = int(BLOCK * 2.5)
    with closing(P, D):
        params = finish_prefill(P, "r", tokens, SEED)
        reads_end_in_their_step(D)
        D.sched.add_request(request(D, "r", tokens, params, seed=SEED))
        so, agg = D.step()
        assert so.num_scheduled_tokens == {} and not so.scheduled_new_reqs
        # vLLM 0.33 counts the tokens being read as computed while it waits
        assert waiting_for_kv(D, "r") and D.sched.requests["r"].num_computed_tokens == tokens
        blocks = D.block_ids("r")
        (job,) = so.kv_connector_metadata.reads
        assert job.local_block_ids == [list(blocks[0])] and len(blocks[0]) == 3
        pool = D.sched.kv_cache_manager.block_pool
        assert not pool.cached_block_hash_to_block  # nothing a prefix lookup could hit
        assert all(pool.blocks[b].block_hash is None for b in blocks[0])
        assert agg.kv_connector_output.finished_recving == {"r"}
        assert not agg.kv_connector_output.failed_recving
        assert "r" in D.sched.finished_recving_kv_req_ids
        verify(D, "r", blocks, tokens, SEED)
        # The next step runs the prompt's rest: vLLM recomputes the last prompt
        # token (which samples the first new one) after caching the full blocks.
        so, _ = D.step()
        assert so.num_scheduled_tokens == {"r": 1}
        (new,) = so.scheduled_new_reqs
        assert new.num_computed_tokens == tokens - 1
        assert sum(pool.blocks[b].block_hash is not None for b in blocks[0]) == 2
        assert all(pool.blocks[b].ref_cnt == 1 for b in blocks[0])
        step_until(D, lambda: finished(D, "r"))
        assert sum(len(o.new_token_ids) for o in D.outputs["r"]) == 4
        D.step()
        assert_drained(D)
        # One successful transfer, reported once: the workers' stats reset
        # when vLLM takes them (every later step has none).
        assert [s.num_successful_transfers for s in D.stats] == [1]
        step_until(P, lambda: "r" not in P.sched.requests)
        assert_drained(P)


def test_start_load_kv_does_not_wait_for_a_silent_p(sidecars: Sidecars,
                                                    models: dict[bool, str]) -> None:
    """P's sidecar is stopped (SIGSTOP) while D starts the read: D's steps go
    on (start_load_kv hands the read to D's sidecar and returns; the poll
    reports nothing), the request keeps waiting, and once P's sidecar runs
    again the read ends oracle-exact."""
    P, D = engines(sidecars, models[False], seed=SEED)
    tokens = int(BLOCK * 2.5)
    proc = sidecars.p[0].proc
    assert proc is not None
    with closing(P, D):
        params = finish_prefill(P, "q", tokens, SEED)
        proc.send_signal(signal.SIGSTOP)
        try:
            D.sched.add_request(request(D, "q", tokens, params, seed=SEED))
            outs = [D.step()[1].kv_connector_output for _ in range(5)]
            assert waiting_for_kv(D, "q") and not D.sched.finished_recving_kv_req_ids
            assert not any(o and (o.finished_recving or o.failed_recving) for o in outs)
            blocks = D.block_ids("q")
        finally:
            proc.send_signal(signal.SIGCONT)
        step_until(D, lambda: finished(D, "q"))
        verify(D, "q", blocks, tokens, SEED)
        D.step()
        assert_drained(D)
        step_until(P, lambda: not P.sched.requests)


def test_read_interleaves_with_local_requests(sidecars: Sidecars,
                                              models: dict[bool, str]) -> None:
    """A remote request waits for its read while local requests keep running;
    it joins them in the step after its read is reported; all three end and
    D is empty."""
    P, D = engines(sidecars, models[False], seed=SEED)
    tokens = int(BLOCK * 2.5)
    with closing(P, D):
        params = finish_prefill(P, "remote", tokens, SEED)
        reads_end_in_their_step(D)
        D.sched.add_request(request(D, "a", tokens, None, max_tokens=6, seed=7))
        D.step()
        D.sched.add_request(request(D, "b", tokens, None, max_tokens=6, seed=8))
        D.sched.add_request(request(D, "remote", tokens, params, seed=SEED))
        so, _ = D.step()  # b starts, remote's read starts and ends within the step
        assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]
        assert so.scheduled_cached_reqs.req_ids == ["a"]
        assert len(D.sched.running) == 2 and waiting_for_kv(D, "remote")
        assert "remote" in D.sched.finished_recving_kv_req_ids
        blocks = D.block_ids("remote")
        so, _ = D.step()
        assert [r.req_id for r in so.scheduled_new_reqs] == ["remote"]
        assert sorted(so.scheduled_cached_reqs.req_ids) == ["a", "b"]
        verify(D, "remote", blocks, tokens, SEED)
        step_until(D, lambda: all(finished(D, r) for r in ("a", "b", "remote")))
        D.step()
        assert_drained(D)
        step_until(P, lambda: not P.sched.requests)
        assert_drained(P)


def test_blocks_awaiting_a_read_are_never_prefix_hits(sidecars: Sidecars,
                                                      models: dict[bool, str]) -> None:
    """A local request with the same prompt, scheduled while the remote one's
    blocks are allocated but unread, computes its prompt itself in blocks of
    its own: unread blocks are not in the prefix cache."""
    P, D = engines(sidecars, models[False], seed=SEED)
    tokens = int(BLOCK * 2.5)
    with closing(P, D):
        params = finish_prefill(P, "remote", tokens, SEED)
        D.sched.add_request(request(D, "remote", tokens, params, seed=SEED))
        D.sched.add_request(request(D, "local", tokens, None, seed=SEED))  # same prompt
        so, _ = D.step()
        (new,) = so.scheduled_new_reqs
        assert new.req_id == "local" and new.num_computed_tokens == 0
        assert so.num_scheduled_tokens == {"local": tokens}
        assert not set(D.block_ids("local")[0]) & set(D.block_ids("remote")[0])
        step_until(D, lambda: finished(D, "local") and finished(D, "remote"))
        D.step()
        assert_drained(D)
        step_until(P, lambda: not P.sched.requests)


def test_prompt_of_whole_blocks_recomputes_only_its_last_token(
        sidecars: Sidecars, models: dict[bool, str]) -> None:
    """Exactly two blocks of prompt: after the read D recomputes the last token
    into the same two blocks (no new block), from 31 computed tokens."""
    P, D = engines(sidecars, models[False], seed=SEED)
    tokens = 2 * BLOCK
    with closing(P, D):
        params = finish_prefill(P, "w", tokens, SEED)
        reads_end_in_their_step(D)
        D.sched.add_request(request(D, "w", tokens, params, seed=SEED))
        D.step()
        blocks = D.block_ids("w")
        assert len(blocks[0]) == 2
        so, _ = D.step()
        (new,) = so.scheduled_new_reqs
        assert new.num_computed_tokens == tokens - 1 and so.num_scheduled_tokens == {"w": 1}
        assert D.block_ids("w") == blocks
        verify(D, "w", blocks, tokens, SEED)
        step_until(D, lambda: finished(D, "w"))
        D.step()
        assert_drained(D)
        step_until(P, lambda: not P.sched.requests)


def test_prompt_shorter_than_a_block_is_read(sidecars: Sidecars,
                                            models: dict[bool, str]) -> None:
    """Half a block: P still hands its partial block, D reads it asynchronously
    (nothing scheduled in the step that starts the read)."""
    P, D = engines(sidecars, models[False], seed=SEED)
    tokens = BLOCK // 2
    with closing(P, D):
        params = finish_prefill(P, "s", tokens, SEED)
        assert [len(g) for g in params["remote_block_ids"]] == [1]
        D.sched.add_request(request(D, "s", tokens, params, seed=SEED))
        so, _ = D.step()
        assert len(so.kv_connector_metadata.reads) == 1 and not so.scheduled_new_reqs
        blocks = D.block_ids("s")
        step_until(D, lambda: finished(D, "s"))
        verify(D, "s", blocks, tokens, SEED)
        D.step()
        assert_drained(D)
        step_until(P, lambda: not P.sched.requests)


def test_no_room_to_read_waits_then_reads(sidecars: Sidecars, models: dict[bool, str]) -> None:
    """D has 5 usable blocks; a local request holds 3, the remote one needs 3:
    no read starts (the request stays WAITING, not waiting for KV) until the
    local request ends; then it reads, runs and ends."""
    P, D = engines(sidecars, models[False], seed=SEED, d_blocks=6)
    with closing(P, D):
        params = finish_prefill(P, "remote", int(BLOCK * 2.5), SEED)
        D.sched.add_request(request(D, "local", 2 * BLOCK, None, max_tokens=2, seed=9))
        D.step()
        D.sched.add_request(request(D, "remote", int(BLOCK * 2.5), params, seed=SEED))
        so, _ = D.step()  # local's second token; no room for remote's 3 blocks
        assert not so.kv_connector_metadata.reads
        assert D.sched.requests["remote"].status == RequestStatus.WAITING
        assert finished(D, "local")
        so, _ = D.step()
        (job,) = so.kv_connector_metadata.reads
        assert job.request_id == "remote" and job.awaited
        blocks = D.block_ids("remote")
        step_until(D, lambda: finished(D, "remote"))
        verify(D, "remote", blocks, int(BLOCK * 2.5), SEED)
        D.step()
        assert_drained(D)
        step_until(P, lambda: not P.sched.requests)


def test_read_done_but_no_room_to_run(sidecars: Sidecars, models: dict[bool, str]) -> None:
    """The read ends and the request runs, then needs a new block and there is
    none: vLLM preempts it. It resumes from the blocks it read (a prefix hit of
    32 tokens), never reads again, and ends; D is empty."""
    P, D = engines(sidecars, models[False], seed=SEED, d_blocks=6)
    metas = record_metadata(D)
    with closing(P, D):
        params = finish_prefill(P, "remote", 2 * BLOCK, SEED)
        reads_end_in_their_step(D)
        D.sched.add_request(request(D, "local", 2 * BLOCK, None, max_tokens=12, seed=9))
        D.step()  # local: 2 blocks
        D.sched.add_request(request(D, "remote", 2 * BLOCK, params, seed=SEED))
        D.step()  # local takes its 3rd block; remote gets 2 and reads them
        blocks = D.block_ids("remote")
        so, _ = D.step()
        assert so.num_scheduled_tokens == {"local": 1, "remote": 1}
        verify(D, "remote", blocks, 2 * BLOCK, SEED)
        D.step()  # remote's next token needs a 6th block: remote is preempted
        assert D.sched.requests["remote"].status == RequestStatus.PREEMPTED
        step_until(D, lambda: finished(D, "local"))
        so, _ = D.step()
        assert so.num_scheduled_tokens == {"remote": 1}
        assert D.sched.requests["remote"].num_computed_tokens == 2 * BLOCK + 1
        step_until(D, lambda: finished(D, "remote"))
        assert sum(len(o.new_token_ids) for o in D.outputs["remote"]) == 4
        assert sum(len(m.reads) for m in metas) == 1
        D.step()
        assert_drained(D)
        step_until(P, lambda: not P.sched.requests)
