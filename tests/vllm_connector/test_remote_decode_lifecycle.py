"""P's side of a handoff (a request whose prompt D decodes), through vLLM
0.33's real scheduler and real sidecars: the scenarios of vLLM's own
``test_remote_decode_lifecycle.py`` and NixlConnector's P-side cases
(an abort while D reads, an abort mid-prefill, a reader that never comes).

The contract: a ``do_remote_decode`` request ends after one token
(LENGTH_CAPPED) with kv_transfer_params, but its blocks stay allocated until a
worker reports it in ``finished_sending``: when D's read is done, or when P's
lease on the blocks ends. A request that ends any other way hands nothing
over and frees its blocks at once.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

if os.environ.get("KVSIDECAR_REQUIRE_VLLM"):
    import vllm  # noqa: F401  # make test (CI) installed it: fail, never skip
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm==0.33.0)")

from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from .flows import (
    assert_drained,
    closing,
    engines,
    finish_prefill,
    finished,
    free_blocks,
    record_holds,
    reported,
    step_until,
)
from .harness import BLOCK, Engine, request
from .test_connector import Sidecars, schedule_reads, verify

pytestmark = pytest.mark.vllm

SEED = 4


def read_all(D: Engine, rid: str, tokens: int, params: dict[str, Any],
             computed: int | None = None) -> None:
    """D reads ``rid`` (``computed`` of its ``tokens`` P computed: all unless
    told) and runs it to its end; the bytes are the oracle's."""
    D.sched.add_request(request(D, rid, tokens, params, seed=SEED))
    blocks = schedule_reads(D, rid)[rid]
    step_until(D, lambda: finished(D, rid))
    verify(D, rid, blocks, tokens if computed is None else computed, SEED)
    D.step()
    assert_drained(D)


def test_p_keeps_its_blocks_until_d_has_read_them(sidecars: Sidecars,
                                                  models: dict[bool, str]) -> None:
    """The request ends after one token with the handoff params, leaves the
    running queue and is passed to the workers as finished, yet keeps its
    blocks (and its place in ``requests``) across steps until D's read ends;
    then one step reports it in ``finished_sending`` and P is empty."""
    P, D = engines(sidecars, models[False], seed=SEED)
    tokens = int(BLOCK * 2.5)
    with closing(P, D):
        P.sched.add_request(request(P, "h", tokens, {"do_remote_decode": True}, max_tokens=1,
                                    seed=SEED))
        P.step()
        req = P.sched.requests["h"]
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
        (out,) = P.outputs["h"]
        assert out.finish_reason == FinishReason.LENGTH and out.kv_transfer_params
        assert len(P.sched.running) == 0 and len(P.sched.waiting) == 0
        blocks = P.block_ids("h")[0]
        assert out.kv_transfer_params["remote_block_ids"] == [blocks] and len(blocks) == 3
        pool = P.sched.kv_cache_manager.block_pool
        so, agg = P.step()  # the hold goes to the sidecar with this step
        assert so.finished_req_ids == {"h"}
        for _ in range(5):  # no reader yet: nothing is released
            so, agg = P.step()
            assert not so.finished_req_ids and not agg.kv_connector_output.finished_sending
        assert "h" in P.sched.requests and all(pool.blocks[b].ref_cnt == 1 for b in blocks)
        read_all(D, "h", tokens, dict(out.kv_transfer_params))
        outs = step_until(P, lambda: "h" not in P.sched.requests)
        assert reported(outs, "finished_sending") == {"h"}
        assert_drained(P)


def test_p_hands_a_prompt_shorter_than_a_block(sidecars: Sidecars,
                                               models: dict[bool, str]) -> None:
    """Half a block of prompt: P hands its one partial block; D reads it."""
    P, D = engines(sidecars, models[False], seed=SEED)
    with closing(P, D):
        params = finish_prefill(P, "s", BLOCK // 2, SEED)
        assert [len(g) for g in params["remote_block_ids"]] == [1]
        assert params["remote_num_tokens"] == BLOCK // 2
        read_all(D, "s", BLOCK // 2, params)
        step_until(P, lambda: not P.sched.requests)
        assert_drained(P)


def test_p_prefix_hit_still_hands_every_block(sidecars: Sidecars,
                                              models: dict[bool, str]) -> None:
    """P found two blocks of the prompt in its prefix cache (an earlier local
    request): it hands all three blocks, cached ones included, and D reads the
    whole prompt oracle-exact."""
    P, D = engines(sidecars, models[False], seed=SEED)
    with closing(P, D):
        P.sched.add_request(request(P, "warm", int(BLOCK * 3.5), None, max_tokens=1, seed=SEED))
        step_until(P, lambda: finished(P, "warm"))
        tokens = int(BLOCK * 2.5)
        P.sched.add_request(request(P, "h", tokens, {"do_remote_decode": True}, max_tokens=1,
                                    seed=SEED))
        so, _ = P.step()
        (new,) = so.scheduled_new_reqs
        assert new.num_computed_tokens == 2 * BLOCK  # the prefix hit
        (out,) = P.outputs["h"]
        params = dict(out.kv_transfer_params or {})
        assert [len(g) for g in params["remote_block_ids"]] == [3]
        read_all(D, "h", tokens, params)
        step_until(P, lambda: not P.sched.requests)
        assert_drained(P)


@pytest.mark.parametrize("hybrid", [False, True], ids=["attn", "hybrid"])
def test_p_hands_only_computed_blocks_not_draft_lookahead(
        sidecars: Sidecars, models: dict[bool, str], hybrid: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With speculative decoding vLLM reserves lookahead slots past the
    computed tokens, which take a block of their own here: P hands only the
    blocks that hold the prompt's KV (per group: the Mamba group's state block
    is kept), as NixlConnector must, and D reads them oracle-exact."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    P, D = engines(sidecars, models[hybrid], hybrid=hybrid, seed=SEED, p={"draft_tokens": 2})
    page = 2 * BLOCK if hybrid else BLOCK  # the hybrid attention page holds 32 tokens
    tokens = 2 * page + (1 if hybrid else 0)  # P computes two whole pages
    with closing(P, D):
        assert P.sched.num_lookahead_tokens == 2
        P.sched.add_request(request(P, "h", tokens, {"do_remote_decode": True},
                                    max_tokens=1, seed=SEED))
        P.step()
        attn = P.block_ids("h")[0]
        assert len(attn) == 3  # two of prompt, one of lookahead
        params = dict(P.outputs["h"][-1].kv_transfer_params or {})
        assert params["remote_block_ids"][0] == attn[:2]
        if hybrid:
            assert len(params["remote_block_ids"][1]) == 1
        read_all(D, "h", tokens, params, computed=2 * page)
        step_until(P, lambda: not P.sched.requests)
        assert_drained(P)


def test_p_abort_after_the_handoff_keeps_blocks_for_the_reader(
        sidecars: Sidecars, models: dict[bool, str]) -> None:
    """An abort of a request that already ended (the client went away after
    the proxy got the params) frees nothing: D still reads every byte, and the
    blocks come back only with ``finished_sending``."""
    P, D = engines(sidecars, models[False], seed=SEED)
    tokens = int(BLOCK * 2.5)
    with closing(P, D):
        params = finish_prefill(P, "h", tokens, SEED)
        before = free_blocks(P)
        P.sched.finish_requests("h", RequestStatus.FINISHED_ABORTED)
        P.step()
        assert "h" in P.sched.requests and free_blocks(P) == before
        read_all(D, "h", tokens, params)
        outs = step_until(P, lambda: "h" not in P.sched.requests)
        assert reported(outs, "finished_sending") == {"h"}
        assert_drained(P)


def test_p_abort_mid_prefill_hands_nothing(sidecars: Sidecars, models: dict[bool, str]) -> None:
    """Aborted between two chunks of its prefill, the request hands nothing
    over: no hold is sent, its blocks are free at once, P is empty."""
    P, D = engines(sidecars, models[False], seed=SEED, p={"batched_tokens": 32})
    held = record_holds(P)
    with closing(P, D):
        P.sched.add_request(request(P, "h", 70, {"do_remote_decode": True}, max_tokens=1,
                                    seed=SEED))
        so, _ = P.step()
        assert so.num_scheduled_tokens == {"h": 32}  # the first chunk
        P.sched.finish_requests("h", RequestStatus.FINISHED_ABORTED)
        assert "h" not in P.sched.requests
        for _ in range(3):
            P.step()
        assert held == []
        assert "h" not in P.outputs  # an abort emits no output, so no kv_transfer_params
        assert_drained(P)


def test_unread_blocks_are_freed_when_the_lease_ends(sidecars: Sidecars,
                                                     models: dict[bool, str]) -> None:
    """No D ever reads (the proxy lost the params): P's sidecar ends the hold
    at its lease (here 1 s, ``hold_timeout_s``), the worker reports the request
    in ``finished_sending``, the expiry is counted as NixlConnector counts it
    (``num_kv_expired_reqs``), and P is empty."""
    P, D = engines(sidecars, models[False], seed=SEED, p={"extra": {"hold_timeout_s": 1.0}})
    with closing(P, D):
        finish_prefill(P, "lost", int(BLOCK * 2.5), SEED)
        expired: list[int] = []

        def gone() -> bool:
            if P.stats:
                expired.extend(P.stats.pop().data["num_kv_expired_reqs"])
            return "lost" not in P.sched.requests

        outs = step_until(P, gone)
        assert reported(outs, "finished_sending") == {"lost"}
        assert expired == [1]
        assert_drained(P)
