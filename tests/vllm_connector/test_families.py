"""Every model family NixlConnector serves, through real sidecars and vLLM's real Scheduler.

The specs are the ones vLLM builds from each model's published config
(:mod:`.families`); the bytes are checked by the LAYOUT.md oracle on the
pages vLLM's block tables give each token: full attention from the first
token D lacks, a sliding window on the pages of its last ``window`` tokens
only (the pages before it and vLLM's null block 0 must stay unwritten), MLA
whole, Mamba2 and GDN state in the request's one state page.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

if os.environ.get("KVSIDECAR_REQUIRE_VLLM"):
    import vllm  # noqa: F401  # make test (CI) installed it: fail, never skip
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm==0.33.0)")

from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import Request, RequestStatus

from kvsidecar.sim.cluster import SidecarProcess
from kvsidecar.sim.oracle import Request as OracleRequest
from kvsidecar.sim.oracle import check_received, fill_shard

from .families import HYBRID, build_specs, make_family_engine, write_models
from .harness import Engine, request
from .test_connector import FAST, prefill, run_until, start_all

pytestmark = pytest.mark.vllm

_ids = itertools.count()


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess, ...]]:
    d = tmp_path_factory.mktemp("family-sidecars")
    p = SidecarProcess(d, "fp", args=["--hold-timeout", "60", *FAST])
    d_args = ["--read-timeout", "60", "--handshake-timeout", "30", *FAST]
    q = [SidecarProcess(d, f"fd{i}", args=d_args) for i in range(2)]
    try:
        start_all([p, *q])
        yield p, *q
    finally:
        for sc in (p, *q):
            sc.stop()


@pytest.fixture(scope="module")
def family_specs(tmp_path_factory: pytest.TempPathFactory
                 ) -> tuple[dict[str, str], dict[str, dict[str, KVCacheSpec]]]:
    d = tmp_path_factory.mktemp("families")
    models = write_models(d / "models")
    return models, build_specs(models, d)


def _kinds(eng: Engine) -> list[KVCacheSpec]:
    return [g.kv_cache_spec for g in eng.sched.kv_cache_config.kv_cache_groups]


def _first_real(ids: list[int]) -> int:
    return next((j for j, b in enumerate(ids) if b != 0), len(ids))


def family_fill(seeds: dict[str, int]) -> Any:
    """P's "model": the oracle's state for every token, on the page vLLM's block
    table gives it (a sliding-window group's leading pages may already be the
    null block: their tokens are skipped); a Mamba group's state in its last page."""
    def fill(eng: Engine, req: Request) -> None:
        ids, firsts = [], []
        for spec, table in zip(_kinds(eng), eng.block_ids(req.request_id)):
            j = _first_real(table)
            real = [b for b in table[j:] if b != 0]
            ids.append(real[-1:] if isinstance(spec, MambaSpec) else real)
            firsts.append(0 if isinstance(spec, MambaSpec) else j * spec.block_size)
        fill_shard(eng.buffers(0), eng.layout, 0, ids,
                   OracleRequest(seeds[req.request_id], req.num_prompt_tokens), firsts)
    return fill


def verify(D: Engine, rid: str, tables: tuple[list[int], ...], tokens: int, seed: int,
           hit: int) -> int:
    """The oracle on D's pages for ``rid``; returns how many pages were checked.

    Per group, from vLLM's block table (page j holds tokens [j*bs, (j+1)*bs)):
    full attention and MLA: pages from the local prefix hit ``hit`` on; sliding
    window: the pages holding the window's tokens [tokens - window, tokens)
    (the one page before it, which NixlConnector's clip may also carry, is
    neither required nor forbidden); Mamba: the state page. Every other page,
    null block 0 included, must still be poison unless another request owns it.
    """
    ids: list[list[int]] = []
    firsts: list[int] = []
    loose: set[int] = set()
    for spec, table in zip(_kinds(D), tables):
        if isinstance(spec, MambaSpec):
            ids.append([b for b in table if b != 0][-1:])
            firsts.append(0)
            continue
        bs = spec.block_size
        j0 = hit // bs
        if isinstance(spec, SlidingWindowSpec):
            edge = j0
            j0 = max(j0, (tokens - spec.sliding_window) // bs)
            loose.update(table[max(edge, j0 - 1):j0])
        ids.append(table[j0:-(-tokens // bs)])
        firsts.append(j0 * bs)
        assert 0 not in ids[-1], f"group {spec}: null block inside the pages to check"
    others = D.dirty | loose | {b for r in D.sched.requests if r != rid
                                for g in D.block_ids(r) for b in g}
    for rank in range(len(D.workers)):
        problems = check_received(D.buffers(rank), D.layout_of(rank), rank, ids,
                                  OracleRequest(seed, tokens), ignore_blocks=others - {0},
                                  first_tokens=firsts)
        assert not problems, (rid, rank, tables, ids, firsts, hit, problems)
    D.dirty.update(b for g in ids for b in g)
    D.dirty.update(loose)
    return sum(len(g) for g in ids)


# (family, prompt tokens of the first request, of the second that shares its prefix)
CASES = [
    ("llama-3-8b", 70, 120),
    ("deepseek-v2-lite", 70, 120),
    ("gpt-oss-20b", 300, 420),  # past the 128-token window
    ("gemma-3-4b", 1100, 1200),  # past the 1024-token window
    ("nemotron-nano-9b-v2", 70, 0),  # Mamba2 hybrid: N-1 tokens, no prefix caching
    ("qwen3-next-80b-a3b", 70, 0),  # GDN hybrid
    ("jamba-v0.1", 70, 0),  # Mamba1 hybrid
    # only gpt-oss's sliding layers (a Mistral-style model: one sliding-window group)
    ("gpt-oss-20b:sliding-only", 300, 420),
]


@pytest.mark.parametrize("family,first,second", CASES, ids=[c[0] for c in CASES])
def test_family_p_to_d(sidecars: tuple[SidecarProcess, SidecarProcess],
                       family_specs: tuple[dict[str, str], dict[str, dict[str, KVCacheSpec]]],
                       family: str, first: int, second: int,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    models, all_specs = family_specs
    family, _, only = family.partition(":")
    specs = {k: v for k, v in all_specs[family].items()
             if not only or isinstance(v, SlidingWindowSpec)}
    n = next(_ids)
    seeds = {"a": 21, "b": 21}  # the same seed: b's prompt starts with a's
    blocks = 8 if family in HYBRID else 160
    P = make_family_engine(family, models[family], specs, "kv_producer", f"FP{n}",
                           [sidecars[0].socket], blocks)
    D = make_family_engine(family, models[family], specs, "kv_consumer", f"FD{n}",
                           [sidecars[1].socket], blocks)
    P.fill = family_fill(seeds)
    try:
        hybrid = family in HYBRID
        for rid, tokens in (("a", first), ("b", second)):
            if not tokens:
                continue
            params = prefill(P, rid, tokens, seeds[rid])
            computed = tokens - 1 if hybrid else tokens
            assert params["remote_num_tokens"] == computed
            req = request(D, rid, tokens, params, seed=seeds[rid])
            hit = D.sched.kv_cache_manager.get_computed_blocks(req)[1]  # vLLM's local hit
            D.sched.add_request(req)
            D.sched_stats.clear()
            D.step()
            assert D.sched.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS
            # vLLM counts the read's tokens as connector hits from a peer (p2p)
            (stats,) = [s.connector_prefix_cache_stats for s in D.sched_stats]
            assert dict(stats.hits_by_source) == {CacheHitSource.P2P: computed - hit}
            tables = tuple(list(g) for g in D.block_ids(rid))
            if rid == "b":  # a's prompt is a prefix of b's: D has its whole pages
                bs = max(s.block_size for s in _kinds(D))
                assert hit == first // bs * bs
            run_until(D, lambda rid=rid: D.sched.requests.get(rid) is None
                      or D.sched.requests[rid].status == RequestStatus.RUNNING)
            assert verify(D, rid, tables, computed, seeds[rid], hit) > 0
            run_until(D, lambda rid=rid: rid in D.outputs and D.outputs[rid][-1].finished)
            run_until(P, lambda rid=rid: rid not in P.sched.requests)
        # every block back in both pools: nothing leaked, nothing freed twice
        for eng in (P, D):
            pool = eng.sched.kv_cache_manager.block_pool
            assert pool.get_num_free_blocks() == eng.sched.kv_cache_config.num_blocks - 1
    finally:
        P.shutdown()
        D.shutdown()


def test_pages_are_vllms(family_specs: tuple[dict[str, str], dict[str, dict[str, KVCacheSpec]]]
                         ) -> None:
    """The specs are what the published configs make vLLM build (not ours)."""
    _, specs = family_specs
    kinds = {name: sorted({type(s).__name__ for s in sp.values()}) for name, sp in specs.items()}
    assert kinds == {
        "llama-3-8b": ["FullAttentionSpec"],
        "deepseek-v2-lite": ["MLAAttentionSpec"],
        "gemma-3-4b": ["FullAttentionSpec", "SlidingWindowSpec"],
        "gpt-oss-20b": ["FullAttentionSpec", "SlidingWindowSpec"],
        "nemotron-nano-9b-v2": ["FullAttentionSpec", "MambaSpec"],
        "qwen3-next-80b-a3b": ["FullAttentionSpec", "MambaSpec"],
        "jamba-v0.1": ["FullAttentionSpec", "MambaSpec"],
    }
    mla = next(iter(specs["deepseek-v2-lite"].values()))
    assert (mla.num_kv_heads, mla.head_size) == (1, 576)  # type: ignore[attr-defined]
    windows = {s.sliding_window for n in ("gemma-3-4b", "gpt-oss-20b")  # type: ignore[attr-defined]
               for s in specs[n].values() if isinstance(s, SlidingWindowSpec)}
    assert windows == {1024, 128}
    types = {name: {s.mamba_type.name for s in specs[name].values() if isinstance(s, MambaSpec)}
             for name in ("nemotron-nano-9b-v2", "qwen3-next-80b-a3b", "jamba-v0.1")}
    assert types == {"nemotron-nano-9b-v2": {"MAMBA2"}, "qwen3-next-80b-a3b": {"GDN_ATTN"},
                     "jamba-v0.1": {"MAMBA1"}}
    gdn = next(s for s in specs["qwen3-next-80b-a3b"].values() if isinstance(s, MambaSpec))
    assert gdn.shapes == ((8192, 3), (32, 128, 128))
    assert np.prod(gdn.shapes[1]) == 32 * 128 * 128


def test_mla_d_ranks_each_read_the_whole_latent_from_one_p_rank(
        sidecars: tuple[SidecarProcess, ...],
        family_specs: tuple[dict[str, str], dict[str, dict[str, KVCacheSpec]]]) -> None:
    """DeepSeek-V2-Lite P tp 1 -> D tp 2: the latent is not split by head; each D
    rank reads all of it (one transfer from P rank 0) and holds the same bytes."""
    models, specs = family_specs
    fam = "deepseek-v2-lite"
    P = make_family_engine(fam, models[fam], specs[fam], "kv_producer", "MLA-P",
                           [sidecars[0].socket], 64)
    D = make_family_engine(fam, models[fam], specs[fam], "kv_consumer", "MLA-D",
                           [s.socket for s in sidecars[1:3]], 64, tp=2)
    P.fill = family_fill({"m": 4})
    try:
        params = prefill(P, "m", 90, 4)
        D.sched.add_request(request(D, "m", 90, params, seed=4))
        D.step()
        tables = tuple(list(g) for g in D.block_ids("m"))
        D.stats.clear()
        run_until(D, lambda: D.sched.requests["m"].status == RequestStatus.RUNNING)
        assert verify(D, "m", tables, 90, 4, 0) == 6  # 90 tokens: 6 pages of 16
        per_rank = [a.numpy()[tables[0][0] * D.layout.page_bytes:][:D.layout.page_bytes]
                    for a in (D.workers[r].worker.regions[0] for r in range(2))]  # type: ignore[union-attr]
        assert (per_rank[0] == per_rank[1]).all()
        # vLLM's NIXL stats: one transfer per D rank, each the whole latent of 6
        # pages in 2 layers (576 bf16 a token), from P's only rank
        moved = [n for s in D.stats for n in s.data.get("bytes_transferred", [])]
        assert moved == [2 * 6 * 16 * 576 * 2] * 2
    finally:
        P.shutdown()
        D.shutdown()


def test_failed_read_keeps_the_local_prefix(
        sidecars: tuple[SidecarProcess, ...],
        family_specs: tuple[dict[str, str], dict[str, dict[str, KVCacheSpec]]]) -> None:
    """One KV-cache group: a read that fails (here D's sidecar refuses P blocks
    that do not exist) is reported as finished with its blocks invalid, not as a
    failed request, so vLLM recomputes only the tokens after D's local prefix
    hit; NixlConnector's failed_recving would recompute the whole prompt."""
    models, specs = family_specs
    fam = "llama-3-8b"
    P = make_family_engine(fam, models[fam], specs[fam], "kv_producer", "FL-P",
                           [sidecars[0].socket], 64)
    D = make_family_engine(fam, models[fam], specs[fam], "kv_consumer", "FL-D",
                           [sidecars[1].socket], 64)
    P.fill = family_fill({"a": 3, "b": 3})
    try:
        params = prefill(P, "a", 70, 3)
        D.sched.add_request(request(D, "a", 70, params, seed=3))
        run_until(D, lambda: "a" in D.outputs and D.outputs["a"][-1].finished)
        params = prefill(P, "b", 120, 3)
        params["remote_block_ids"] = [[10**6 + b for b in g] for g in params["remote_block_ids"]]
        req = request(D, "b", 120, params, seed=3)
        hit = D.sched.kv_cache_manager.get_computed_blocks(req)[1]
        assert hit == 64  # a's 4 whole pages
        D.sched.add_request(req)
        for _ in range(10_000):  # until the step that reports b's read over
            out = D.step()[1].kv_connector_output
            if out is not None and "b" in (out.finished_recving or ()):
                break
            time.sleep(0.002)
        assert out is not None and "b" in (out.finished_recving or ())
        assert not out.failed_recving
        assert out.invalid_block_ids == set(D.block_ids("b")[0][hit // 16:])
        so, _ = D.step()
        assert so.num_scheduled_tokens == {"b": 120 - hit}
    finally:
        P.shutdown()
        D.shutdown()


@pytest.fixture(scope="module")
def tp2_specs(tmp_path_factory: pytest.TempPathFactory,
              family_specs: tuple[dict[str, str], dict[str, dict[str, KVCacheSpec]]]
              ) -> dict[str, dict[str, KVCacheSpec]]:
    """A tp-2 rank's specs of the sliding-window and GDN families (vLLM built
    by two processes forming its tp group)."""
    models, _ = family_specs
    pick = {n: models[n] for n in ("gpt-oss-20b", "qwen3-next-80b-a3b")}
    return build_specs(pick, tmp_path_factory.mktemp("families-tp2"), tp=2)


@pytest.mark.parametrize("family,tokens", [("gpt-oss-20b", 300), ("qwen3-next-80b-a3b", 70)])
def test_family_p_tp1_to_d_tp2(sidecars: tuple[SidecarProcess, ...],
                               family_specs: tuple[dict[str, str],
                                                   dict[str, dict[str, KVCacheSpec]]],
                               tp2_specs: dict[str, dict[str, KVCacheSpec]], family: str,
                               tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Heterogeneous tp with vLLM's tp-2 specs: D's two ranks each read their
    half of the KV heads (sliding window: of the window's pages only) or of
    the GDN Q, K, V channels and value-head state, from P's one rank."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    models, specs = family_specs
    n = next(_ids)
    blocks = 8 if family in HYBRID else 64
    P = make_family_engine(family, models[family], specs[family], "kv_producer", f"HP{n}",
                           [sidecars[0].socket], blocks)
    D = make_family_engine(family, models[family], tp2_specs[family], "kv_consumer",
                           f"HD{n}", [s.socket for s in sidecars[1:3]], blocks, tp=2)
    P.fill = family_fill({"h": 8})
    try:
        computed = tokens - 1 if family in HYBRID else tokens
        params = prefill(P, "h", tokens, 8)
        D.sched.add_request(request(D, "h", tokens, params, seed=8))
        D.step()
        tables = tuple(list(g) for g in D.block_ids("h"))
        run_until(D, lambda: D.sched.requests["h"].status == RequestStatus.RUNNING)
        assert verify(D, "h", tables, computed, 8, 0) > 0
        # every segment (KV heads; Q, K, V channels and state heads) is split in two
        for r in range(2):
            assert [[x.nbytes_local * 2 for x in g.segments] for g in D.layout_of(r).groups] \
                == [[x.nbytes_local for x in g.segments] for g in P.layout.groups]
    finally:
        P.shutdown()
        D.shutdown()
