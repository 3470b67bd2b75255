"""Preemption around a handoff, and the hybrid-allocator (HMA) cases, through
vLLM 0.33's real scheduler and real sidecars: the scenarios of vLLM's
``test_nixl_connector_hma.py`` (Mamba N-1 on both sides, the P-side
truncation surviving a preemption, per-group block lists) and a P request
preempted in the middle of its prefill.

The contract: with Mamba state P computes only N-1 prompt tokens (the request
is cut once, however often it is preempted and resumed) and hands every
attention block plus the one block holding the state; D reads N-1 tokens and
computes the last prompt token itself. A preempted P request starts over and
hands over exactly once, when it ends.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

if os.environ.get("KVSIDECAR_REQUIRE_VLLM"):
    import vllm  # noqa: F401  # make test (CI) installed it: fail, never skip
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm==0.33.0)")

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.request import RequestStatus

from kvsidecar.integrations.vllm import KvSidecarConnector, KvSidecarHandshake
from kvsidecar.ipc import hold_token

from .flows import (
    assert_drained,
    closing,
    engines,
    fill_when_finished,
    finished,
    reads_end_in_their_step,
    record_holds,
    record_metadata,
    step_until,
)
from .harness import BLOCK, request, vllm_config
from .test_connector import Sidecars, verify

pytestmark = pytest.mark.vllm

SEED = 6


@pytest.fixture
def ds_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")  # what kvsidecar's layout needs


@pytest.mark.parametrize("hybrid", [False, True], ids=["attn", "hybrid"])
def test_p_preempted_mid_prefill_hands_over_once(sidecars: Sidecars, models: dict[bool, str],
                                                 hybrid: bool, ds_layout: None) -> None:
    """P's request is preempted after its first 32-token chunk (an operator's
    cache reset preempts every running request): it recomputes from scratch,
    ends once, is held once, and D reads every byte. With Mamba the prompt was
    cut to N-1 once only."""
    tokens = 70
    P, D = engines(sidecars, models[hybrid], hybrid=hybrid, seed=SEED,
                   p={"batched_tokens": 32})
    fill_when_finished(P, SEED)
    held = record_holds(P)
    computed = tokens - 1 if hybrid else tokens
    with closing(P, D):
        P.sched.add_request(request(P, "p", tokens, {"do_remote_decode": True}, max_tokens=1,
                                    seed=SEED))
        so, _ = P.step()
        assert so.num_scheduled_tokens == {"p": 32}
        assert P.sched.reset_prefix_cache(reset_running_requests=True)
        req = P.sched.requests["p"]
        assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
        step_until(P, lambda: finished(P, "p"))
        assert req.num_preemptions == 1 and req.num_prompt_tokens == computed
        params = dict(P.outputs["p"][-1].kv_transfer_params or {})
        assert params["remote_num_tokens"] == computed
        D.sched.add_request(request(D, "p", tokens, params, seed=SEED))
        reads_end_in_their_step(D)
        D.step()
        blocks = D.block_ids("p")
        step_until(D, lambda: finished(D, "p"))
        verify(D, "p", blocks, computed, SEED)
        step_until(P, lambda: not P.sched.requests)
        assert held == ["p"]
        D.step()
        assert_drained(D)
        assert_drained(P)


@pytest.mark.parametrize("hybrid", [False, True], ids=["attn", "hybrid"])
def test_mamba_reads_n_minus_1_and_recomputes_the_last_token(
        sidecars: Sidecars, models: dict[bool, str], hybrid: bool, ds_layout: None) -> None:
    """Attention only: D reads all N prompt tokens. Mamba: P ran N-1 tokens and
    handed its attention blocks plus one state block per group; D reads N-1
    tokens into its attention blocks and one state block, keeps its prompt of
    N, and then computes exactly the last prompt token."""
    tokens = 70
    P, D = engines(sidecars, models[hybrid], hybrid=hybrid, seed=SEED)
    read = tokens - 1 if hybrid else tokens
    with closing(P, D):
        # The proxy asks P for one token; with Mamba the connector also caps it
        # at one itself (NixlConnector's rule), whatever the request asked.
        P.sched.add_request(request(P, "m", tokens, {"do_remote_decode": True},
                                    max_tokens=16 if hybrid else 1, seed=SEED))
        step_until(P, lambda: finished(P, "m"))
        assert sum(len(o.new_token_ids) for o in P.outputs["m"]) == 1
        params = dict(P.outputs["m"][-1].kv_transfer_params or {})
        assert params["remote_num_tokens"] == read
        attn_page = P.sched.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        want = [-(-read // attn_page)] + ([1] if hybrid else [])
        assert [len(g) for g in params["remote_block_ids"]] == want
        D.sched.add_request(request(D, "m", tokens, params, seed=SEED))
        reads_end_in_their_step(D)
        so, _ = D.step()
        (job,) = so.kv_connector_metadata.reads
        assert job.num_tokens == read and [len(g) for g in job.local_block_ids] == want
        blocks = D.block_ids("m")
        so, _ = D.step()
        (new,) = so.scheduled_new_reqs
        assert len(new.prompt_token_ids or ()) == tokens
        assert new.num_computed_tokens == tokens - 1 and so.num_scheduled_tokens == {"m": 1}
        verify(D, "m", blocks, read, SEED)
        step_until(D, lambda: finished(D, "m"))
        D.step()
        assert_drained(D)
        step_until(P, lambda: not P.sched.requests)
        assert_drained(P)


def test_hybrid_d_preempted_after_its_read_recomputes_without_reading_again(
        sidecars: Sidecars, models: dict[bool, str], ds_layout: None) -> None:
    """A hybrid D request preempted once its read is done and it ran a step (an
    operator's cache reset): the connector is told (``preempted``), starts no
    second read, nothing more is written into D's pages, and vLLM recomputes
    the whole request locally (no Mamba prefix caching here); D ends empty."""
    tokens = 70
    P, D = engines(sidecars, models[True], hybrid=True, seed=SEED)
    metas = record_metadata(D)
    with closing(P, D):
        P.sched.add_request(request(P, "x", tokens, {"do_remote_decode": True}, max_tokens=1,
                                    seed=SEED))
        step_until(P, lambda: finished(P, "x"))
        params = dict(P.outputs["x"][-1].kv_transfer_params or {})
        reads_end_in_their_step(D)
        D.sched.add_request(request(D, "x", tokens, params, seed=SEED))
        D.step()
        blocks = D.block_ids("x")
        so, _ = D.step()
        assert so.num_scheduled_tokens == {"x": 1}
        verify(D, "x", blocks, tokens - 1, SEED)
        snapshot = [b.copy() for b in D.buffers(0)]
        assert D.sched.reset_prefix_cache(reset_running_requests=True)
        assert D.sched.requests["x"].status == RequestStatus.PREEMPTED
        so, _ = D.step()
        assert so.kv_connector_metadata.preempted == ["x"]
        assert so.num_scheduled_tokens == {"x": tokens + 1}  # prompt and its first token
        step_until(D, lambda: finished(D, "x"))
        assert [len(m.reads) for m in metas] == [1] + [0] * (len(metas) - 1)
        assert all((a == b).all() for a, b in zip(snapshot, D.buffers(0))), "late write"
        D.step()
        assert_drained(D)
        step_until(P, lambda: not P.sched.requests)
        assert_drained(P)


def test_sliding_window_group_hands_only_its_window(models: dict[bool, str]) -> None:
    """A full-attention group next to a 32-token sliding window (Gemma-style):
    P hands every full-attention block, but for the window group only the
    blocks the window still covers (cdiv(32, 16) + 1 = 3, as NixlConnector's
    ``blocks_per_sw``), never the out-of-window ones vLLM has not freed yet nor
    its null blocks."""
    spec = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 16, "dtype": torch.bfloat16}
    full, window = FullAttentionSpec(**spec), SlidingWindowSpec(**spec, sliding_window=32)
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    page = full.page_size_bytes  # a layer per tensor, as the harness lays them out
    kcc = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[KVCacheTensor(size=64 * page, layers=[name], layer_stride=64 * page,
                                        block_stride=page) for name in layers],
        kv_cache_groups=[KVCacheGroupSpec(layers[:1], full),
                         KVCacheGroupSpec(layers[1:], window)])
    cfg = vllm_config(models[False], "kv_producer", "swP", 1, ["/nonexistent.sock"], False)
    conn = KvSidecarConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
    conn.set_xfer_handshake_metadata({0: KvSidecarHandshake(
        "swP", 0, "tcp://127.0.0.1:1", bytes(hold_token.KEY_BYTES))})
    req = request_finished_after(96)
    delay, params = conn.request_finished_all_groups(
        req, ([1, 2, 3, 4, 5, 6], [0, 0, 9, 10, 11, 12]))
    assert delay and params is not None
    assert params["remote_block_ids"] == [[1, 2, 3, 4, 5, 6], [10, 11, 12]]


def request_finished_after(tokens: int) -> Any:
    """A P request as vLLM hands it to ``request_finished``: prefill done."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    req = Request(request_id="sw", prompt_token_ids=list(range(3, 3 + tokens)),
                  sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                  mm_features=None)
    req.kv_transfer_params = {"do_remote_decode": True}
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    req.num_computed_tokens = tokens
    return req
