"""handlers: every engine request type has exactly one handler in the table, and a
stopping sidecar refuses the requests that would start new work (counted)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from kvsidecar.daemon.background import Alarm
from kvsidecar.daemon.engines.table import EngineTable
from kvsidecar.daemon.handlers import Handlers
from kvsidecar.daemon.holds import HoldBook, HoldOutcome, Report
from kvsidecar.daemon.state import DaemonState
from kvsidecar.ipc import hold_token
from kvsidecar.ipc.layout import attention_layout
from kvsidecar.ipc.protocol import (
    DUPLICATE,
    REQUEST_TYPES,
    UNAVAILABLE,
    Held,
    Hold,
    Ping,
    Poll,
    Pong,
    Read,
    Register,
    Release,
    RemoteEngine,
    RequestError,
    Reserve,
)
from kvsidecar.metrics.registry import Metrics


def _handlers(stopping: bool) -> tuple[Handlers, Metrics]:
    async def never(_req: Any) -> Any:
        raise AssertionError("a refused request reached its handler")

    metrics = Metrics()
    ctx = SimpleNamespace(
        registry=SimpleNamespace(register=never, reserve=never), metrics=metrics,
        state=DaemonState(stopping=stopping), table=EngineTable(),
        settings=SimpleNamespace(engine_lease_s=5.0))
    return Handlers(cast(Any, ctx)), metrics


def test_every_request_type_has_its_handler() -> None:
    handlers, _ = _handlers(stopping=False)
    assert set(handlers.table) == set(REQUEST_TYPES)


@pytest.mark.parametrize("req", [
    Register(id=1, engine_id="e", tp_rank=0, layout=cast(Any, None), mode="allocate"),
    Read(id=1, engine_id="e", request_id="r", local_block_ids=[0], remote=cast(Any, None),
         remote_block_ids=[0]),
    Hold(id=1, engine_id="e", request_id="r", block_ids=[0]),
    Reserve(id=1, engine_id="e", nbytes=4096),
], ids=lambda r: type(r).__name__)
def test_a_stopping_sidecar_refuses_new_work(req: Any) -> None:
    handlers, metrics = _handlers(stopping=True)
    with pytest.raises(RequestError) as e:
        asyncio.run(handlers.handle(req))
    assert e.value.code == UNAVAILABLE
    op = type(req).__name__.lower()
    assert _count(metrics, op, UNAVAILABLE) == 1


def test_a_stopping_sidecar_still_answers_pings() -> None:
    handlers, metrics = _handlers(stopping=True)
    assert isinstance(asyncio.run(handlers.handle(Ping(id=1))), Pong)
    assert _count(metrics, "ping", "") == 1


def test_a_request_cancelled_unanswered_is_not_counted_as_an_error() -> None:
    """A waiting poll whose connection closed is cancelled (the engine server
    does so): it was never answered, so it is neither an ``internal`` error nor
    an answered poll; a handler's own failure still counts as ``internal``."""
    handlers, metrics = _handlers(stopping=False)

    async def waits(_req: Any) -> Any:
        await asyncio.sleep(60)

    async def fails(_req: Any) -> Any:
        raise RuntimeError("a bug")

    async def main() -> None:
        handlers.table[Poll] = waits
        task = asyncio.ensure_future(handlers.handle(Poll("e", id=1)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        handlers.table[Poll] = fails
        with pytest.raises(RuntimeError):
            await handlers.handle(Poll("e", id=2))

    asyncio.run(main())
    assert _count(metrics, "poll", "") == 0
    assert _count(metrics, "poll", "internal") == 1


def _count(m: Metrics, op: str, error: str) -> float:
    v = m.registry.get_sample_value("kvsidecar_engine_requests_total", {"op": op, "error": error})
    return 0.0 if v is None else v


def _p_side(stopping: bool = False, spans: Any = None, max_completions: int = 100
            ) -> tuple[Handlers, HoldBook]:
    """Handlers over one P engine rank with a real hold book, one hold allowed;
    its ``completions`` are the holds' outcomes not yet polled."""
    done: list[HoldOutcome] = []
    book = HoldBook(default_timeout_s=10, grace_s=5, on_done=done.append, max_life_s=600)
    layout = attention_layout(model="m", num_layers=1, total_kv_heads=1, head_dim=8,
                              block_tokens=16, tp_size=1, num_blocks=8)
    eng = SimpleNamespace(engine_id="P", tp_rank=0, uid=None, holds=book, completions=done,
                          layout=layout, hold_key=hold_token.new_key(),
                          worker=SimpleNamespace(set_hot=lambda _hot: None),
                          has_completion=lambda rid: any(o.request_id == rid for o in done))
    ctx = SimpleNamespace(
        table=SimpleNamespace(ranks={"P": eng}, engine=lambda _e: eng),
        state=DaemonState(stopping=stopping), metrics=Metrics(),
        settings=SimpleNamespace(max_holds_per_engine=1,
                                 max_completions_per_engine=max_completions,
                                 engine_lease_s=5.0),
        reads=SimpleNamespace(count=lambda _e: 0, abort=lambda *_a: False), alarm=Alarm(),
        spans=spans or SimpleNamespace(start=lambda *_a: None, end=lambda *_a: None),
        registry=SimpleNamespace(register=None, reserve=None))
    return Handlers(cast(Any, ctx)), book


def _hold(rid: str, blocks: list[int]) -> Hold:
    return Hold(id=1, engine_id="P", request_id=rid, block_ids=[blocks])


def test_a_refused_hold_refuses_its_claims_and_an_early_claimed_one_passes_the_limit(
        ) -> None:
    """A hold refused for the limit or its blocks leaves its request unclaimable
    (the engine, told so, may reuse the blocks); a hold a reader already
    claimed early is placed past the limit (the reader may be copying)."""
    handlers, book = _p_side()
    asyncio.run(handlers.handle(_hold("h0", [0])))  # the one hold allowed
    for rid, blocks in (("h1", [1]), ("bad", [99])):
        with pytest.raises(RequestError):
            asyncio.run(handlers.handle(_hold(rid, blocks)))
        lease = book.claim("P", rid, now=time.monotonic())
        assert not lease.granted and "the hold was refused" in lease.reason, rid
    assert book.claim("P", "h2", now=time.monotonic()).granted  # early
    assert isinstance(asyncio.run(handlers.handle(_hold("h2", [2]))), Held)
    assert len(book) == 2
    with pytest.raises(RequestError) as e:  # a copy of a placed hold: nothing recorded
        asyncio.run(handlers.handle(_hold("h0", [0])))
    assert e.value.code == DUPLICATE and book.claim("P", "h0", now=time.monotonic()).granted


@pytest.mark.parametrize("end", ["sent", "expired", "released"])
def test_a_hold_sent_again_after_it_ended_unpolled_is_a_duplicate(end: str) -> None:
    """A hold sent again (its first answer lost) whose first copy was placed and
    has ended (read, run out, released) while that end awaits the engine's poll
    meets ``duplicate``: nothing is pinned again and no claim is granted (the
    engine frees the blocks once it polls that end). Once the engine has
    acknowledged the end, the id may be held anew."""
    handlers, book = _p_side()
    eng = handlers.ctx.table.ranks["P"]
    assert isinstance(asyncio.run(handlers.handle(_hold("g", [0]))), Held)
    now = time.monotonic()
    if end == "sent":
        book.report("P", "g", Report("D", 0, 1), now)
    elif end == "expired":
        book.expire(now + 3600)
    else:
        asyncio.run(handlers.handle(Release(id=2, engine_id="P", request_id="g")))
    assert len(book) == 0 and eng.has_completion("g")
    with pytest.raises(RequestError, match="that hold has ended") as e:
        asyncio.run(handlers.handle(_hold("g", [0])))
    assert e.value.code == DUPLICATE
    assert len(book) == 0 and len(eng.completions) == 1
    assert not book.claim("P", "g", now=time.monotonic()).granted
    eng.completions.clear()  # polled and acknowledged: the engine knows it ended
    assert isinstance(asyncio.run(handlers.handle(_hold("g", [0]))), Held)
    assert ("P", "g") in book


def test_a_rank_remembers_as_many_hold_ends_as_it_may_queue_completions() -> None:
    """The duplicate guard above reads the hold book's ends: a rank allowed more
    unpolled completions than the book's default memory remembers that many."""
    from kvsidecar.daemon.engines.rank import EngineRank
    from kvsidecar.daemon.settings import Settings

    for cap, want in ((1000, 65536), (100_000, 100_000)):
        eng = EngineRank(engine_id="P", tp_rank=0, layout=cast(Any, None), regions=[],
                         owned=True, keep_on_exit=False, pid=1, worker=cast(Any, object()),
                         reg_id=0, bases=np.zeros(0, np.int64), peers=cast(Any, None),
                         info=cast(Any, None),
                         settings=Settings(socket="/nowhere.sock",
                                           max_completions_per_engine=cap))
        assert eng.holds.max_ended == want


def test_a_hold_refused_while_stopping_refuses_its_claims() -> None:
    handlers, book = _p_side(stopping=True)
    with pytest.raises(RequestError, match="shutting down"):
        asyncio.run(handlers.handle(_hold("h", [0])))
    lease = book.claim("P", "h", now=time.monotonic())
    assert not lease.granted and "shutting down" in lease.reason


def test_an_early_claimed_hold_still_meets_the_completions_bound() -> None:
    """Past the holds limit, not past reads + holds + unpolled completions."""
    handlers, book = _p_side(max_completions=1)
    asyncio.run(handlers.handle(_hold("h0", [0])))
    assert book.claim("P", "h1", now=time.monotonic()).granted  # early
    with pytest.raises(RequestError, match="--max-completions-per-engine"):
        asyncio.run(handlers.handle(_hold("h1", [1])))
    assert not book.claim("P", "h1", now=time.monotonic()).granted


def test_a_hold_whose_placing_fails_does_not_stand() -> None:
    """An internal error after the hold was placed: the engine is told it
    failed, so the hold is taken back and its claims refused."""
    def boom(*_a: Any) -> None:
        raise RuntimeError("spans broke")

    handlers, book = _p_side(spans=SimpleNamespace(start=boom))
    with pytest.raises(RuntimeError, match="spans broke"):
        asyncio.run(handlers.handle(_hold("h", [0])))
    assert len(book) == 0
    lease = book.claim("P", "h", now=time.monotonic())
    assert not lease.granted and "RuntimeError: spans broke" in lease.reason


@pytest.mark.parametrize("blocks", [[0, 0], [3, 1, 3], [0] * 2_000_000],
                         ids=["two", "three", "two-million"])
def test_a_hold_naming_a_page_twice_is_refused_and_keeps_nothing(blocks: list[int]) -> None:
    """A hold names each page once, so it holds at most num_blocks ids (8 here):
    the audit's hold of 2,000,000 zeros was placed and kept ~17 MB for its life."""
    handlers, book = _p_side()
    with pytest.raises(RequestError, match=rf"held block id {blocks[0]} named twice: a hold "
                                           "names each page once") as e:
        asyncio.run(handlers.handle(_hold("dup", blocks)))
    assert e.value.code == "bad_request"
    assert len(book) == 0
    assert not book.claim("P", "dup", now=time.monotonic()).granted


def test_a_hold_of_distinct_pages_in_two_groups_is_refused_when_they_share_one() -> None:
    """All groups share the pages: a page held in two groups is named twice."""
    from kvsidecar.sim.models import hybrid

    handlers, book = _p_side()
    eng = handlers.ctx.table.ranks["P"]
    eng.layout = hybrid(1, 8)
    assert len(eng.layout.groups) == 2
    with pytest.raises(RequestError, match="held block id 2 named twice"):
        asyncio.run(handlers.handle(Hold(id=1, engine_id="P", request_id="x",
                                         block_ids=[[1, 2], [2]])))
    assert isinstance(asyncio.run(handlers.handle(Hold(id=2, engine_id="P", request_id="y",
                                                       block_ids=[[1, 2], [3]]))), Held)
    assert len(book) == 1


def test_a_copy_of_a_hold_or_read_taken_meets_duplicate_while_stopping() -> None:
    """A stopping sidecar refuses new holds and reads ``unavailable``, but a copy
    of one it took (the engine got no answer and sends it again) meets
    ``duplicate``, as before any other refusal: a hold open or ended unpolled
    (its blocks stay the engine's until that one completion), a read in
    progress. ``unavailable`` would say nothing is held or read, and the engine
    would free blocks the draining sidecar still serves or writes.
    (End to end: tests/vllm_connector/test_sidecar_errors.py.)"""
    handlers, book = _p_side()
    eng = handlers.ctx.table.ranks["P"]
    assert isinstance(asyncio.run(handlers.handle(_hold("g", [0]))), Held)
    handlers.ctx.state.stopping = True
    with pytest.raises(RequestError, match="already held") as e:
        asyncio.run(handlers.handle(_hold("g", [0])))
    assert e.value.code == DUPLICATE and ("P", "g") in book
    book.report("P", "g", Report("D", 0, 1), time.monotonic())  # read: ends sent
    with pytest.raises(RequestError, match="that hold has ended") as e:
        asyncio.run(handlers.handle(_hold("g", [0])))
    assert e.value.code == DUPLICATE and len(book) == 0 and len(eng.completions) == 1
    assert not book.claim("P", "g", now=time.monotonic()).granted
    with pytest.raises(RequestError, match="shutting down") as e:  # new work
        asyncio.run(handlers.handle(_hold("h", [1])))
    assert e.value.code == UNAVAILABLE

    handlers.ctx.reads = SimpleNamespace(count=lambda _e: 1,
                                         reading=lambda _e, rid: rid == "r")
    remote = RemoteEngine("Q", 1, ["127.0.0.1:5555"])
    for rid, code in (("r", DUPLICATE), ("r2", UNAVAILABLE)):
        with pytest.raises(RequestError) as e:
            asyncio.run(handlers.handle(Read(id=3, engine_id="P", request_id=rid,
                                             local_block_ids=[[0]], remote=remote,
                                             remote_block_ids=[[0]])))
        assert e.value.code == code, rid
