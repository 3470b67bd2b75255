"""NixlWorker against real NIXL/UCX: a peer in another process, memory in memfds.

The peer process runs its own NixlWorker (the realistic case: two sidecars on
one node) and is driven over a socketpair with pickled commands. Both sides
map the same shared memory (a memfd of the test process, opened by the peer
through /proc), so the test can fill the peer's memory and check what a read
brought over without asking the peer.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import mmap
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from kvsidecar.daemon.transport.worker import (
    NixlError,
    NixlWorker,
    NotifyOp,
    PollPolicy,
    ReadOp,
    TransferStats,
    WorkerOptions,
    transport_note,
)

MiB = 1 << 20

_PEER_SRC = r"""
import asyncio, ctypes, json, mmap, os, sys, time
from multiprocessing.connection import Connection
from kvsidecar.daemon.transport.worker import NixlWorker, PollPolicy, WorkerOptions

def mapfile(path):
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return mm, ctypes.addressof(ctypes.c_char.from_buffer(mm))

async def main(fd, name, opts):
    conn = Connection(fd)
    loop = asyncio.get_running_loop()
    notifs = []
    got = asyncio.Event()
    def on_notif(agent, msg):
        notifs.append((agent, msg)); got.set()
    w = NixlWorker(name, WorkerOptions(poll=PollPolicy(**opts.get("poll", {})),
                                       progress_thread_ms=opts.get("progress_thread_ms", 0)),
                   on_notif=on_notif)
    await w.start()
    maps = []
    while True:
        cmd, *args = await loop.run_in_executor(None, conn.recv)
        try:
            if cmd == "exit":
                await w.stop(); conn.send(("ok", None)); return
            elif cmd == "register":  # (path) -> (metadata, addr, reg_id)
                mm, addr = mapfile(args[0]); maps.append(mm)
                reg = await w.register([(addr, len(mm))])
                res = (await w.metadata(), addr, reg)
            elif cmd == "deregister":
                res = await w.deregister(args[0])
            elif cmd == "metadata":
                res = await w.metadata()
            elif cmd == "add_remote":
                res = await w.add_remote(args[0])
            elif cmd == "notify":
                res = await w.notify(args[0], args[1])
            elif cmd == "read":
                res = await w.read(*args)
            elif cmd == "notifs":  # (want, timeout) -> everything received so far, then cleared
                want, timeout = args
                deadline = loop.time() + timeout
                while len(notifs) < want and loop.time() < deadline:
                    got.clear()
                    try:
                        await asyncio.wait_for(got.wait(), deadline - loop.time())
                    except asyncio.TimeoutError:
                        break
                res = list(notifs); notifs.clear()
            else:
                raise ValueError(cmd)
            conn.send(("ok", res))
        except Exception as exc:
            conn.send(("err", f"{type(exc).__name__}: {exc}"))

asyncio.run(main(int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])))
"""


class ShmBuf:
    """Shared memory mapped here; other processes map it by :attr:`path`.

    A memfd, not a file in /dev/shm: it has no name to leave behind, so a test
    process that dies without its teardown (killed, or aborted inside UCX)
    leaks nothing; the kernel frees it with the last fd and mapping. Others
    open it as ``/proc/<pid>/fd/<fd>`` while this object holds the fd.
    """

    def __init__(self, nbytes: int) -> None:
        self.fd = os.memfd_create(f"kvs-nixl-test-{uuid.uuid4().hex[:12]}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self.mm = mmap.mmap(self.fd, nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        self.nbytes = nbytes
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.view = np.frombuffer(self.mm, dtype=np.uint8)

    def close(self) -> None:
        del self.view
        try:
            self.mm.close()
        finally:
            os.close(self.fd)


class Peer:
    """A NixlWorker in a child process, driven synchronously over a socketpair."""

    def __init__(self, name: str, options: dict[str, Any] | None = None) -> None:
        """``options``: the worker's ``progress_thread_ms`` and ``poll``
        (PollPolicy's fields), JSON-able."""
        self.name = name
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PEER_SRC, str(theirs.fileno()), name,
             json.dumps(options or {})],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.lock = threading.Lock()

    def call_sync(self, *cmd: Any, timeout: float = 30.0) -> Any:
        with self.lock:
            self.conn.send(cmd)
            if not self.conn.poll(timeout):
                raise TimeoutError(f"peer did not answer {cmd[0]!r} in {timeout} s")
            status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer {cmd[0]!r} failed: {value}")
        return value

    async def call(self, *cmd: Any, timeout: float = 30.0) -> Any:
        return await asyncio.to_thread(self.call_sync, *cmd, timeout=timeout)

    def close(self) -> None:
        try:
            self.call_sync("exit", timeout=15.0)
            self.proc.wait(timeout=15.0)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


_KILLED_HOLDING_SHMBUF = r"""
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("tw", sys.argv[1])
tw = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tw)
buf = tw.ShmBuf(1 << 20)
buf.view[:] = 1
print(os.getpid(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no teardown, no atexit: as a UCX abort or a kill
"""


def test_a_test_process_killed_holding_shared_memory_leaves_nothing_in_dev_shm() -> None:
    """Runs of this module killed or aborted mid-test (no fixture teardown) left
    their buffers in /dev/shm (1 MiB each, two per run): the buffers must have
    no name there."""
    proc = subprocess.run([sys.executable, "-c", _KILLED_HOLDING_SHMBUF, __file__],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    pid = int(proc.stdout)
    if os.path.isdir("/dev/shm"):
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"kvs-nixl-test-{pid}-")]


@pytest.fixture(scope="module")
def peer_mem() -> Iterator[ShmBuf]:
    buf = ShmBuf(MiB)
    buf.view[:] = np.random.default_rng(1).integers(0, 256, MiB, dtype=np.uint8)
    yield buf
    buf.close()


@pytest.fixture(scope="module")
def peer(peer_mem: ShmBuf) -> Iterator[tuple[Peer, bytes, int]]:
    """(peer, its metadata, address of peer_mem in the peer's address space)."""
    p = Peer(f"peer-{uuid.uuid4().hex[:8]}")
    try:
        md, addr, _ = p.call_sync("register", peer_mem.path, timeout=60.0)
        yield p, md, addr
    finally:
        p.close()


class Local:
    def __init__(self) -> None:
        self.notifs: list[tuple[str, bytes]] = []
        self.notif_threads: set[int] = set()
        self.got = asyncio.Event()

    def on_notif(self, agent: str, msg: bytes) -> None:
        self.notif_threads.add(threading.get_ident())
        self.notifs.append((agent, msg))
        self.got.set()

    async def wait_notifs(self, want: int, timeout: float = 10.0) -> list[tuple[str, bytes]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.notifs) < want:
            self.got.clear()
            await asyncio.wait_for(self.got.wait(), max(0.0, deadline - loop.time()))
        return self.notifs


@pytest.fixture
async def local() -> AsyncIterator[tuple[NixlWorker, Local, ShmBuf, int]]:
    state = Local()
    mem = ShmBuf(MiB)
    w = NixlWorker(f"local-{uuid.uuid4().hex[:8]}", on_notif=state.on_notif)
    await w.start()
    reg = await w.register([(mem.addr, mem.nbytes)])
    try:
        yield w, state, mem, reg
    finally:
        await w.stop()
        mem.close()


def i64(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


# -- tests ----------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_scattered_read_from_peer_process(local: Any, peer: Any, peer_mem: ShmBuf) -> None:
    w, _, mem, _ = local
    p, md, paddr = peer
    name = await w.add_remote(md)
    assert name == p.name

    rng = np.random.default_rng(7)
    n = 48
    # Non-overlapping 16 KiB slots on both sides, shuffled so no two neighbours stay neighbours.
    src_slots = rng.permutation(MiB // 16384)[:n]
    dst_slots = rng.permutation(MiB // 16384)[:n]
    lens = rng.integers(1, 16384, n)
    src_off = src_slots * 16384 + rng.integers(0, 16384 - lens + 1)
    dst_off = dst_slots * 16384
    stats = await w.read(name, i64(mem.addr + dst_off), i64(paddr + src_off), i64(lens),
                         notif=b"read-1")
    assert isinstance(stats, TransferStats)
    assert stats.bytes == int(lens.sum())
    assert stats.descriptors == n
    assert stats.xfer_us >= 0 and stats.post_us >= 0

    expected = np.zeros(MiB, dtype=np.uint8)
    for s, d, ln in zip(src_off, dst_off, lens):
        expected[d : d + ln] = peer_mem.view[s : s + ln]
    assert np.array_equal(mem.view, expected)

    got = await p.call("notifs", 1, 10.0)
    assert got == [(w.agent_name, b"read-1")]


@pytest.mark.timeout(120)
async def test_zero_length_read_still_notifies(local: Any, peer: Any) -> None:
    w, _, _, _ = local
    p, md, _ = peer
    name = await w.add_remote(md)
    empty = i64([])
    stats = await w.read(name, empty, empty, empty, notif=b"nothing-to-read")
    assert stats == TransferStats(0, 0, 0.0, 0.0)
    assert await w.read(name, empty, empty, empty) == TransferStats(0, 0, 0.0, 0.0)
    await w.notify(name, b"marker")  # sent after both reads: all that arrives must come first
    got = await p.call("notifs", 2, 10.0)
    assert got == [(w.agent_name, b"nothing-to-read"), (w.agent_name, b"marker")]


@pytest.mark.timeout(120)
async def test_notifications_both_ways(local: Any, peer: Any) -> None:
    w, state, _, _ = local
    p, md, _ = peer
    name = await w.add_remote(md)
    await w.notify(name, b"ping")
    assert await p.call("notifs", 1, 10.0) == [(w.agent_name, b"ping")]

    # The other way needs our metadata at the peer; we are idle, and must still progress.
    assert await p.call("add_remote", await w.metadata()) == w.agent_name
    w.set_hot(True)
    await p.call("notify", w.agent_name, b"pong-hot")
    await state.wait_notifs(1)
    w.set_hot(False)
    await p.call("notify", w.agent_name, b"pong-idle")
    got = await state.wait_notifs(2)
    assert got == [(name, b"pong-hot"), (name, b"pong-idle")]
    assert state.notif_threads == {threading.get_ident()}  # delivered on the loop thread


@pytest.mark.timeout(120)
async def test_peer_reads_from_us_and_we_get_its_notification(local: Any, peer: Any) -> None:
    w, state, mem, _ = local
    p, md, _ = peer
    await w.add_remote(md)
    mem.view[:4096] = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096]
    mem.view[8192:12288] = 0xAB
    # We are idle (no reads, not hot): the peer's wire-up must still get progressed.
    assert await p.call("add_remote", await w.metadata()) == w.agent_name
    scratch = ShmBuf(8192)
    try:
        _, saddr, sreg = await p.call("register", scratch.path)
        stats = await p.call("read", w.agent_name, i64([saddr, saddr + 4096]),
                             i64([mem.addr, mem.addr + 8192]), i64([4096, 4096]), b"peer-read")
        assert stats.bytes == 8192
        assert await state.wait_notifs(1) == [(p.name, b"peer-read")]
        assert scratch.view[:4096].tobytes() == mem.view[:4096].tobytes()
        assert (scratch.view[4096:] == 0xAB).all()
        await p.call("deregister", sreg)
    finally:
        scratch.close()


@pytest.mark.timeout(120)
async def test_errors_fail_the_call_not_the_worker(local: Any, peer: Any) -> None:
    w, _, mem, _ = local
    p, md, paddr = peer
    name = await w.add_remote(md)
    one = i64([4096])

    with pytest.raises(NixlError, match="nobody"):
        await w.read("nobody", i64([mem.addr]), i64([paddr]), one)
    with pytest.raises(NixlError, match="nobody"):
        await w.notify("nobody", b"x")
    # Past the end of the peer's registered region.
    with pytest.raises(NixlError, match=name) as info:
        await w.read(name, i64([mem.addr]), i64([paddr + MiB - 100]), one)
    assert info.value.remote == name
    # Local side not registered.
    scratch = ShmBuf(4096)
    try:
        with pytest.raises(NixlError, match=name):
            await w.read(name, i64([scratch.addr]), i64([paddr]), one)
    finally:
        scratch.close()
    with pytest.raises(ValueError):
        await w.read(name, i64([mem.addr, mem.addr]), i64([paddr]), one)
    with pytest.raises(NixlError):
        await w.deregister(12345)
    with pytest.raises(NixlError):
        await w.add_remote(b"not nixl metadata")

    # Still alive and correct.
    stats = await w.read(name, i64([mem.addr]), i64([paddr]), one, notif=b"after-errors")
    assert stats.bytes == 4096
    assert await p.call("notifs", 1, 10.0) == [(w.agent_name, b"after-errors")]


@pytest.mark.timeout(120)
async def test_posts_of_one_loop_iteration_go_as_one_job_and_fail_alone(
        local: Any, peer: Any, peer_mem: ShmBuf) -> None:
    """Reads and notifications posted with post_soon in one loop iteration reach
    the thread as one queue entry; each is still its own transfer with its own
    notification, and the bad ones (a range NIXL rejects, an unknown agent, bad
    arguments) fail only their own futures."""
    w, _, mem, _ = local
    p, md, paddr = peer
    name = await w.add_remote(md)
    mem.view[:] = 0
    rng = np.random.default_rng(11)
    good = []
    ops: list[ReadOp | NotifyOp] = []
    for i in range(6):  # 4 KiB from scattered peer offsets into consecutive slots of ours
        src = int(rng.integers(0, MiB // 4096)) * 4096
        good.append((i, src))
        ops.append(ReadOp(name, i64([mem.addr + i * 4096]), i64([paddr + src]), i64([4096]),
                          notif=f"g{i}".encode()))
    ops.insert(2, ReadOp(name, i64([mem.addr]), i64([paddr + MiB - 100]), i64([4096]),
                         notif=b"past-the-end"))
    ops.insert(4, ReadOp("nobody", i64([mem.addr]), i64([paddr]), i64([4096]), notif=b"who"))
    ops.insert(5, ReadOp(name, i64([mem.addr, mem.addr]), i64([paddr]), i64([4096])))
    ops.append(NotifyOp(name, b"bare"))
    puts = []
    real_put = w._jobs.put
    w._jobs.put = lambda entry: (puts.append(entry), real_put(entry))  # type: ignore[method-assign]
    try:
        futs = [w.post_soon(op) for op in ops]
        results = await asyncio.gather(*futs, return_exceptions=True)
    finally:
        del w._jobs.put
    assert len(puts) == 1 and len(puts[0]) == len(ops) - 1  # the bad-shape one never left
    assert isinstance(results[2], NixlError) and results[2].remote == name
    assert isinstance(results[4], NixlError) and "nobody" in str(results[4])
    assert isinstance(results[5], ValueError)
    assert results[-1] is None
    stats = [r for i, r in enumerate(results) if i not in (2, 4, 5) and i != len(ops) - 1]
    assert all(isinstance(r, TransferStats) and r.bytes == 4096 for r in stats)
    for i, src in good:
        assert np.array_equal(mem.view[i * 4096:(i + 1) * 4096],
                              peer_mem.view[src:src + 4096]), i
    got = await p.call("notifs", 7, 10.0)
    assert sorted(m for _, m in got) == sorted([f"g{i}".encode() for i in range(6)] + [b"bare"])
    # Still serving, one read at a time too.
    assert (await w.read(name, i64([mem.addr]), i64([paddr]), i64([64]))).bytes == 64


@pytest.mark.timeout(120)
async def test_add_remote_is_idempotent_and_replaces_changed_metadata(local: Any) -> None:
    w, _, mem, _ = local
    p = Peer(f"peer-{uuid.uuid4().hex[:8]}")
    first, second = ShmBuf(65536), ShmBuf(65536)
    try:
        first.view[:] = 1
        second.view[:] = 2
        md1, addr1, reg1 = await p.call("register", first.path, timeout=60.0)
        name = await w.add_remote(md1)
        assert await w.add_remote(md1) == name
        await w.read(name, i64([mem.addr]), i64([addr1]), i64([65536]))
        assert (mem.view[:65536] == 1).all()

        # The peer swaps its region (same agent name, new metadata).
        _, addr2, _ = await p.call("register", second.path)
        await p.call("deregister", reg1)
        md2 = await p.call("metadata")
        assert md2 != md1
        assert await w.add_remote(md2) == name
        await w.read(name, i64([mem.addr]), i64([addr2]), i64([65536]))
        assert (mem.view[:65536] == 2).all()
        # The old region is gone from our view of the peer, not merged with the new one.
        with pytest.raises(NixlError, match=name):
            await w.read(name, i64([mem.addr]), i64([addr1]), i64([65536]))

        await w.remove_remote(name)
        with pytest.raises(NixlError, match=name):
            await w.read(name, i64([mem.addr]), i64([addr2]), i64([16]))
        assert await w.add_remote(md2) == name
        await w.read(name, i64([mem.addr]), i64([addr2]), i64([16]))
    finally:
        p.close()
        first.close()
        second.close()


@pytest.mark.timeout(120)
async def test_dead_peer_fails_reads_and_a_restarted_peer_is_readable(local: Any) -> None:
    w, _, mem, _ = local
    name = f"peer-{uuid.uuid4().hex[:8]}"
    region = ShmBuf(65536)
    region.view[:] = 5
    p = Peer(name)
    try:
        md, addr, _ = await p.call("register", region.path, timeout=60.0)
        assert await w.add_remote(md) == name
        await w.read(name, i64([mem.addr]), i64([addr]), i64([4096]), notif=b"hello")
        p.proc.kill()
        p.proc.wait()
        p.conn.close()
        with pytest.raises(NixlError, match=name) as info:
            await asyncio.wait_for(
                w.read(name, i64([mem.addr]), i64([addr]), i64([4096]), notif=b"gone"), 30
            )
        assert info.value.remote == name

        # Same agent name, new process, new metadata: add_remote replaces the dead entry.
        region.view[:] = 6
        p = Peer(name)
        md2, addr2, _ = await p.call("register", region.path, timeout=60.0)
        assert await w.add_remote(md2) == name
        await w.read(name, i64([mem.addr]), i64([addr2]), i64([4096]), notif=b"back")
        assert (mem.view[:4096] == 6).all()
        assert await p.call("notifs", 1, 10.0) == [(w.agent_name, b"back")]
    finally:
        if p.proc.poll() is None:
            p.close()
        region.close()


@pytest.mark.timeout(120)
async def test_two_workers_in_one_process_and_stop_semantics() -> None:
    """Two agents, two threads, one process; then stop() with reads queued."""
    a_mem, b_mem = ShmBuf(4 * MiB), ShmBuf(4 * MiB)
    b_mem.view[:] = np.random.default_rng(3).integers(0, 256, 4 * MiB, dtype=np.uint8)
    got: list[tuple[str, bytes]] = []
    a = NixlWorker(f"a-{uuid.uuid4().hex[:6]}")
    b = NixlWorker(f"b-{uuid.uuid4().hex[:6]}", on_notif=lambda ag, m: got.append((ag, m)))
    await asyncio.gather(a.start(), b.start())
    try:
        await a.register([(a_mem.addr, a_mem.nbytes)])
        await b.register([(b_mem.addr, b_mem.nbytes)])
        bname = await a.add_remote(await b.metadata())
        stats = await a.read(bname, i64([a_mem.addr]), i64([b_mem.addr]), i64([4 * MiB]),
                             notif=b"in-process")
        assert stats.bytes == 4 * MiB
        assert np.array_equal(a_mem.view, b_mem.view)
        for _ in range(1000):
            if got:
                break
            await asyncio.sleep(0.01)
        assert got == [(a.agent_name, b"in-process")]

        # Many reads queued, then stop: each either completes or fails with "worker stopped".
        chunk = 64 * 1024
        offs = np.arange(0, 4 * MiB, chunk)
        reads = [
            asyncio.ensure_future(
                a.read(bname, i64([a_mem.addr + o]), i64([b_mem.addr + o]), i64([chunk]))
            )
            for o in offs
        ]
        await asyncio.sleep(0)  # let the first submissions reach the worker
        await a.stop()
        results = await asyncio.gather(*reads, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                assert isinstance(r, NixlError) and "worker stopped" in str(r), r
            else:
                assert r.bytes == chunk
        with pytest.raises(NixlError, match="stopped"):
            await a.read(bname, i64([a_mem.addr]), i64([b_mem.addr]), i64([16]))
        await a.stop()  # idempotent
    finally:
        await a.stop()
        await b.stop()
        a_mem.close()
        b_mem.close()


async def until(cond: Any, what: str, timeout: float = 60.0) -> None:
    """Wait (generously) for a state the worker thread reaches on its own."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"never reached: {what}")
        await asyncio.sleep(0.005)


@pytest.mark.timeout(120)
async def test_a_sleeping_worker_wakes_for_jobs_holds_and_expected_reads() -> None:
    """A worker whose idle wait is an hour: every job must wake it (else the test
    times out), and so must a reader expected without a soon window;
    holds make it escalate from the hot floor, ``expect_reads``
    polls at the soon floor until the reader's notification came (its READ
    completes only as we progress), then pins it to the hot floor while the
    lease runs, and the notification of that read is delivered;
    ``set_hot(False)`` ends it."""
    hour = 3600.0
    t_mem, r_mem = ShmBuf(MiB), ShmBuf(MiB)
    t_mem.view[:] = np.random.default_rng(5).integers(0, 256, MiB, dtype=np.uint8)
    got: list[tuple[str, bytes]] = []
    poll = PollPolicy(idle_s=hour, idle_max_s=hour, hot_s=0.001, hot_max_s=hour, soon_s=0.0001,
                      soon_window_s=hour)
    target = NixlWorker(f"sleepy-{uuid.uuid4().hex[:6]}", WorkerOptions(poll=poll),
                        on_notif=lambda ag, m: got.append((ag, m)))
    reader = NixlWorker(f"reader-{uuid.uuid4().hex[:6]}")
    await asyncio.gather(target.start(), reader.start())
    try:
        await until(lambda: target.poll_wait_s == hour, "idle wait of an hour")
        await asyncio.wait_for(target.register([(t_mem.addr, t_mem.nbytes)]), 60)
        await until(lambda: target.poll_wait_s == hour, "idle again after a job")
        # A claim among many holds (no soon window): the hot floor at once, not
        # after the hour's wait (the reader's READ ends only as we progress).
        target.expect_reads(60.0, soon=False)
        await until(lambda: target.poll_wait_s == 0.001, "hot polling for a reader")
        target.set_hot(False)  # ends the window
        await until(lambda: target.poll_wait_s == hour, "idle again after the window")
        md = await asyncio.wait_for(target.metadata(), 60)
        await reader.register([(r_mem.addr, r_mem.nbytes)])
        tname = await reader.add_remote(md)

        target.set_hot(True)  # blocks held: from the hot floor, doubling
        await until(lambda: target.poll_wait_s > 1.0, "hot wait escalated past 1 s")
        target.expect_reads(60.0)  # a reader claimed a lease: tightest at once
        await until(lambda: target.poll_wait_s == 0.0001, "soon polling for a reader")
        offs = np.arange(0, MiB, 65536)
        await asyncio.wait_for(reader.read(tname, i64(r_mem.addr + offs), i64(t_mem.addr + offs),
                                           i64([4096] * len(offs)), notif=b"under-lease"), 60)
        for o in offs:
            assert r_mem.view[o:o + 4096].tobytes() == t_mem.view[o:o + 4096].tobytes()
        await until(lambda: bool(got), "the reader's notification")
        assert got == [(reader.agent_name, b"under-lease")]
        # notified: the soon window (an hour here) closed; still inside the lease
        assert target.poll_wait_s == 0.001

        target.set_hot(False)  # nothing held any more: the window ends, deep sleep again
        await until(lambda: target.poll_wait_s == hour, "idle wait after the holds ended")
        await asyncio.wait_for(target.metadata(), 60)  # and a job still wakes it
    finally:
        await reader.stop()
        await target.stop()
        t_mem.close()
        r_mem.close()


@pytest.mark.timeout(120)
def test_under_uvloop() -> None:
    """The daemon runs on uvloop: results and notifications cross via its call_soon_threadsafe."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        a_mem, b_mem = ShmBuf(65536), ShmBuf(65536)
        b_mem.view[:] = 9
        got: list[tuple[str, bytes]] = []
        arrived = asyncio.Event()

        def on_notif(agent: str, msg: bytes) -> None:
            got.append((agent, msg))
            arrived.set()

        a = NixlWorker(f"uva-{uuid.uuid4().hex[:6]}")
        b = NixlWorker(f"uvb-{uuid.uuid4().hex[:6]}", on_notif=on_notif)
        await a.start()
        await b.start()
        try:
            await a.register([(a_mem.addr, a_mem.nbytes)])
            await b.register([(b_mem.addr, b_mem.nbytes)])
            bname = await a.add_remote(await b.metadata())
            stats = await a.read(bname, i64([a_mem.addr]), i64([b_mem.addr]), i64([65536]),
                                 notif=b"uv")
            assert stats.bytes == 65536 and (a_mem.view == 9).all()
            await asyncio.wait_for(arrived.wait(), 10)
            assert got == [(a.agent_name, b"uv")]
        finally:
            await a.stop()
            await b.stop()
            a_mem.close()
            b_mem.close()

    uvloop.run(scenario())


@pytest.mark.timeout(60)
async def test_start_failure_is_a_nixl_error() -> None:
    w = NixlWorker(f"bad-{uuid.uuid4().hex[:6]}", WorkerOptions(backends=("NO_SUCH_BACKEND",)))
    with pytest.raises(NixlError, match="NO_SUCH_BACKEND"):
        await w.start()
    await w.stop()
    with pytest.raises(NixlError, match="stopped"):
        await w.metadata()


async def test_transport_note_names_ucx_tls() -> None:
    note = transport_note()
    assert "UCX_TLS" in note
    assert "cma" in note or "tcp" in note


@pytest.mark.timeout(120)
async def test_reads_to_one_agent_that_may_merge_go_as_one_transfer_and_fail_together(
        peer: Any, peer_mem: ShmBuf) -> None:
    """With ``merge`` (the peer accepts batched notifications) the reads of one
    flush to one agent are ONE transfer carrying one joined notification, and
    notifications likewise; each read gets its own stats (its bytes, the shared
    times, how many reads the transfer carried). A failure of that transfer
    fails every read in it; reads that may not merge stay apart."""
    from kvsidecar.daemon import notifications

    mem = ShmBuf(MiB)
    w = NixlWorker(f"merge-{uuid.uuid4().hex[:8]}", WorkerOptions(join_notifs=notifications.join))
    await w.start()
    try:
        await w.register([(mem.addr, mem.nbytes)])
        p, md, paddr = peer
        name = await w.add_remote(md)
        await p.call("notifs", 0, 0.5)  # forget what earlier tests left
        notes = [notifications.encode("P", f"m{i}", "D", 0, 1) for i in range(6)]
        ops: list[ReadOp | NotifyOp] = [
            ReadOp(name, i64([mem.addr + i * 4096]), i64([paddr + 8192 * i]), i64([4096]),
                   notif=notes[i], merge=8) for i in range(5)]
        ops.append(ReadOp(name, i64([mem.addr + 5 * 4096]), i64([paddr]), i64([4096]),
                          notif=notes[5]))  # merge=0: its own transfer
        ops += [NotifyOp(name, notes[0], merge=8), NotifyOp(name, notes[1], merge=8)]
        results = await asyncio.gather(*(w.post_soon(op) for op in ops))
        stats = [r for r in results if isinstance(r, TransferStats)]
        assert [(s.bytes, s.reads, s.first) for s in stats] == [
            (4096, 5, True), *[(4096, 5, False)] * 4, (4096, 1, True)]
        assert results[6:] == [None, None]
        for i in range(5):
            assert np.array_equal(mem.view[i * 4096:(i + 1) * 4096],
                                  peer_mem.view[8192 * i:8192 * i + 4096]), i
        got = sorted(m for _, m in await p.call("notifs", 3, 10.0))
        assert got == sorted([notifications.join(notes[:5]), notes[5],
                              notifications.join(notes[:2])])
        # A read over merge_max_read_bytes goes alone; the small ones around it merge.
        w._posts.merge_max_read_bytes = 4096
        sizes = [4096, 8192, 4096, 4096]
        ops = [ReadOp(name, i64([mem.addr + 8192 * i]), i64([paddr + 8192 * i]), i64([n]),
                      notif=notes[i], merge=8) for i, n in enumerate(sizes)]
        capped = await asyncio.gather(*(w.post_soon(op) for op in ops))
        assert [(r.bytes, r.reads, r.first) for r in capped if r is not None] == [
            (4096, 3, True), (8192, 1, True), (4096, 3, False), (4096, 3, False)]
        for i, n in enumerate(sizes):
            assert np.array_equal(mem.view[8192 * i:8192 * i + n],
                                  peer_mem.view[8192 * i:8192 * i + n]), i
        await p.call("notifs", 2, 10.0)
        w._posts.merge_max_read_bytes = 2 << 20
        # One bad range fails the transfer, so every read merged with it.
        bad = [ReadOp(name, i64([mem.addr]), i64([paddr]), i64([4096]), merge=8),
               ReadOp(name, i64([mem.addr]), i64([paddr + MiB - 100]), i64([4096]), merge=8)]
        failed = await asyncio.gather(*(w.post_soon(op) for op in bad), return_exceptions=True)
        assert all(isinstance(r, NixlError) for r in failed), failed
        assert failed[0] is failed[1]
        # Still serving.
        assert (await w.read(name, i64([mem.addr]), i64([paddr]), i64([64]))).bytes == 64
    finally:
        await w.stop()
        mem.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("progress_thread_ms", [0, 10], ids=["worker-polls", "progress-thread"])
async def test_a_peers_read_needs_the_targets_poll_unless_nixl_progresses_on_its_own(
        peer_mem: ShmBuf, progress_thread_ms: int) -> None:
    """A target in another process whose worker sleeps for an hour between jobs:
    without NIXL's progress thread a READ of its memory (with a notification)
    ends only once the target's worker goes round again (here: a job); with
    ``progress_thread_ms`` the thread answers it while the worker sleeps.
    Either way the bytes are the target's, and its notification arrives."""
    hour = 3600.0
    asleep = {"idle_s": hour, "idle_max_s": hour, "hot_s": hour, "hot_max_s": hour,
              "busy_s": hour}
    peer = Peer(f"asleep-{uuid.uuid4().hex[:6]}",
                {"poll": asleep, "progress_thread_ms": progress_thread_ms})
    mem = ShmBuf(MiB)
    reader = NixlWorker(f"reader-{uuid.uuid4().hex[:6]}")
    await reader.start()
    try:
        await reader.register([(mem.addr, mem.nbytes)])
        md, taddr, _ = await peer.call("register", peer_mem.path)
        tname = await reader.add_remote(md)
        await peer.call("add_remote", await reader.metadata())

        async def read(offsets: np.ndarray, notif: bytes) -> asyncio.Future[Any]:
            return asyncio.ensure_future(reader.read(
                tname, i64(mem.addr + offsets), i64(taddr + offsets),
                i64([4096] * len(offsets)), notif=notif))

        # The first READ wires the endpoints up: the peer's jobs make it go round.
        first = await read(np.array([0]), b"wire-up")
        while not first.done():
            await peer.call("metadata")
        await first
        assert await taken_notifs(peer) == [(reader.agent_name, b"wire-up")]

        offs = np.arange(65536, MiB, 65536)
        late = await read(offs, b"while-asleep")
        if progress_thread_ms:
            await asyncio.wait_for(late, 60)
        else:
            done, _ = await asyncio.wait([late], timeout=1.0)
            assert not done, "the READ ended although its target never progressed"
            await peer.call("metadata")  # a job: the target's worker goes round once
            await asyncio.wait_for(late, 60)
        for o in offs:
            assert mem.view[o:o + 4096].tobytes() == peer_mem.view[o:o + 4096].tobytes()
        assert await taken_notifs(peer) == [(reader.agent_name, b"while-asleep")]
    finally:
        await reader.stop()
        peer.close()
        mem.close()


async def taken_notifs(peer: Peer) -> list[tuple[str, bytes]]:
    """The notifications a sleeping peer's worker takes as jobs make it go round."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while loop.time() < deadline:
        await peer.call("metadata")
        got = await peer.call("notifs", 1, 0.2)
        if got:
            return [(a, bytes(m)) for a, m in got]
    raise AssertionError("the peer took no notification in 30 s")


@pytest.mark.parametrize(("thread_ms", "want"), [(0, 0.0001), (10, 0.001)],
                         ids=["worker-polls", "progress-thread"])
async def test_with_nixls_progress_thread_a_lease_opens_no_soon_window(
        thread_ms: int, want: float) -> None:
    """A lease granted opens the soon window only for a worker that progresses
    NIXL itself: with the progress thread it polls at the hot floor, for
    notifications."""
    hour = 3600.0
    poll = PollPolicy(idle_s=hour, idle_max_s=hour, hot_s=0.001, hot_max_s=hour,
                      soon_s=0.0001, soon_window_s=hour)
    w = NixlWorker(f"lease-{uuid.uuid4().hex[:6]}",
                   WorkerOptions(poll=poll, progress_thread_ms=thread_ms))
    await w.start()
    try:
        await until(lambda: w.poll_wait_s == hour, "idle wait of an hour")
        w.expect_reads(60.0)
        await until(lambda: w.poll_wait_s == want, f"polling every {want} s")
    finally:
        await w.stop()


@pytest.mark.timeout(180)
async def test_with_progress_threads_a_dead_peer_fails_reads_and_a_new_one_is_readable() -> None:
    """Both sides with NIXL's progress thread: a read from a killed peer fails
    (the reader's agent is reset: drained and destroyed while its thread runs,
    without UCX aborting the process), and the same name in a new process is
    read again, its notification delivered."""
    mem, region = ShmBuf(65536), ShmBuf(65536)
    region.view[:] = 5
    w = NixlWorker(f"reader-{uuid.uuid4().hex[:6]}", WorkerOptions(progress_thread_ms=10))
    name = f"peer-{uuid.uuid4().hex[:8]}"
    p = Peer(name, {"progress_thread_ms": 10})
    await w.start()
    try:
        await w.register([(mem.addr, mem.nbytes)])
        md, addr, _ = await p.call("register", region.path, timeout=60.0)
        assert await w.add_remote(md) == name
        await w.read(name, i64([mem.addr]), i64([addr]), i64([4096]), notif=b"hello")
        assert (mem.view[:4096] == 5).all()
        p.proc.kill()
        p.proc.wait()
        p.conn.close()
        with pytest.raises(NixlError, match=name):
            await asyncio.wait_for(
                w.read(name, i64([mem.addr]), i64([addr]), i64([4096]), notif=b"gone"), 30)

        region.view[:] = 6
        p = Peer(name, {"progress_thread_ms": 10})
        md2, addr2, _ = await p.call("register", region.path, timeout=60.0)
        assert await w.add_remote(md2) == name
        await p.call("add_remote", await w.metadata())
        await w.read(name, i64([mem.addr]), i64([addr2]), i64([4096]), notif=b"back")
        assert (mem.view[:4096] == 6).all()
        assert await taken_notifs(p) == [(w.agent_name, b"back")]
    finally:
        await w.stop()
        if p.proc.poll() is None:
            p.close()
        mem.close()
        region.close()
