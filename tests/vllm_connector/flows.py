"""Shared steps of the vLLM connector scenarios (the tests named ``test_*`` next
to this module): an engine pair on the package's sidecars, the checks vLLM's
own connector tests make after every lifecycle (nothing left in the scheduler,
every block back in the pool), and ways to pin down when a read finishes.

Everything here drives vLLM 0.33's real ``Scheduler`` through
:class:`harness.Engine`; nothing stands in for vLLM or for a sidecar.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.v1.request import RequestStatus

from .harness import Engine, make_engine, oracle_fill, request
from .test_connector import WAIT_S, Sidecars

_ids = itertools.count()


def engines(sidecars: Sidecars, model: str, *, hybrid: bool = False, p_tp: int = 1,
            d_tp: int = 1, p_blocks: int = 64, d_blocks: int = 48, seed: int = 0,
            p: dict[str, Any] | None = None, d: dict[str, Any] | None = None
            ) -> tuple[Engine, Engine]:
    """A P engine (its "model" writes the oracle state of ``seed``) and a D
    engine on the package's sidecars; ``p`` / ``d``: more make_engine arguments."""
    n = next(_ids)
    P = make_engine(f"sP{n}", model, "kv_producer", p_tp,
                    [s.socket for s in sidecars.p[:p_tp]], p_blocks, hybrid, **(p or {}))
    D = make_engine(f"sD{n}", model, "kv_consumer", d_tp,
                    [s.socket for s in sidecars.d[:d_tp]], d_blocks, hybrid, **(d or {}))
    P.fill = oracle_fill(lambda rid: seed)
    return P, D


@contextlib.contextmanager
def closing(*engs: Engine) -> Iterator[None]:
    try:
        yield
    finally:
        for e in engs:
            e.shutdown()


def fill_when_finished(P: Engine, seed: int) -> None:
    """P's "model" writes a request's whole oracle state once its prefill is
    done, into the blocks it then holds: for prefills that run in chunks or
    are preempted and resumed (the default fill writes only at the first
    schedule)."""
    fill = oracle_fill(lambda rid: seed)
    step = P.step
    P.fill = None

    def stepping() -> Any:
        so, agg = step()
        for rid, outs in P.outputs.items():
            if outs[-1].finished and rid in P.sched.requests and rid not in done:
                done.add(rid)
                fill(P, P.sched.requests[rid])
        return so, agg

    done: set[str] = set()
    P.step = stepping  # type: ignore[method-assign]


def free_blocks(eng: Engine) -> int:
    return int(eng.sched.kv_cache_manager.block_pool.get_num_free_blocks())


def assert_drained(eng: Engine) -> None:
    """What vLLM's ``assert_scheduler_empty`` checks after a lifecycle: no
    request left anywhere in the scheduler, no block referenced (all but the
    null block free), nothing waiting on a transfer."""
    s = eng.sched
    assert not s.requests, f"{eng.name}: requests left {sorted(s.requests)}"
    assert len(s.waiting) == 0 and len(s.running) == 0
    assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
    for m in s.kv_cache_manager.coordinator.single_type_managers:
        assert not m.req_to_blocks, f"{eng.name}: blocks still owned by {list(m.req_to_blocks)}"
    assert free_blocks(eng) == s.kv_cache_config.num_blocks - 1  # all but the null block
    assert all(b.ref_cnt == 0 for b in s.kv_cache_manager.block_pool.blocks[1:])


def step_until(eng: Engine, done: Any) -> list[Any]:
    """Step ``eng`` until ``done()``; every step's aggregated worker output."""
    outs: list[Any] = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        _, agg = eng.step()
        outs.append(agg.kv_connector_output)
        if done():
            return outs
        time.sleep(0.002)
    raise AssertionError(f"{eng.name}: condition not reached within {WAIT_S} s")


def reported(outs: list[Any], field: str) -> set[str]:
    """The request ids the workers reported in ``field`` over ``outs``."""
    return {r for o in outs if o is not None for r in (getattr(o, field) or ())}


def finish_prefill(P: Engine, rid: str, tokens: int, seed: int = 0) -> dict[str, Any]:
    """Add a ``do_remote_decode`` request and step P until it finished; its
    kv_transfer_params (what the proxy hands D)."""
    P.sched.add_request(request(P, rid, tokens, {"do_remote_decode": True}, max_tokens=1,
                                seed=seed))
    step_until(P, lambda: bool(P.outputs.get(rid)) and P.outputs[rid][-1].finished)
    params = P.outputs[rid][-1].kv_transfer_params
    assert params is not None and params["do_remote_prefill"], params
    return dict(params)


def finished(eng: Engine, rid: str) -> bool:
    outs = eng.outputs.get(rid, [])
    return bool(outs) and outs[-1].finished


def reads_end_in_their_step(eng: Engine) -> None:
    """Each worker's poll waits until every awaited read it was handed has been
    reported, so a read always ends in the step that started it. Scenarios
    that count steps after a read (a request that runs, then runs out of
    blocks) then do not depend on how fast the machine is. A pass-through
    wrapper of the real calls."""
    for w in eng.workers:
        pending: set[str] = set()
        bind, poll = w.bind_connector_metadata, w.get_transfer_results

        def binding(meta: Any, bind: Any = bind, pending: set[str] = pending) -> None:
            pending.update(j.request_id for j in meta.reads if j.awaited)
            bind(meta)

        def polling(done: set[str], poll: Any = poll, pending: set[str] = pending
                    ) -> KVConnectorTransferResults:
            out = KVConnectorTransferResults()
            deadline = time.monotonic() + WAIT_S
            while True:
                r = poll(done)
                out.finished_sending |= r.finished_sending
                out.finished_recving |= r.finished_recving
                out.failed_recving |= r.failed_recving
                pending.difference_update(r.finished_recving)
                if not pending:
                    return out
                assert time.monotonic() < deadline, f"reads {sorted(pending)} never ended"
                time.sleep(0.002)

        w.bind_connector_metadata = binding  # type: ignore[method-assign]
        w.get_transfer_results = polling  # type: ignore[method-assign]


def record_holds(P: Engine) -> list[str]:
    """Every request rank 0's worker asks its sidecar to hold, single or in a
    batch (pass-through wrappers around the real client)."""
    w = P.workers[0].worker
    assert w is not None
    held: list[str] = []
    hold, hold_many = w.client.hold, w.client.hold_many

    def one(engine_id: str, rid: str, *a: Any, **k: Any) -> Any:
        held.append(rid)
        return hold(engine_id, rid, *a, **k)

    def many(engine_id: str, specs: Any) -> Any:
        held.extend(s.request_id for s in specs)
        return hold_many(engine_id, specs)

    w.client.hold = one  # type: ignore[method-assign]
    w.client.hold_many = many  # type: ignore[method-assign]
    return held


def record_metadata(eng: Engine) -> list[Any]:
    """The connector metadata of every step ``eng`` runs from now on."""
    metas: list[Any] = []
    step = eng.step

    def recording() -> Any:
        so, agg = step()
        metas.append(so.kv_connector_metadata)
        return so, agg

    eng.step = recording  # type: ignore[method-assign]
    return metas


def waiting_for_kv(eng: Engine, rid: str) -> bool:
    return bool(eng.sched.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS)
