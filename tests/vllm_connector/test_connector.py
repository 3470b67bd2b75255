"""KvSidecarConnector against vLLM 0.33's real v1 Scheduler, two real sidecars per side.

A P engine and a D engine, each a real ``Scheduler`` with our connector on
the scheduler side and one worker-side connector per tp rank; the bytes move
between real ``kvsidecar serve`` processes over NIXL and are checked by the
LAYOUT.md oracle.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("KVSIDECAR_REQUIRE_VLLM"):
    import vllm  # noqa: F401  # make test (CI) installed it: fail, never skip
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm==0.33.0)")

from vllm.v1.request import RequestStatus

from kvsidecar.integrations.vllm import KvSidecarConnector, UnsupportedConfig
from kvsidecar.ipc.protocol import Completion, ReaderReport
from kvsidecar.sim.cluster import SidecarProcess
from kvsidecar.sim.oracle import POISON, check_received
from kvsidecar.sim.oracle import Request as OracleRequest

from .harness import Engine, failed_reads, make_engine, oracle_fill, request

pytestmark = pytest.mark.vllm

_ids = itertools.count()


# The transport self-check is covered by the daemon's own tests; here it would
# only add a loopback transfer per sidecar to a loaded 2-core machine.
FAST = ["--transport-check", "off"]
#: the connector's memory="shm" case registers POSIX shm, which a sidecar maps only when told
SHM = ["--allow-unsealed-shm"]


def start_all(procs: list[SidecarProcess]) -> None:
    """Start sidecars side by side (each spends seconds importing NIXL and torch)."""
    with ThreadPoolExecutor(len(procs)) as pool:
        # A bound, not an expectation: on a loaded machine importing NIXL and
        # torch in four processes at once has taken over a minute.
        for f in [pool.submit(p.start, 600.0) for p in procs]:
            f.result()


class Sidecars:
    def __init__(self, workdir: Path) -> None:
        self.p = [SidecarProcess(workdir, f"vp{i}", args=["--hold-timeout", "60", *FAST, *SHM])
                  for i in range(2)]
        # Generous: a loaded 2-core machine can take seconds to answer a handshake.
        d_args = ["--read-timeout", "60", "--handshake-timeout", "30", *FAST, *SHM]
        self.d = [SidecarProcess(workdir, f"vd{i}", args=d_args) for i in range(2)]
        self.workdir = workdir

    @property
    def all(self) -> list[SidecarProcess]:
        return self.p + self.d


# The ``sidecars`` and ``models`` fixtures: conftest.py (one set for the package).


def pair(sidecars: Sidecars, models: dict[bool, str], p_tp: int, d_tp: int, hybrid: bool,
         seeds: dict[str, int], memory: str | None = None) -> tuple[Engine, Engine]:
    n = next(_ids)
    P = make_engine(f"P{n}", models[hybrid], "kv_producer", p_tp,
                    [s.socket for s in sidecars.p[:p_tp]], 64, hybrid, memory=memory)
    D = make_engine(f"D{n}", models[hybrid], "kv_consumer", d_tp,
                    [s.socket for s in sidecars.d[:d_tp]], 48, hybrid, memory=memory)
    P.fill = oracle_fill(lambda rid: seeds[rid])
    return P, D


def prefill(P: Engine, rid: str, tokens: int, seed: int) -> dict[str, Any]:
    """Run P until the request finishes; return the kv_transfer_params it hands D."""
    P.sched.add_request(request(P, rid, tokens, {"do_remote_decode": True}, max_tokens=1,
                                seed=seed))
    for _ in range(10):  # one prefill step (and the sampled token)
        P.step()
        outs = P.outputs.get(rid, [])
        if outs and outs[-1].finished:
            params = outs[-1].kv_transfer_params
            assert params is not None and params["do_remote_prefill"], params
            return dict(params)
    raise AssertionError(f"P never finished {rid}")


WAIT_S = 120.0  # a bound on waiting for an outcome on a loaded machine, never asserted on


def run_until(eng: Engine, done: Any) -> None:
    """Step the engine (as its busy loop would) until ``done()``."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        eng.step()
        if done():
            return
        time.sleep(0.002)
    raise AssertionError(f"{eng.name}: condition not reached within {WAIT_S} s")


def schedule_reads(D: Engine, *rids: str) -> dict[str, tuple[list[int], ...]]:
    """One D step that schedules the reads of ``rids``; the blocks each reads
    into, as the scheduler gave them then.

    The oracle checks these, not the request's blocks at the time of the check:
    a read can finish within this very step (its completion polled right after
    it was sent), and the next step then runs the request, where vLLM may move
    a Mamba group's state to a new block (the model runner copies it there;
    this harness runs no model) -- a check against the blocks then would find
    the new block unwritten and the read's block "not named"."""
    D.step()
    for rid in rids:
        assert D.sched.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return {rid: tuple(list(g) for g in D.block_ids(rid)) for rid in rids}


def verify(D: Engine, rid: str, blocks: tuple[list[int], ...], tokens_read: int, seed: int,
           skip: int = 0) -> None:
    """The oracle on every D rank for the read of ``rid`` into ``blocks`` (what
    :func:`schedule_reads` returned); pages earlier reads wrote (D.dirty) and
    other requests' pages may differ."""
    kinds = [g.kv_cache_spec.__class__.__name__ for g in D.sched.kv_cache_config.kv_cache_groups]
    ids = [[b for b in g if b != 0] for g in blocks]
    ids = [g[-1:] if k == "MambaSpec" else g for g, k in zip(ids, kinds)]
    others = D.dirty | {b for r in D.sched.requests if r != rid for g in D.block_ids(r)
                        for b in g}
    for rank in range(len(D.workers)):
        problems = check_received(D.buffers(rank), D.layout_of(rank), rank, ids,
                                  OracleRequest(seed, tokens_read), skip,
                                  ignore_blocks=others)
        assert not problems, f"D rank {rank}: {problems}"
    D.dirty.update(b for g in ids for b in g)


# By default (memfd) each rank's KV cache is carved from a reservation its sidecar
# allocated (integrations/vllm/pool.py), the path a GPU worker takes with cuda_vmm/cuda_malloc;
# "shm": POSIX shared memory the connector creates, registered in attach mode.
CASES = [(1, 1, False, None), (1, 2, False, None), (2, 1, False, None), (1, 2, True, None),
         (2, 1, True, None), (1, 2, True, "shm")]


@pytest.mark.parametrize(
    "p_tp,d_tp,hybrid,memory", CASES,
    ids=[f"{'hybrid' if h else 'attn'}-{p}to{d}" + (f"-{m}" if m else "") for p, d, h, m in CASES])
def test_p_to_d_through_real_schedulers(sidecars: Sidecars, models: dict[bool, str],
                                        p_tp: int, d_tp: int, hybrid: bool, memory: str | None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")  # what kvsidecar's layout needs
    seeds = {"r1": 11, "r2": 12}
    P, D = pair(sidecars, models, p_tp, d_tp, hybrid, seeds, memory)
    try:
        for eng in (P, D):  # where each rank's KV cache lives
            for c in eng.workers:
                w = c.worker
                assert w is not None and w.memory == (memory or "memfd")
                kinds = {type(r).__name__ for r in w.regions}
                assert kinds == ({"ShmRegion"} if memory == "shm" else {"RegionView"})
        # Hybrid: vLLM's pages hold different numbers of kernel blocks on P and D
        # (the connector reads the kernel block size from vLLM's views); the
        # read pairs them by token.
        subs = {P.layout.groups[0].sub_blocks, D.layout.groups[0].sub_blocks}
        assert subs == ({1, 2} if hybrid else {1})
        for rid, tokens in (("r1", 70), ("r2", 33)):
            params = prefill(P, rid, tokens, seeds[rid])
            # Mamba: P computed N-1 tokens (D recomputes the last from its state).
            computed = tokens - 1 if hybrid else tokens
            assert params["remote_num_tokens"] == computed
            assert len(params["remote_handshake"]) == p_tp
            D.sched.add_request(request(D, rid, tokens, params, seed=seeds[rid]))
            # schedules the read: the request waits for remote KV
            blocks = schedule_reads(D, rid)[rid]
            run_until(D, lambda rid=rid: rid in D.sched.finished_recving_kv_req_ids
                      or D.sched.requests[rid].status == RequestStatus.RUNNING)
            verify(D, rid, blocks, computed, seeds[rid])
            # P frees its blocks once D's notification arrives.
            run_until(P, lambda rid=rid: rid not in P.sched.requests)
            run_until(D, lambda rid=rid: len(D.outputs.get(rid, [])) >= 2)
            assert D.sched.requests[rid].num_computed_tokens >= computed
        # vLLM's NIXL metric semantics: one successful transfer per request, D rank
        # and P rank it read from (a narrower D reads from P_tp / D_tp ranks).
        total = KvSidecarConnector.build_kv_connector_stats()
        assert total is not None
        for st in D.stats:
            total.aggregate(st)
        reduced = total.reduce()
        assert reduced["Num successful transfers"] == 2 * d_tp * max(1, p_tp // d_tp)
        assert reduced["Avg MB per transfer"] > 0
        # Each read posts at least one descriptor per region (layer) it reads:
        # the sidecar's count, not a placeholder 0.
        regions = D.layout.num_regions
        assert all(n >= regions for st in D.stats for n in st.data["num_descriptors"])
        assert reduced["Avg number of descriptors"] >= regions
    finally:
        P.shutdown()
        D.shutdown()


def test_a_read_done_within_the_step_that_scheduled_it(sidecars: Sidecars,
                                                      models: dict[bool, str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fast transport a read can finish before the step that sent it polls
    for completions (it did once on a quiet host in hybrid-2to1 above): the
    scheduler learns of it in that same step and runs the request in the next,
    where vLLM moves the Mamba group's state to a new block. The bytes are
    where the read was told to write, oracle-exact. Here the scheduling step's
    poll waits for the completion, so the case happens every time."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    P, D = pair(sidecars, models, 1, 1, True, {"q": 51})
    (w,) = D.workers
    poll = w.get_transfer_results
    waiting = {"q"}  # the read the next poll waits for

    def poll_until_received(finished: set[str]) -> Any:
        deadline = time.monotonic() + WAIT_S
        while True:
            r = poll(finished)
            if not waiting or waiting & r.finished_recving:
                waiting.clear()
                return r
            assert not (r.finished_sending or r.finished_recving or r.failed_recving), r
            assert time.monotonic() < deadline, "the read never finished"
            time.sleep(0.002)

    w.get_transfer_results = poll_until_received  # type: ignore[method-assign]
    tokens = 33  # P computes 32: D's next token needs a new page, and the state moves
    try:
        params = prefill(P, "q", tokens, 51)
        D.sched.add_request(request(D, "q", tokens, params, seed=51))
        blocks = schedule_reads(D, "q")["q"]
        assert "q" in D.sched.finished_recving_kv_req_ids  # done within that step
        D.step()
        assert D.sched.requests["q"].status == RequestStatus.RUNNING
        assert D.block_ids("q")[1][-1] != blocks[1][-1]  # vLLM moved the Mamba state
        verify(D, "q", blocks, tokens - 1, 51)
        run_until(P, lambda: "q" not in P.sched.requests)
    finally:
        P.shutdown()
        D.shutdown()


def test_prefix_hit_reads_only_the_tail(sidecars: Sidecars, models: dict[bool, str]) -> None:
    """D holds the first 64 tokens (its prefix cache); it reads only the rest."""
    seeds = {"a": 21, "b": 21}  # the same logical state: b repeats a's prompt
    P, D = pair(sidecars, models, 1, 1, False, seeds)
    try:
        params = prefill(P, "a", 65, 21)
        D.sched.add_request(request(D, "a", 65, params, seed=21))
        blocks = schedule_reads(D, "a")["a"]
        run_until(D, lambda: "a" in D.sched.finished_recving_kv_req_ids
                  or D.sched.requests["a"].status == RequestStatus.RUNNING)
        verify(D, "a", blocks, 65, 21)
        run_until(D, lambda: "a" in D.outputs and D.outputs["a"][-1].finished)
        params = prefill(P, "b", 65, 21)
        D.sched.add_request(request(D, "b", 65, params, seed=21))
        so, _ = D.step()
        (job,) = so.kv_connector_metadata.reads
        assert job.skip_tokens == 64 and job.num_tokens == 65
        assert [len(g) for g in job.local_block_ids] == [1]
        run_until(D, lambda: "b" in D.sched.finished_recving_kv_req_ids
                  or D.sched.requests["b"].status == RequestStatus.RUNNING)
        full = D.block_ids("b")[0]
        cached, read = full[:4], full[4:]
        assert read == job.local_block_ids[0]
        problems = check_received(D.buffers(0), D.layout, 0, [read], OracleRequest(21, 65), 64,
                                  ignore_blocks=set(cached) | D.dirty)  # "a"'s pages
        assert not problems, problems
        run_until(P, lambda: not P.sched.requests)  # both holds released by D's notifications
    finally:
        P.shutdown()
        D.shutdown()


def record_completions(eng: Engine) -> dict[str, list[Completion]]:
    """Every completion rank 0's worker polls from its sidecar, by request (a
    pass-through wrapper around the real client)."""
    w = eng.workers[0].worker
    assert w is not None
    seen: dict[str, list[Completion]] = {}
    poll = w.client.poll_nowait  # what the worker polls with each step

    def recording(engine_id: str) -> list[Completion]:
        items = poll(engine_id)
        for c in items:
            seen.setdefault(c.request_id, []).append(c)
        return items

    w.client.poll_nowait = recording  # type: ignore[method-assign]
    return seen


def test_full_prefix_hit_notifies_only(tmp_path: Path, sidecars: Sidecars,
                                       models: dict[bool, str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """D already holds every token P computed: vLLM's scheduler finds the whole
    remote span in D's prefix cache, the connector asks for no blocks and sends
    only the notification; P's hold ends ``sent`` naming D, no byte moves into D,
    and D computes the last token at once.

    Only a hybrid model gets here: vLLM caps a local hit at N-1 tokens and P
    computes N-1 with Mamba state (N with attention alone, which always leaves
    D a token to read). Mamba prefix caching is vLLM's "align" mode."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    n = next(_ids)
    P = make_engine(f"P{n}", models[True], "kv_producer", 1, [sidecars.p[0].socket], 64, True,
                    mamba_prefix_caching=True)
    D = make_engine(f"D{n}", models[True], "kv_consumer", 1, [sidecars.d[0].socket], 64, True,
                    mamba_prefix_caching=True)
    P.fill = oracle_fill(lambda rid: 31)
    p_seen, d_seen = record_completions(P), record_completions(D)
    tokens = 65  # P computes 64: two whole 32-token pages, which D's cache then holds
    try:
        params = prefill(P, "a", tokens, 31)
        D.sched.add_request(request(D, "a", tokens, params, seed=31))
        blocks = schedule_reads(D, "a")["a"]
        run_until(D, lambda: "a" in D.sched.finished_recving_kv_req_ids
                  or D.sched.requests["a"].status == RequestStatus.RUNNING)
        verify(D, "a", blocks, tokens - 1, 31)
        run_until(D, lambda: "a" in D.outputs and D.outputs["a"][-1].finished)
        run_until(P, lambda: "a" not in P.sched.requests)

        params = prefill(P, "b", tokens, 31)  # the same prompt again
        snapshot = [b.copy() for b in D.buffers(0)]
        D.sched.add_request(request(D, "b", tokens, params, seed=31))
        so, _ = D.step()
        (job,) = so.kv_connector_metadata.reads
        assert job.local_block_ids == [[], []] and not job.awaited  # notify only
        # D's cache held all 64 tokens P computed: it computes only the last one,
        # without waiting for remote KV.
        assert so.num_scheduled_tokens == {"b": 1}
        assert D.sched.requests["b"].num_computed_tokens == tokens
        run_until(P, lambda: "b" not in P.sched.requests)
        assert [(c.kind, c.readers) for c in p_seen["b"]] == [
            ("sent", [ReaderReport(D.name, [0], True)])]
        run_until(D, lambda: "b" in d_seen)
        assert [(c.kind, c.nbytes) for c in d_seen["b"]] == [("received", 0)]
        assert all((a == b).all() for a, b in zip(snapshot, D.buffers(0))), "bytes moved"
        run_until(D, lambda: "b" in D.outputs and D.outputs["b"][-1].finished)
        assert sum(len(o.new_token_ids) for o in D.outputs["b"]) == 4  # max_tokens
    finally:
        P.shutdown()
        D.shutdown()


def test_preemption_never_frees_blocks_a_read_may_write(sidecars: Sidecars,
                                                      models: dict[bool, str]) -> None:
    """Preemption through vLLM's real scheduler (``reset_prefix_cache`` preempts
    every running request, as an operator's cache reset does).

    While D's read is in flight the request is not running, so vLLM does not
    preempt it (the reset refuses) and its blocks stay allocated: nothing can
    be written into reused blocks. Once the read is done (P's hold ended ``sent``), the
    request runs and may be preempted: the connector is told
    (``handle_preemptions``), starts no second read, the sidecar writes
    nothing more, and vLLM recomputes the request locally."""
    P, D = pair(sidecars, models, 1, 1, False, {"x": 41})
    p_seen, d_seen = record_completions(P), record_completions(D)
    metas: list[Any] = []
    step = D.step

    def recording_step() -> Any:
        so, agg = step()
        metas.append(so.kv_connector_metadata)
        return so, agg

    D.step = recording_step  # type: ignore[method-assign]
    tokens = 50
    try:
        params = prefill(P, "x", tokens, 41)
        D.sched.add_request(request(D, "x", tokens, params, seed=41))
        blocks = schedule_reads(D, "x")["x"]
        with pytest.raises(RuntimeError, match="waiting for remote KV transfer"):
            D.sched.reset_prefix_cache(reset_running_requests=True)
        assert D.sched.requests["x"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert D.block_ids("x") == blocks  # still the read's, not freed
        run_until(D, lambda: D.sched.requests["x"].status == RequestStatus.RUNNING)
        verify(D, "x", blocks, tokens, 41)
        run_until(P, lambda: "x" not in P.sched.requests)
        assert [c.kind for c in p_seen["x"]] == ["sent"]

        snapshot = [b.copy() for b in D.buffers(0)]
        assert D.sched.reset_prefix_cache(reset_running_requests=True)
        assert D.sched.requests["x"].status == RequestStatus.PREEMPTED
        length = D.sched.requests["x"].num_tokens  # prompt + tokens generated so far
        so, _ = D.step()
        assert so.kv_connector_metadata.preempted == ["x"]
        # Recomputed locally from scratch (the cache was reset), not read again.
        assert so.num_scheduled_tokens == {"x": length}
        run_until(D, lambda: "x" in D.outputs and D.outputs["x"][-1].finished)
        assert [len(m.reads) for m in metas] == [1] + [0] * (len(metas) - 1)
        assert [c.kind for c in d_seen["x"]] == ["received"]
        assert all((a == b).all() for a, b in zip(snapshot, D.buffers(0))), "late write"
        assert [c.kind for c in p_seen["x"]] == ["sent"]
    finally:
        P.shutdown()
        D.shutdown()


def test_d_abort_before_its_read_releases_p_hold(sidecars: Sidecars,
                                                 models: dict[bool, str]) -> None:
    """An abort before D scheduled the read still notifies P, which frees its blocks
    at once (not when its lease expires)."""
    P, D = pair(sidecars, models, 1, 1, False, {"x": 5})
    try:
        params = prefill(P, "x", 40, 5)
        free_before = D.sched.kv_cache_manager.block_pool.get_num_free_blocks()
        D.sched.add_request(request(D, "x", 40, params, seed=5))
        D.sched.finish_requests("x", RequestStatus.FINISHED_ABORTED)
        so, _ = D.step()
        (job,) = so.kv_connector_metadata.reads
        assert job.local_block_ids == [[]] and not job.awaited  # notify only
        expired: list[int] = []

        def released() -> bool:
            _, agg = P.step()
            stats = agg.kv_connector_output and agg.kv_connector_output.kv_connector_stats
            if stats is not None:
                expired.extend(stats.data["num_kv_expired_reqs"])
            return "x" not in P.sched.requests

        deadline = time.monotonic() + WAIT_S
        while not released() and time.monotonic() < deadline:
            time.sleep(0.002)
        assert "x" not in P.sched.requests
        assert not expired, "P's hold expired instead of being released by D's notification"
        assert D.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
        assert all((b == POISON).all() for b in D.buffers(0))  # nothing was read
    finally:
        P.shutdown()
        D.shutdown()


def test_d_abort_while_reading_frees_its_blocks(sidecars: Sidecars,
                                               models: dict[bool, str]) -> None:
    P, D = pair(sidecars, models, 1, 1, False, {"y": 6})
    try:
        params = prefill(P, "y", 50, 6)
        free_before = D.sched.kv_cache_manager.block_pool.get_num_free_blocks()
        D.sched.add_request(request(D, "y", 50, params, seed=6))
        D.step()
        assert D.sched.requests["y"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        D.sched.finish_requests("y", RequestStatus.FINISHED_ABORTED)
        # The blocks come back only once the worker reported the read finished
        # (aborted, or completed before the release arrived).
        run_until(D, lambda: "y" not in D.sched.requests)
        assert D.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    finally:
        P.shutdown()
        D.shutdown()


@pytest.mark.parametrize("hybrid", [False, True], ids=["attn", "hybrid"])
def test_p_sidecar_dies_d_recomputes(tmp_path: Path, sidecars: Sidecars,
                                    models: dict[bool, str], hybrid: bool,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """P's sidecar is stopped, then killed, while D reads: D's read fails, the
    request is reported finished with its blocks invalid in the same step (and
    not as a failed request, so vLLM keeps the valid prefix: nothing here), vLLM
    recomputes it, and nothing is written into D's pages afterwards. Hybrid
    (two KV-cache groups): vLLM 0.33 takes the failure by request
    (failed_recving) only, so no block ids are reported."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    own = SidecarProcess(tmp_path, "vp-doomed", args=["--hold-timeout", "60", *FAST]).start(600.0)
    n = next(_ids)
    P = make_engine(f"P{n}", models[hybrid], "kv_producer", 1, [own.socket], 32, hybrid)
    P.fill = oracle_fill(lambda rid: 9)
    D = make_engine(f"D{n}", models[hybrid], "kv_consumer", 1, [sidecars.d[0].socket], 32,
                    hybrid)
    try:
        params = prefill(P, "z", 60, 9)
        own.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]  # a silent peer
        D.sched.add_request(request(D, "z", 60, params, seed=9))
        so, _ = D.step()
        (job,) = so.kv_connector_metadata.reads
        own.kill()  # dies (SIGKILL) while D's handshake/read waits on it
        failed_step = None
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            so, agg = D.step()
            out = agg.kv_connector_output
            if out is not None and "z" in (out.finished_recving or ()):
                failed_step = out
                break
        assert failed_step is not None, "D never reported the failed read"
        assert failed_step.failed_recving == ({"z"} if hybrid else set())
        want = set() if hybrid else set(job.local_block_ids[0])
        assert failed_step.invalid_block_ids == want
        snapshot = [b.copy() for b in D.buffers(0)]
        # vLLM recomputes the whole prompt locally (kv_load_failure_policy=recompute).
        so, _ = D.step()
        assert so.num_scheduled_tokens.get("z") == 60
        for _ in range(20):
            D.step()
        assert all((a == b).all() for a, b in zip(snapshot, D.buffers(0))), "late write"
        assert all((b == POISON).all() for b in D.buffers(0))
    finally:
        P.shutdown()
        D.shutdown()
        own.kill()


def test_params_without_their_hold_tokens_read_nothing(sidecars: Sidecars,
                                                      models: dict[bool, str]) -> None:
    """D's read moves bytes only with the tokens P's scheduler put in the
    request's ``kv_transfer_params``: without them, or with another request's,
    the read fails (finished with its blocks invalid in one step, vLLM
    recomputes) and not one byte lands in D's pages."""
    P, D = pair(sidecars, models, 1, 1, False, {"t0": 11, "t1": 12})
    try:
        params = {rid: prefill(P, rid, 40, 11 + i) for i, rid in enumerate(("t0", "t1"))}
        assert all(len(p["remote_tokens"]) == 1 for p in params.values())
        bare = {k: v for k, v in params["t0"].items() if k != "remote_tokens"}
        swapped = {**params["t1"], "remote_tokens": params["t0"]["remote_tokens"]}
        for rid, p in (("t0", bare), ("t1", swapped)):
            D.sched.add_request(request(D, rid, 40, p, seed=0))
        failed: set[str] = set()

        def both_failed() -> bool:
            _, agg = D.step()
            out = agg.kv_connector_output
            failed.update(failed_reads(out))
            return failed == {"t0", "t1"}

        deadline = time.monotonic() + WAIT_S
        while not both_failed() and time.monotonic() < deadline:
            time.sleep(0.002)
        assert failed == {"t0", "t1"}
        assert all((b == POISON).all() for b in D.buffers(0))  # not one byte landed
    finally:
        P.shutdown()
        D.shutdown()


def test_unsupported_kv_groups_are_refused_at_start_up(models: dict[bool, str]) -> None:
    """A chunked-local-attention group (Llama 4 with the hybrid allocator forced
    on): the scheduler-side connector refuses it when built, naming the spec and
    the model."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    from .harness import vllm_config

    spec = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=16,
                                     dtype=torch.bfloat16, attention_chunk_size=64)
    kcc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    cfg = vllm_config(models[False], "kv_consumer", "E", 1, ["/nonexistent.sock"], False)
    with pytest.raises(UnsupportedConfig,
                       match=r"ChunkedLocalAttentionSpec of model .*llama is not supported"):
        KvSidecarConnector(cfg, KVConnectorRole.SCHEDULER, kcc)


def test_pipeline_parallel_is_refused_at_start_up(models: dict[bool, str]) -> None:
    """PP > 1: refused when the connector is built (scheduler and worker), naming
    it; one sidecar serves one tp rank of a single pipeline stage."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from .harness import kv_cache_config, vllm_config

    cfg = vllm_config(models[False], "kv_producer", "E", 1, ["/nonexistent.sock"], False)
    cfg.parallel_config.pipeline_parallel_size = 2
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UnsupportedConfig, match="pipeline_parallel_size 2 is not supported"):
            KvSidecarConnector(cfg, role, kv_cache_config(1, 8, False))


def test_memory_kind_is_checked_against_the_device_at_start_up() -> None:
    """A GPU worker is refused unless it asks for a GPU reservation (named in the
    message); GPU memory is refused on a CPU worker; CPU defaults to memfd."""
    from kvsidecar.integrations.vllm.settings import memory_for

    assert memory_for("cpu", None) == "memfd" and memory_for("cpu", "shm") == "shm"
    assert memory_for("cuda", "cuda_vmm") == "cuda_vmm"
    with pytest.raises(UnsupportedConfig, match=r"'cuda_vmm', 'cuda_malloc'.*Use it with vLLM"):
        memory_for("cuda", None)
    with pytest.raises(UnsupportedConfig, match="GPU memory but this vLLM worker runs on"):
        memory_for("cpu", "cuda_malloc")


def test_two_ranks_on_one_sidecar_are_refused_at_start_up(sidecars: Sidecars,
                                                          models: dict[bool, str]) -> None:
    """Each tp rank needs its own sidecar: the second rank of an engine pointed at
    the first one's sidecar is refused when it registers, before any request,
    naming the reason (its KV cache never aliases the first rank's)."""
    from kvsidecar.ipc.client import SidecarClient

    n = next(_ids)
    try:
        with pytest.raises(UnsupportedConfig,
                           match=r"tp rank 1's KV cache.*give every tp rank its own"):
            make_engine(f"P{n}", models[False], "kv_producer", 2, [sidecars.p[0].socket] * 2,
                        16, False)
    finally:
        with SidecarClient(sidecars.p[0].socket) as c:
            c.deregister(f"P{n}")  # rank 0's registration (and reservation)


def count_batches(eng: Engine, method: str) -> list[int]:
    """The sizes of the batches rank 0's worker sends (a pass-through wrapper)."""
    w = eng.workers[0].worker
    assert w is not None
    sizes: list[int] = []
    real = getattr(w.client, method)

    def counting(engine_id: str, specs: Any) -> Any:
        sizes.append(len(specs))
        return real(engine_id, specs)

    setattr(w.client, method, counting)
    return sizes


@pytest.mark.parametrize("hybrid", [False, True], ids=["attn", "hybrid"])
def test_a_steps_holds_and_reads_go_in_one_message_each(sidecars: Sidecars,
                                                        models: dict[bool, str], hybrid: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests that finish prefill in the same P step are held with one
    ``hold_many``; scheduled in the same D step, they are read with one
    ``read_many_nowait`` (the step does not wait for the sidecar's answer);
    both arrive oracle-exact."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    seeds = {"m1": 21, "m2": 22}
    P, D = pair(sidecars, models, 1, 2 if hybrid else 1, hybrid, seeds)
    holds, reads = count_batches(P, "hold_many"), count_batches(D, "read_many_nowait")
    try:
        tokens = {"m1": 40, "m2": 57}
        for rid, n in tokens.items():
            P.sched.add_request(request(P, rid, n, {"do_remote_decode": True}, max_tokens=1,
                                        seed=seeds[rid]))
        params: dict[str, dict[str, Any]] = {}
        for _ in range(10):
            P.step()
            for rid in tokens:
                outs = P.outputs.get(rid, [])
                if outs and outs[-1].finished and rid not in params:
                    params[rid] = dict(outs[-1].kv_transfer_params or {})
            if len(params) == 2:
                break
        assert sorted(params) == ["m1", "m2"]
        run_until(P, lambda: bool(holds))  # the holds ride on the next step's metadata
        assert holds == [2]
        for rid, n in tokens.items():
            D.sched.add_request(request(D, rid, n, params[rid], seed=seeds[rid]))
        blocks = schedule_reads(D, *tokens)
        assert reads == [2]
        run_until(D, lambda: all(r in D.sched.finished_recving_kv_req_ids
                                 or D.sched.requests[r].status == RequestStatus.RUNNING
                                 for r in tokens))
        for rid, n in tokens.items():
            verify(D, rid, blocks[rid], n - 1 if hybrid else n, seeds[rid])
        run_until(P, lambda: not any(r in P.sched.requests for r in tokens))
    finally:
        P.shutdown()
        D.shutdown()
