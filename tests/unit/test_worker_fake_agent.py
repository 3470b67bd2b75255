"""NixlWorker with a fake NIXL agent (tests/unit/fake_nixl.py): resets and
re-creation, merging, poll timing, shutdown with reads in flight, failure
delivery; one real thread, no processes, no real NIXL."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvsidecar.daemon import notifications
from kvsidecar.daemon.transport import agent_host
from kvsidecar.daemon.transport.errors import NixlAgentReset, NixlKilledByReset, NixlTimeout
from kvsidecar.daemon.transport.jobs import Job
from kvsidecar.daemon.transport.worker import (
    AgentReset,
    NixlError,
    NixlWorker,
    NotifyOp,
    PollPolicy,
    ReadOp,
    TransferStats,
    WorkerOptions,
)

from .fake_nixl import FakeFabric, FakeNixlAgent, Xfer

KiB = 1024
MiB = 1 << 20
FAST = PollPolicy(busy_s=1e-4, hot_s=5e-4, hot_max_s=1e-3, idle_s=5e-4, idle_max_s=1e-3,
                  soon_s=5e-5, soon_window_s=1e-3)


@pytest.fixture(autouse=True)
def quick_teardown(monkeypatch: pytest.MonkeyPatch) -> None:
    """Milliseconds, not the production drain and retry waits."""
    monkeypatch.setattr(agent_host, "DRAIN_BEFORE_DESTROY_S", 0.001)
    monkeypatch.setattr(agent_host, "RECREATE_FIRST_S", 0.002)
    monkeypatch.setattr(agent_host, "RECREATE_MAX_S", 0.005)


class Buf:
    def __init__(self, nbytes: int, seed: int | None = None) -> None:
        self.view = (np.zeros(nbytes, np.uint8) if seed is None else
                     np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))
        self.addr = int(self.view.ctypes.data)
        self.nbytes = nbytes


def i64(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def fake_peer(fabric: FakeFabric, name: str, mem: Buf) -> FakeNixlAgent:
    peer = fabric.factory(name)
    peer.register_memory(peer.get_reg_descs([[mem.addr, mem.nbytes, 0]], "DRAM"))
    return peer


@dataclass
class Rig:
    fabric: FakeFabric
    w: NixlWorker
    mem: Buf
    peer: FakeNixlAgent
    peer_mem: Buf
    name: str
    reg: int
    notifs: list[tuple[str, bytes]] = field(default_factory=list)
    resets: list[AgentReset] = field(default_factory=list)

    def read(self, off: int, src: int, n: int, **kw: Any) -> ReadOp:
        return ReadOp(self.name, i64([self.mem.addr + off]), i64([self.peer_mem.addr + src]),
                      i64([n]), **kw)

    def peer_notifs(self) -> list[bytes]:
        return [m for msgs in self.peer.get_new_notifs().values() for m in msgs]


async def make_rig(**opts: Any) -> Rig:
    fabric = FakeFabric()
    peer_mem = Buf(MiB, seed=1)
    peer = fake_peer(fabric, "peer", peer_mem)
    rig = Rig(fabric, None, Buf(MiB), peer, peer_mem, "peer", 0)  # type: ignore[arg-type]
    options = WorkerOptions(**{"poll": FAST, "agent_factory": fabric.factory,
                               "telemetry": False, "stop_timeout_s": 0.05, **opts})
    rig.w = NixlWorker("local", options, on_notif=lambda a, m: rig.notifs.append((a, m)),
                       on_reset=rig.resets.append)
    await rig.w.start()
    rig.reg = await rig.w.register([(rig.mem.addr, rig.mem.nbytes)])
    rig.name = await rig.w.add_remote(peer.get_agent_metadata())
    return rig


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = await make_rig()
    try:
        yield r
    finally:
        await r.w.stop()


async def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"never reached: {what}")
        await asyncio.sleep(0.0005)


# -- reads and notifications -----------------------------------------------------------------------

async def test_a_read_copies_its_bytes_and_notifies_once_done_is_seen(rig: Rig) -> None:
    rig.fabric.script.append(Xfer(polls=3))
    stats = await rig.w.read(rig.name, i64([rig.mem.addr, rig.mem.addr + 8 * KiB]),
                             i64([rig.peer_mem.addr + 100, rig.peer_mem.addr + 64 * KiB]),
                             i64([100, 4 * KiB]), notif=b"n1")
    assert (stats.bytes, stats.descriptors, stats.telemetry) == (100 + 4 * KiB, 2, False)
    assert np.array_equal(rig.mem.view[:100], rig.peer_mem.view[100:200])
    assert np.array_equal(rig.mem.view[8 * KiB:12 * KiB], rig.peer_mem.view[64 * KiB:68 * KiB])
    assert rig.peer_notifs() == [b"n1"]
    empty = i64([])
    assert await rig.w.read(rig.name, empty, empty, empty, notif=b"z") == TransferStats(0, 0,
                                                                                         0.0, 0.0)
    await rig.w.notify(rig.name, b"bare")
    assert rig.peer_notifs() == [b"z", b"bare"]


async def test_telemetry_gives_the_times_when_asked() -> None:
    r = await make_rig(telemetry=True)
    try:
        stats = await r.w.read(r.name, i64([r.mem.addr]), i64([r.peer_mem.addr]), i64([64]))
        assert (stats.bytes, stats.post_us, stats.xfer_us, stats.telemetry) == (64, 1.0, 2.0,
                                                                                 True)
    finally:
        await r.w.stop()


async def test_notifications_reach_the_loop_thread(rig: Rig) -> None:
    rig.peer.add_remote_agent(await rig.w.metadata())
    rig.peer.send_notif("local", b"ping")
    await asyncio.wait_for(rig.w.progressed(), 5)
    assert rig.notifs == [("peer", b"ping")]


async def test_a_cancelled_read_is_still_polled_to_done_and_notifies(rig: Rig) -> None:
    """NIXL sends a READ's notification only once the reader sees DONE."""
    rig.fabric.script.append(Xfer(polls=20))
    task = asyncio.ensure_future(rig.w.read(rig.name, i64([rig.mem.addr]),
                                            i64([rig.peer_mem.addr]), i64([4 * KiB]),
                                            notif=b"late"))
    await until(lambda: bool(rig.fabric.posted), "the read posted")
    task.cancel()
    got: list[bytes] = []
    await until(lambda: bool(got.extend(rig.peer_notifs()) or got), "its notification")
    assert got == [b"late"]
    assert np.array_equal(rig.mem.view[:4 * KiB], rig.peer_mem.view[:4 * KiB])


async def test_posts_of_one_iteration_are_one_entry_and_fail_alone(rig: Rig) -> None:
    ops: list[ReadOp | NotifyOp] = [rig.read(i * 4 * KiB, i * 8 * KiB, 4 * KiB,
                                             notif=f"g{i}".encode()) for i in range(4)]
    ops.insert(1, rig.read(0, MiB - 100, 4 * KiB, notif=b"past-the-end"))
    ops.insert(2, ReadOp("nobody", i64([rig.mem.addr]), i64([rig.peer_mem.addr]), i64([64])))
    ops.insert(3, ReadOp(rig.name, i64([1, 2]), i64([3]), i64([4])))
    ops.append(NotifyOp(rig.name, b"bare"))
    puts: list[Any] = []
    real_put = rig.w._jobs.put
    rig.w._jobs.put = lambda e: (puts.append(e), real_put(e))  # type: ignore[method-assign]
    try:
        results = await asyncio.gather(*(rig.w.post_soon(op) for op in ops),
                                       return_exceptions=True)
    finally:
        del rig.w._jobs.put
    assert len(puts) == 1 and len(puts[0]) == len(ops) - 1  # the bad-shape one never left
    assert isinstance(results[1], NixlError) and results[1].remote == rig.name
    assert "outside every registered region" in str(results[1])
    assert isinstance(results[2], NixlError) and "nobody" in str(results[2])
    assert isinstance(results[3], ValueError)
    assert [r.bytes for r in results[4:7]] == [4 * KiB] * 3  # type: ignore[union-attr]
    assert isinstance(results[0], TransferStats) and results[-1] is None
    assert sorted(rig.peer_notifs()) == sorted([f"g{i}".encode() for i in range(4)] + [b"bare"])
    assert rig.w.resets == 0  # nothing was posted that could still write


async def test_read_and_post_soon_are_one_path(rig: Rig) -> None:
    """Reads made by read() in one iteration go as one entry, like post_soon's."""
    puts: list[Any] = []
    real_put = rig.w._jobs.put
    rig.w._jobs.put = lambda e: (puts.append(e), real_put(e))  # type: ignore[method-assign]
    try:
        await asyncio.gather(*(rig.w.read(rig.name, i64([rig.mem.addr + i * 64]),
                                          i64([rig.peer_mem.addr]), i64([64]))
                               for i in range(3)), rig.w.notify(rig.name, b"x"))
    finally:
        del rig.w._jobs.put
    assert [len(e) for e in puts] == [4]
    with pytest.raises(ValueError):
        await rig.w.read(rig.name, i64([1, 2]), i64([1]), i64([1]))


# -- merging -------------------------------------------------------------------------------------

async def test_reads_that_may_merge_go_as_one_transfer_with_one_notification() -> None:
    r = await make_rig(join_notifs=notifications.join)
    try:
        notes = [notifications.encode("P", f"m{i}", "D", 0, 1) for i in range(6)]
        ops: list[ReadOp | NotifyOp] = [r.read(i * 4 * KiB, i * 8 * KiB, 4 * KiB,
                                               notif=notes[i], merge=8) for i in range(5)]
        ops.append(r.read(5 * 4 * KiB, 0, 4 * KiB, notif=notes[5]))  # merge=0: alone
        ops += [NotifyOp(r.name, notes[0], merge=8), NotifyOp(r.name, notes[1], merge=8)]
        results = await asyncio.gather(*(r.w.post_soon(op) for op in ops))
        stats = [s for s in results if isinstance(s, TransferStats)]
        assert [(s.bytes, s.reads, s.first) for s in stats] == [
            (4 * KiB, 5, True), *[(4 * KiB, 5, False)] * 4, (4 * KiB, 1, True)]
        assert results[6:] == [None, None]
        assert [n for _, _, n, _ in r.fabric.posted] == [5, 1]  # two transfers
        for i in range(5):
            assert np.array_equal(r.mem.view[i * 4 * KiB:(i + 1) * 4 * KiB],
                                  r.peer_mem.view[i * 8 * KiB:i * 8 * KiB + 4 * KiB]), i
        assert sorted(r.peer_notifs()) == sorted([notifications.join(notes[:5]), notes[5],
                                                  notifications.join(notes[:2])])
        # A read over merge_max_read_bytes goes alone; the small ones around it merge.
        r.fabric.posted.clear()
        r.w._posts.merge_max_read_bytes = 4 * KiB
        sizes = [4 * KiB, 8 * KiB, 4 * KiB, 4 * KiB]
        capped = await asyncio.gather(*(r.w.post_soon(r.read(i * 8 * KiB, i * 8 * KiB, n,
                                                              merge=8))
                                        for i, n in enumerate(sizes)))
        assert [(s.bytes, s.reads, s.first) for s in capped if s is not None] == [
            (4 * KiB, 3, True), (8 * KiB, 1, True), (4 * KiB, 3, False), (4 * KiB, 3, False)]
        assert sorted(n for _, _, n, _ in r.fabric.posted) == [1, 3]
    finally:
        await r.w.stop()


async def test_a_merged_transfer_that_fails_fails_every_read_in_it() -> None:
    r = await make_rig(join_notifs=notifications.join)
    try:
        bad = [r.read(0, 0, 64, merge=8), r.read(64, MiB - 10, 64, merge=8)]  # refused
        failed = await asyncio.gather(*(r.w.post_soon(op) for op in bad), return_exceptions=True)
        assert isinstance(failed[0], NixlError) and failed[0] is failed[1]
        assert r.w.resets == 0
        r.fabric.script.append(Xfer(polls=2, end="ERR"))  # posted, then dies: a reset
        ops = [r.read(0, 0, 64, merge=8), r.read(64, 64, 64, merge=8)]
        failed = await asyncio.gather(*(r.w.post_soon(op) for op in ops), return_exceptions=True)
        assert isinstance(failed[0], NixlError) and failed[0] is failed[1]
        assert "transfer state ERR" in str(failed[0]) and r.w.resets == 1
    finally:
        await r.w.stop()


# -- resets ----------------------------------------------------------------------------------------

def agent_gone_when_done(rig: Rig, fut: asyncio.Future[Any], name: str,
                         seen: list[bool]) -> None:
    """Record, when ``fut`` resolves, whether the agent ``name`` still existed."""
    fut.add_done_callback(lambda _f: seen.append(rig.fabric.alive(name)))


async def test_a_read_ending_in_error_resets_the_agent_before_any_read_fails(rig: Rig) -> None:
    rig.fabric.script.extend([Xfer(polls=None), Xfer(polls=1, end="ERR")])
    alive: list[bool] = []
    other = rig.w.post_soon(rig.read(0, 0, 64))
    await until(lambda: len(rig.fabric.posted) == 1, "the first read posted")
    bad = rig.w.post_soon(rig.read(64, 64, 64))
    agent_gone_when_done(rig, other, "local", alive)
    agent_gone_when_done(rig, bad, "local", alive)
    with pytest.raises(NixlError, match="transfer state ERR") as info:
        await bad
    assert not isinstance(info.value, NixlKilledByReset) and info.value.remote == rig.name
    with pytest.raises(NixlKilledByReset, match="another read failed") as killed:
        await other
    assert killed.value.remote == rig.name
    await asyncio.sleep(0)  # the done callbacks run
    assert alive == [False, False]  # reported only once the old agent was gone
    await until(lambda: bool(rig.resets), "on_reset")
    reset = rig.resets[0]
    assert (reset.generation, reset.agent_name, reset.reads_failed) == (1, "local-g1", 2)
    assert (rig.w.generation, rig.w.agent_name, rig.w.resets) == (1, "local-g1", 1)
    assert reset.metadata == await rig.w.metadata()
    new = rig.fabric.agents["local-g1"]
    assert [d.rows for d in new.regs] == [[(rig.mem.addr, rig.mem.nbytes, 0)]]  # again
    # Links of generation 0 are gone: nothing is posted over them.
    posted = len(rig.fabric.posted)
    with pytest.raises(NixlAgentReset, match="link again"):
        await rig.w.read(rig.name, i64([rig.mem.addr]), i64([rig.peer_mem.addr]), i64([64]),
                         generation=0)
    with pytest.raises(NixlError, match="unknown remote agent"):
        await rig.w.read(rig.name, i64([rig.mem.addr]), i64([rig.peer_mem.addr]), i64([64]))
    assert len(rig.fabric.posted) == posted
    assert await rig.w.add_remote_at(rig.peer.get_agent_metadata()) == (rig.name, 1)
    stats = await rig.w.read(rig.name, i64([rig.mem.addr]), i64([rig.peer_mem.addr]), i64([64]),
                             generation=1)
    assert stats.bytes == 64


@pytest.mark.parametrize("script", [Xfer(polls=None), Xfer(raise_in="transfer"),
                                    Xfer(polls=1, raise_in="check_xfer_state")],
                         ids=["past-its-deadline", "transfer-raises", "check-raises"])
async def test_a_read_that_may_still_write_resets_the_agent(rig: Rig, script: Xfer) -> None:
    rig.fabric.script.append(script)
    with pytest.raises(NixlError) as info:
        await rig.w.read(rig.name, i64([rig.mem.addr]), i64([rig.peer_mem.addr]), i64([64]),
                         timeout_s=0.005)
    assert info.value.remote == rig.name
    assert isinstance(info.value, NixlTimeout) == (script.polls is None)
    assert not rig.fabric.alive("local") and rig.w.resets == 1


async def test_errors_that_post_nothing_fail_only_their_call(rig: Rig) -> None:
    with pytest.raises(NixlError, match="nixlNotFoundError") as info:
        await rig.w.read(rig.name, i64([rig.mem.addr]), i64([rig.peer_mem.addr + MiB - 10]),
                         i64([64]))
    assert info.value.remote == rig.name
    rig.fabric.raise_in["send_notif"] = 1
    with pytest.raises(NixlError, match="notify remote agent 'peer' failed: nixlBackendError"):
        await rig.w.notify(rig.name, b"x")
    with pytest.raises(NixlError, match="nobody"):
        await rig.w.notify("nobody", b"x")
    rig.fabric.raise_in["get_new_notifs"] = 1  # one round's progress fails: logged
    await rig.w.progressed()
    with pytest.raises(NixlError, match="unknown registration"):
        await rig.w.deregister(12345)
    with pytest.raises(NixlError, match="add remote agent failed"):
        await rig.w.add_remote(b"not nixl metadata")
    rig.fabric.raise_in["register_memory"] = 1
    with pytest.raises(NixlError, match="register 1 DRAM regions failed"):
        await rig.w.register([(rig.mem.addr, 64)])
    assert rig.w.resets == 0 and rig.fabric.alive("local")
    await rig.w.notify(rig.name, b"after-errors")
    assert rig.peer_notifs() == [b"after-errors"]


async def test_an_agent_that_cannot_be_created_again_is_retried_and_registrations_follow(
        rig: Rig) -> None:
    """The reads are reported at once (the old agent is gone); new work fails
    naming why, ``down_reason`` says it, a registration dropped meanwhile is
    forgotten, and the agent created at last registers only what is left."""
    drop = Buf(64 * KiB)
    reg_drop = await rig.w.register([(drop.addr, drop.nbytes)])
    rig.fabric.fail_creates = 10**6
    rig.fabric.script.append(Xfer(polls=1, end="ERR"))
    with pytest.raises(NixlError, match="transfer state ERR"):
        await rig.w.read(rig.name, i64([rig.mem.addr]), i64([rig.peer_mem.addr]), i64([64]))
    assert "No such device" in rig.w.down_reason and rig.w.running
    with pytest.raises(NixlError, match="agent is down since"):
        await rig.w.metadata()
    await rig.w.deregister(reg_drop)  # while down: forgotten, never registered again
    await until(lambda: rig.fabric.fail_creates < 10**6 - 2, "a few retries")
    assert not rig.resets
    rig.fabric.fail_creates = 0
    await until(lambda: bool(rig.resets), "the agent created again")
    assert rig.w.down_reason == ""
    gen = rig.w.generation
    assert gen >= 3 and rig.resets[0].agent_name == rig.w.agent_name == f"local-g{gen}"
    assert rig.resets[0].reads_failed == 1
    assert await rig.w.metadata() == rig.resets[0].metadata
    assert [d.rows for d in rig.fabric.agents[rig.w.agent_name].regs] == [
        [(rig.mem.addr, rig.mem.nbytes, 0)]]
    other = fake_peer(rig.fabric, "peer2", Buf(4 * KiB))
    assert await rig.w.add_remote_at(other.get_agent_metadata()) == ("peer2", gen)


async def test_start_failure_is_a_nixl_error() -> None:
    fabric = FakeFabric(fail_creates=1)
    w = NixlWorker("bad", WorkerOptions(backends=("NO_SUCH",), agent_factory=fabric.factory))
    with pytest.raises(NixlError, match=r"could not create NIXL agent 'bad' with backends "
                                        r"\['NO_SUCH'\]: RuntimeError"):
        await w.start()
    await w.stop()
    with pytest.raises(NixlError, match="stopped"):
        await w.metadata()


# -- shutdown --------------------------------------------------------------------------------------

async def test_stop_destroys_the_agent_before_reporting_reads_still_in_flight() -> None:
    r = await make_rig()
    r.fabric.script.extend([Xfer(polls=None), Xfer(polls=3)])
    alive: list[bool] = []
    stuck = r.w.post_soon(r.read(0, 0, 64))
    agent_gone_when_done(r, stuck, "local", alive)
    finishing = r.w.post_soon(r.read(64, 64, 64))
    await until(lambda: len(r.fabric.posted) == 2, "both posted")
    await r.w.stop()
    assert stuck.done() and finishing.done()
    with pytest.raises(NixlError, match="worker stopped before it finished"):
        stuck.result()
    assert finishing.result().bytes == 64  # finished within stop_timeout_s
    await asyncio.sleep(0)  # the done callback runs
    assert alive == [False]
    with pytest.raises(NixlError, match="stopped"):
        await r.w.read(r.name, i64([r.mem.addr]), i64([r.peer_mem.addr]), i64([64]))
    await r.w.stop()  # idempotent
    assert not r.w.running


@pytest.mark.parametrize("fails", [0, 1])
async def test_a_clean_stop_deregisters_and_counts_failures(fails: int) -> None:
    r = await make_rig()
    agent = r.fabric.agents["local"]
    r.fabric.raise_in["deregister_memory"] = fails
    await r.w.stop()
    assert (agent.deregistered, r.w.cleanup_failures) == (1 - fails, fails)


async def test_a_handle_nixl_cannot_release_is_kept_and_stop_skips_deregistering() -> None:
    r = await make_rig()
    agent = r.fabric.agents["local"]
    r.fabric.script.append(Xfer(raise_in="release_xfer_handle"))
    assert (await r.w.read(r.name, i64([r.mem.addr]), i64([r.peer_mem.addr]),
                           i64([64]))).bytes == 64
    assert len(r.w._reads.stuck_handles) == 1
    await r.w.stop()
    # Destroyed anyway (the captured log's traceback keeps the fake alive here).
    assert r.w._host.agent is None and not r.w._reads.stuck_handles
    assert agent.deregistered == 0


async def test_queued_jobs_fail_when_stopped_and_remove_refuses_a_busy_peer(rig: Rig) -> None:
    rig.fabric.script.append(Xfer(polls=None))
    fut = rig.w.post_soon(rig.read(0, 0, 64))
    await until(lambda: bool(rig.fabric.posted), "posted")
    with pytest.raises(NixlError, match="cannot remove remote agent 'peer': 1 reads in flight"):
        await rig.w.remove_remote(rig.name)
    await rig.w.stop()
    with pytest.raises(NixlError, match="stopped"):
        await fut
    with pytest.raises(NixlError, match="stopped"):
        rig.w.remove_remote_soon(rig.name)


# -- rounds and poll timing ------------------------------------------------------------------------

async def test_a_read_finished_early_in_a_round_is_delivered_before_the_round_ends(
        rig: Rig) -> None:
    """Jobs of one round run back to back; a read that ended (inside
    ``transfer()`` here) is handed to the loop between them after a job that
    took ``busy_s``, not after the round's last job: the second job blocks
    until the test saw the first read's result."""
    loop = asyncio.get_running_loop()
    seen = threading.Event()
    read_fut: asyncio.Future[Any] = loop.create_future()
    block_fut: asyncio.Future[Any] = loop.create_future()
    rig.fabric.default = Xfer(polls=0)
    what, fn = rig.w._read_job(rig.read(0, 0, 64 * KiB))
    slow = fn

    def read_slowly(fut: asyncio.Future[Any]) -> object:  # longer than busy_s
        out = slow(fut)
        threading.Event().wait(0.002)
        return out

    rig.w._jobs.put((Job(read_slowly, read_fut, what, rig.name),
                     Job(lambda _fut: seen.wait(10.0), block_fut, "block", None)))
    stats = await asyncio.wait_for(read_fut, 10)
    seen.set()
    assert await asyncio.wait_for(block_fut, 10) is True  # the read came out first
    assert stats.bytes == 64 * KiB


async def test_poll_waits_follow_holds_leases_notifications_and_posts() -> None:
    """Idle waits escalate to their cap; jobs, holds and leases wake the thread
    at once; a lease polls at the soon floor until a notification came, then at
    the hot floor; a read of ours still in flight polls soon, then busy."""
    hour = 3600.0
    poll = PollPolicy(busy_s=2e-4, idle_s=hour, idle_max_s=hour, hot_s=1e-3, hot_max_s=hour,
                      soon_s=1e-4, soon_window_s=hour)
    r = await make_rig(poll=poll)
    w = r.w
    try:
        await until(lambda: w.poll_wait_s == hour, "idle wait of an hour")
        await asyncio.wait_for(w.metadata(), 5)  # a job wakes it
        await until(lambda: w.poll_wait_s == hour, "idle again after a job")
        w.expect_reads(60.0, soon=False)
        await until(lambda: w.poll_wait_s == 1e-3, "hot polling for a reader")
        w.set_hot(False)
        await until(lambda: w.poll_wait_s == hour, "idle again after the window")
        w.set_hot(True)
        await until(lambda: w.poll_wait_s > 1.0, "hot wait escalated past 1 s")
        r.peer.add_remote_agent(await w.metadata())
        w.expect_reads(60.0)
        await until(lambda: w.poll_wait_s == 1e-4, "soon polling for a reader")
        r.peer.send_notif("local", b"read-done")
        await until(lambda: bool(r.notifs), "the reader's notification")
        assert w.poll_wait_s == 1e-3  # the soon window closed; the lease runs
        w.set_hot(False)
        await until(lambda: w.poll_wait_s == hour, "idle after the holds ended")
        r.fabric.script.append(Xfer(polls=None))
        r.w.post_soon(r.read(0, 0, 64))
        await until(lambda: w.poll_wait_s == 1e-4, "soon polling after our post")
    finally:
        await w.stop()
    r2 = await make_rig(poll=PollPolicy(busy_s=2e-4, soon_s=1e-4, soon_window_s=0.005))
    try:
        r2.fabric.script.extend([Xfer(polls=None)] * 3)
        for i in range(3):  # more than soon_max_reads in flight: no soon window
            r2.w.post_soon(r2.read(i * 64, 0, 64))
        await until(lambda: len(r2.fabric.posted) == 3, "three posted")
        await until(lambda: r2.w.poll_wait_s == 2e-4, "busy polling")
    finally:
        await r2.w.stop()
