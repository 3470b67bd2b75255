"""Byte verification's I/O shell: hashing threads, and D's check of one read.

D's side of one verified read (:func:`ask` at post time, :func:`check` once
every transfer ended DONE, its claim granted and staged bytes scattered,
before any notification)::

    post ─▶ ask each P rank (peer channel, Digest: the plan's pieces of that rank)
              │                    P checks the pieces lie in pages its hold pins,
              │                    hashes them on a thread while the bytes travel
    transfers DONE ─▶ hash what landed (D's pieces, same order) ─▶ compare
              ─▶ equal: notify P, ``received``  |  differ: ``failed``, abandon P

Why P may hash while the bytes travel: its hold pins the blocks until D
notifies (or abandons), and D notifies only after the comparison, so P's bytes
are the same before, during and after the transfer. Why D names pieces
rather than P recomputing the plan: P does not know D's layout, and the pieces
are exactly what D read; P refuses pieces outside the hold's pages, so a
digest tells a reader nothing it could not read anyway.

Hashing threads (:class:`Hashing`) are made on first use: a sidecar that
verifies nothing has none. Memory is never released under a hash: an
engine's drop waits for its hashing (:meth:`Hashing.drain`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from kvsidecar.daemon import digest
from kvsidecar.daemon.peers.client import ControlAnswer, HandshakeClient
from kvsidecar.daemon.peers.control import Digest
from kvsidecar.daemon.planner import ReadPlan
from kvsidecar.daemon.thread_names import name_this_thread

I64 = digest.I64
T = TypeVar("T")

#: Threads that hash (per sidecar): a large read hashes its chunks on both.
HASH_THREADS = 2
#: Digest requests P hashes (or queues to) at once, per sidecar; more are refused
#: for now (counted) and asked again. One read's pieces travel in requests of
#: at most 2,048 (a hybrid 1->2 read of 32 blocks has 133,664: 66 requests); each
#: open one keeps up to 48 KiB of pieces.
MAX_DIGESTS_IN_FLIGHT = 512
#: Bytes P hashes (or queues to) at once, per sidecar (one request whatever its
#: size): about half a second of two threads' hashing, well inside a reader's
#: wait for the answer (its handshake timeout).
MAX_DIGEST_BYTES_IN_FLIGHT = 2 << 30
#: How long D asks again while P refuses for now (``retry``: the hold is not
#: placed yet, as when the claim came before the engine's hold in asynchronous
#: scheduling, milliseconds apart; or P is hashing all it will), from the
#: moment D compares; P itself never waits.
DIGEST_RETRY_S = 2.0


class Hashing:
    """The hashing threads of one sidecar and what each engine has in flight."""

    def __init__(self, threads: int = HASH_THREADS) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._busy: dict[str, set[asyncio.Future[Any]]] = {}

    def run(self, engine_id: str, digester: digest.Digester,
            views: Sequence[NDArray[np.uint8]], region: I64, offset: I64, length: I64,
            chunk_bytes: int, threads: int | None = None) -> asyncio.Future[bytes]:
        """The digest of the pieces, hashed on up to ``threads`` (default: all) of
        the threads side by side (runs of whole chunks); tracked until done so
        memory outlives it."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvs-hash",
                                            initializer=name_this_thread,
                                            initargs=("kvs-hash",))
        loop = asyncio.get_running_loop()
        parts = digest.split_stream(region, offset, length, chunk_bytes,
                                    min(threads or self.threads, self.threads))
        futs = [loop.run_in_executor(self._pool, digester.digest, views, *p, chunk_bytes)
                for p in parts]
        whole: asyncio.Future[bytes] = asyncio.ensure_future(_joined(futs))
        busy = self._busy.setdefault(engine_id, set())
        busy.add(whole)
        whole.add_done_callback(functools.partial(self._done, engine_id))
        return whole

    def _done(self, engine_id: str, fut: asyncio.Future[Any]) -> None:
        busy = self._busy.get(engine_id)
        if busy is not None:
            busy.discard(fut)
            if not busy:
                del self._busy[engine_id]

    async def drain(self, engine_id: str) -> None:
        """Wait until nothing hashes ``engine_id``'s memory any more."""
        busy = self._busy.get(engine_id)
        if busy:
            await asyncio.wait(list(busy))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


async def _joined(futs: list[asyncio.Future[bytes]]) -> bytes:
    """Every part's hashes in order; waits for all even when one fails or this is
    cancelled (a thread may not outlive the wait on it)."""
    try:
        await asyncio.shield(asyncio.wait(futs))
    except asyncio.CancelledError:
        await asyncio.wait(futs)
        raise
    return b"".join(f.result() for f in futs)


async def hashed(fut: asyncio.Future[T]) -> T:
    """Await a :meth:`Hashing.run` without leaving its threads behind on cancellation."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait([fut])
        raise


@dataclass(frozen=True)
class Asked:
    """One digest request of a read: its pieces (region-relative) and P's answer."""

    rank: int
    region: I64
    local: I64
    length: I64
    answer: asyncio.Future[ControlAnswer]
    #: where it went and what it said (to ask again while P's hold is not placed)
    address: str = ""
    msg: Digest | None = None


@dataclass(frozen=True)
class Verifier:
    """What a D read needs to verify: the peer channel, the hashing threads and the
    FAKE FAULT's request id prefix (tests only, see :data:`digest.FAKE_FAULT_ENV`)."""

    handshakes: HandshakeClient
    hashing: Hashing
    fake_fault: str = ""
    chunk_bytes: int = digest.CHUNK_BYTES


def ask(v: Verifier, plan: ReadPlan, addresses: dict[int, str],
        request: Callable[[int, bytes, int], Digest]) -> list[Asked]:
    """Ask every P rank the plan reads bytes from for the digest of its pieces,
    at most :data:`digest.MAX_RANGES` pieces per request; ``request(rank,
    ranges, chunk_bytes)`` builds one. Called at post time: P hashes while the
    bytes travel."""
    out = []
    for rr in plan.reads:
        for lo in range(0, int(rr.length.size), digest.MAX_RANGES):
            hi = lo + digest.MAX_RANGES
            region = rr.region[lo:hi].astype(np.int64)
            length = rr.length[lo:hi]
            msg = request(rr.remote_rank,
                          digest.pack_ranges(region, rr.remote_offset[lo:hi], length),
                          v.chunk_bytes)
            answer = asyncio.ensure_future(v.handshakes.control(addresses[rr.remote_rank], msg))
            answer.add_done_callback(_retrieve)
            out.append(Asked(rr.remote_rank, region, rr.local_offset[lo:hi], length, answer,
                             addresses[rr.remote_rank], msg))
    return out


def landing(v: Verifier, engine_id: str, request_id: str, digester: digest.Digester,
            views: Sequence[NDArray[np.uint8]], parts: Sequence[asyncio.Future[Any]],
            pieces: Sequence[tuple[I64, I64, I64]]) -> asyncio.Future[bytes]:
    """D's digest of one request's pieces that travel as ``parts`` (transfers
    posted one after the other, each of whole chunks: ``pieces[k]`` is what
    ``parts[k]`` carries, region-relative on D): each part is hashed once its
    transfer ended, beside the next one's copy. Fails when a part failed (the
    read fails then anyway)."""
    task = asyncio.ensure_future(_landing(v, engine_id, request_id, digester, views, parts,
                                          pieces))
    task.add_done_callback(_retrieve)
    return task


async def _landing(v: Verifier, engine_id: str, request_id: str, digester: digest.Digester,
                   views: Sequence[NDArray[np.uint8]], parts: Sequence[asyncio.Future[Any]],
                   pieces: Sequence[tuple[I64, I64, I64]]) -> bytes:
    runs: list[asyncio.Future[bytes]] = []
    for k, (part, p) in enumerate(zip(parts, pieces)):
        await asyncio.wait([part])
        if part.cancelled() or part.exception() is not None:
            raise RuntimeError(f"part {k} of the transfer failed")
        if k == 0:
            _fake_fault(v, request_id, views, p[0], p[1])
        runs.append(v.hashing.run(engine_id, digester, views, *p, v.chunk_bytes))
    return b"".join(await _all(runs))


def _fake_fault(v: Verifier, request_id: str, views: Sequence[NDArray[np.uint8]],
                region: I64, offset: I64) -> None:
    """FAKE FAULT (tests only): flip one landed byte of a read whose request id
    starts with ``v.fake_fault`` before D hashes it."""
    if v.fake_fault and request_id.startswith(v.fake_fault):
        digest.flip_one_byte(views, region, offset)


async def check(v: Verifier, engine_id: str, request_id: str, digester: digest.Digester,
                views: Sequence[NDArray[np.uint8]], asked: list[Asked],
                landed: asyncio.Future[bytes] | None = None) -> int:
    """Hash what landed (every piece of ``asked``, on D's side; ``landed``: the
    digest of the only one, hashed as it landed, see :func:`landing`) and
    compare with P's answers; the bytes verified, or :class:`VerifyFailed`
    (``reason``: mismatch, refused, unanswered) naming the P rank and where."""
    if landed is not None:
        assert len(asked) == 1, "a read hashed as it lands asks one digest"
        mine = [landed]
    else:
        if asked:
            _fake_fault(v, request_id, views, asked[0].region, asked[0].local)
        mine = [v.hashing.run(engine_id, digester, views, a.region, a.local, a.length,
                              v.chunk_bytes) for a in asked]
    got = await hashed(asyncio.ensure_future(_all(mine)))
    until = time.monotonic() + DIGEST_RETRY_S
    answers = await asyncio.gather(*(_answer(v, a, until) for a in asked),
                                   return_exceptions=True)
    total = 0
    for a, ours, answer in zip(asked, got, answers):
        nbytes = int(a.length.sum())
        if isinstance(answer, BaseException):
            raise VerifyFailed("unanswered", f"byte verification: P rank {a.rank} gave no "
                                             f"digest ({answer})")
        if not answer.reply.granted:
            raise VerifyFailed("refused", f"byte verification: P rank {a.rank} refused the "
                                          f"digest: {answer.reply.reason}")
        k = digest.first_difference(answer.reply.digest, ours)
        if k >= 0:
            c = v.chunk_bytes
            raise VerifyFailed("mismatch", (
                f"byte verification failed: the bytes that landed from P rank {a.rank} differ "
                f"from the bytes P holds (chunk {k}: bytes {k * c}..{min((k + 1) * c, nbytes)} "
                f"of the {nbytes} B of {a.length.size} pieces one digest covered, in plan "
                f"order); nothing was notified"))
        total += nbytes
    return total


async def _answer(v: Verifier, a: Asked, until: float) -> ControlAnswer:
    """P's answer to ``a``, asked again (backing off) while P refuses for now
    (``retry``), until ``until``."""
    answer = await a.answer
    pause = 0.005
    while answer.reply.retry and a.msg is not None and time.monotonic() < until:
        await asyncio.sleep(pause)
        pause = min(2 * pause, 0.1)
        answer = await v.handshakes.control(a.address, a.msg)
    return answer


class VerifyFailed(RuntimeError):
    """A verified read that must not be ``received``: its bytes differ from P's
    (``mismatch``), or P refused or gave no digest (``refused``, ``unanswered``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


async def _all(futs: list[asyncio.Future[bytes]]) -> list[bytes]:
    """Every hash, once all ended (none left running behind a failure)."""
    if futs:
        await asyncio.wait(futs)
    return [f.result() for f in futs]


def _retrieve(f: asyncio.Future[Any]) -> None:
    if not f.cancelled():
        f.exception()
