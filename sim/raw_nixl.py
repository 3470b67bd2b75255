"""Baselines: bytes moved by bare NIXL agents, no sidecar.

:class:`RawPair` is two processes with one bare ``nixl_agent`` each (UCX,
progress thread off) over shared memory: the initiator here, the target in a
child process that keeps progressing its UCX worker (wire-up needs it, and
every READ's closing flush) until the initiator's notification says it is
done, except while the initiator has it rest (:meth:`RawPair.resting`). The
demo compares the sidecar's reads with one READ of the same bytes through it,
and with the same bytes in as many scattered descriptors; benchmarks reuse
it. With ``device`` set, both sides' memory is ``cuMemAlloc`` memory of that
GPU (VRAM descriptors), the baseline of ``benchmarks/gpu_figures.py``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

import numpy as np

from kvsidecar.ipc.memory import ShmRegion, unique_name


def bare_agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    from kvsidecar.daemon.logs import quiet_libraries

    quiet_libraries()  # NIXL's INFO lines on stdout would break the demo's table
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


class _GpuBuffer:
    """``span`` bytes of ``cuMemAlloc`` memory on GPU ``device`` (its primary
    context made current on the calling thread), with what a pair needs of a
    region: its address, a fill, its first byte, and close."""

    def __init__(self, span: int, device: int) -> None:
        from kvsidecar.ipc import cuda

        cuda.make_current(device)
        self._cuda, self._drv, self.span = cuda, cuda.driver(), span
        self.address = int(cuda.check(self._drv.cuMemAlloc(span), "cuMemAlloc"))
        self.fill(0)

    def fill(self, value: int) -> None:
        """Set every byte to ``value``, done when this returns (the READs that
        follow run on UCX's streams, not after the memset: :func:`cuda.fill`)."""
        self._cuda.fill(self.address, value, self.span)

    def first_byte(self) -> int:
        out = np.zeros(1, np.uint8)
        self._cuda.check(self._drv.cuMemcpyDtoH(out.ctypes.data, self.address, 1), "DtoH")
        return int(out[0])

    def close(self) -> None:
        if self.address:
            self._drv.cuMemFree(self.address)
            self.address = 0

    def unlink(self) -> None:
        """GPU memory has no name to remove."""

    def __enter__(self) -> _GpuBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _memory(span: int, device: int | None) -> ShmRegion | _GpuBuffer:
    """One side's memory: shared memory (:func:`_region`), or GPU memory."""
    return _region(span) if device is None else _GpuBuffer(span, device)


def _fill(region: ShmRegion | _GpuBuffer, value: int) -> None:
    if isinstance(region, _GpuBuffer):
        region.fill(value)
    else:
        region.numpy()[:] = value


def _first_byte(region: ShmRegion | _GpuBuffer) -> int:
    return region.first_byte() if isinstance(region, _GpuBuffer) else int(region.numpy()[0])


def _mem_type(device: int | None) -> str:
    return "DRAM" if device is None else "VRAM"


def _region(span: int) -> ShmRegion:
    """Shared memory for one side of a pair, its name removed at once: only its
    own process maps it (the peer reads it by address), so a side that is
    killed (a benchmark stopped, the initiator's kill below) leaves nothing in
    /dev/shm, where 125 MiB regions of killed runs were found."""
    region = ShmRegion.create(unique_name("raw"), span)
    region.unlink()
    return region


#: Target loop rounds between checks that the initiator is still there.
_PARENT_CHECK_ROUNDS = 256
#: the initiator's words to its target over the pipe (see RawPair.resting)
_REST, _WAKE = "rest", "wake"


def _target(span: int, conn: Connection, spin: bool = False, device: int | None = None) -> None:
    seen: dict[bytes, float] = {}  # message -> perf_counter when it arrived (spin mode)
    with _memory(span, device) as region:
        agent = bare_agent("raw-target")  # after the GPU's context is current (VRAM)
        _fill(region, 7)
        descs = agent.get_reg_descs([(region.address, span, device or 0, "")],
                                    _mem_type(device))
        agent.register_memory(descs)
        conn.send((agent.get_agent_metadata(), region.address))
        if spin:  # acknowledgements need the initiator's metadata
            agent.add_remote_agent(conn.recv())
        done = False
        rounds = 0
        while not done:
            rounds += 1
            # Spinning, the pipe is checked every few rounds (a syscall each);
            # sleeping between rounds anyway, every round (``rest`` is prompt).
            checked = not spin or rounds % _PARENT_CHECK_ROUNDS == 0
            if checked and conn.poll() and not _obey(conn):
                return  # the initiator's end closed (it died): nobody to serve
            for peer, msgs in agent.get_new_notifs().items():
                now = time.perf_counter()
                for m in msgs:
                    if spin and bytes(m) not in seen:
                        agent.send_notif(peer, b"ack")  # the initiator waits for it
                    seen.setdefault(bytes(m), now)
                done = done or b"stop" in msgs
            if not spin:
                time.sleep(0.0001)
        agent.deregister_memory(descs)
    conn.send(seen)


def _obey(conn: Connection) -> bool:
    """Take one word from the initiator: ``rest`` blocks until ``wake`` (each
    acknowledged). False when the initiator's end closed."""
    try:
        if conn.recv() != _REST:
            return True
        conn.send(_REST)
        while conn.recv() != _WAKE:
            pass
        conn.send(_WAKE)
    except (EOFError, OSError):
        return False
    return True


class RawPair:
    """An initiator agent here and a target agent in a child process, each with
    ``span`` bytes of registered shared memory (the target's filled with 7s),
    or of GPU memory on ``device``."""

    def __init__(self, span: int, *, spin: bool = False, device: int | None = None) -> None:
        """``spin``: the target polls notifications without sleeping and records
        when each arrived (CLOCK_MONOTONIC, shared by both processes), which
        :attr:`arrivals` returns after the pair closes. ``device``: both sides'
        memory on that GPU (``VRAM`` descriptors) instead of shared memory."""
        self.span = span
        self.spin = spin
        self.device = device
        self.mem = _mem_type(device)
        self.arrivals: dict[bytes, float] = {}

    def __enter__(self) -> RawPair:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_target,
                                 args=(self.span, child, self.spin, self.device), daemon=True)
        self._conn = parent
        self._proc.start()
        child.close()  # the target's end lives in the target: its death reads as EOF here
        self.region = _memory(self.span, self.device)
        try:
            self.agent = bare_agent("raw-initiator")
            self._reg = self.agent.get_reg_descs(
                [(self.region.address, self.span, self.device or 0, "")], self.mem)
            self.agent.register_memory(self._reg)
            if not parent.poll(60):
                raise RuntimeError("raw NIXL target did not start")
            meta, self.remote_addr = parent.recv()
            self.peer = self.agent.add_remote_agent(meta)
            if self.spin:
                parent.send(self.agent.get_agent_metadata())
        except BaseException:  # no __exit__ will run: leave no shared memory or child behind
            self.region.close()
            self.region.unlink()
            self._proc.kill()
            self._proc.join(10)
            raise
        return self

    def table(self, base: int, slots: np.ndarray, size: int) -> np.ndarray:
        """Nx3 (addr, len, dev) descriptors of ``size`` bytes at slot indices."""
        return np.stack([base + slots * size, np.full(slots.size, size),
                         np.full(slots.size, self.device or 0)], 1).astype(np.int64)

    @contextlib.contextmanager
    def resting(self) -> Iterator[None]:
        """The target stops polling its UCX worker (every 100 µs, ~13 % of a
        core on the development host) until the block ends: a benchmark that
        times something else between this pair's READs keeps the baseline's
        target off the cores. No READ may be posted meanwhile (nothing would
        progress its closing flush). Not for a spinning pair."""
        if self.spin:
            raise ValueError("a spinning target does not rest")
        self._conn.send(_REST)
        ok = False
        try:
            self._await(_REST)
            yield
            ok = True
        finally:
            try:
                self._conn.send(_WAKE)
                self._await(_WAKE)
            except (OSError, EOFError, RuntimeError):
                if ok:  # else the error under way says more than this one
                    raise

    def _await(self, word: str) -> None:
        if not self._conn.poll(30) or self._conn.recv() != word:
            raise RuntimeError(f"raw NIXL target did not acknowledge {word!r}")

    def finish(self, handle: Any) -> None:
        """Post and poll one transfer to completion."""
        state = self.agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = self.agent.check_xfer_state(handle)
        self.agent.release_xfer_handle(handle)
        if state == "ERR":
            raise RuntimeError("raw NIXL transfer failed")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.agent.send_notif(self.peer, b"stop")
            for _ in range(100):
                self.agent.get_new_notifs()
                time.sleep(0.001)
            self.agent.deregister_memory(self._reg)
            if self._conn.poll(10):
                self.arrivals = self._conn.recv()
        finally:
            self.region.close()
            self.region.unlink()
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()


class RawReader:
    """One READ of ``nbytes`` through an open :class:`RawPair`, as one descriptor
    or as ``descriptors`` equal pieces in every other slot (nothing adjacent),
    timed on demand: a benchmark can interleave this baseline with its own
    reads, so both see the same minutes of a noisy host."""

    def __init__(self, pair: RawPair, nbytes: int, descriptors: int = 1) -> None:
        size = nbytes // descriptors
        slots = np.arange(descriptors, dtype=np.int64) * (1 if descriptors == 1 else 2)
        self.pair = pair
        self.local = pair.agent.get_xfer_descs(pair.table(pair.region.address, slots, size),
                                               pair.mem)
        self.remote = pair.agent.get_xfer_descs(pair.table(pair.remote_addr, slots, size),
                                                pair.mem)

    @staticmethod
    def span(nbytes: int, descriptors: int = 1) -> int:
        """Bytes each side of the pair needs for :meth:`once`."""
        return nbytes if descriptors == 1 else 2 * descriptors * (nbytes // descriptors)

    def once(self) -> float:
        """Wall seconds of one READ, posted and polled to completion."""
        pair = self.pair
        t0 = time.perf_counter()
        pair.finish(pair.agent.initialize_xfer("READ", self.local, self.remote, pair.peer, b""))
        dt = time.perf_counter() - t0
        if _first_byte(pair.region) != 7:
            raise RuntimeError("raw NIXL read moved no data")
        return dt


def raw_read_seconds(nbytes: int, repeats: int = 3, descriptors: int = 1) -> float:
    """Best wall time of one READ of ``nbytes`` cross-process, as one descriptor or
    as ``descriptors`` equal pieces in every other slot (nothing adjacent)."""
    with RawPair(RawReader.span(nbytes, descriptors)) as pair:
        reader = RawReader(pair, nbytes, descriptors)
        reader.once()  # the first one wires up
        return min(reader.once() for _ in range(repeats))


def raw_latencies(nbytes: int, count: int, device: int | None = None) -> list[float]:
    """Seconds from posting a one-descriptor READ of ``nbytes`` (with a
    notification) until both the initiator saw it DONE and the target received
    the notification, ``count`` times after a warm-up: the round trip a
    sidecar's small read stands in for. Both sides poll without sleeping.
    ``device``: GPU memory on both sides (VRAM)."""
    out: list[float] = []
    with RawPair(2 * nbytes, spin=True, device=device) as pair:
        one = np.zeros(1, np.int64)
        local = pair.agent.get_xfer_descs(pair.table(pair.region.address, one, nbytes),
                                          pair.mem)
        remote = pair.agent.get_xfer_descs(pair.table(pair.remote_addr, one, nbytes), pair.mem)
        starts, dones = [], []
        for i in range(count + 1):
            t0 = time.perf_counter()
            pair.finish(pair.agent.initialize_xfer("READ", local, remote, pair.peer,
                                                   f"t{i}".encode()))
            starts.append(t0)
            dones.append(time.perf_counter())
            # The notification leaves only while this side progresses its worker:
            # progress until the target says it arrived (its clock says when).
            deadline = time.monotonic() + 10
            while not pair.agent.get_new_notifs():
                if time.monotonic() > deadline:
                    raise RuntimeError("raw NIXL target did not acknowledge a notification")
    for i in range(1, count + 1):
        seen = pair.arrivals.get(f"t{i}".encode())
        if seen is None:
            raise RuntimeError(f"raw NIXL target never received notification {i}")
        out.append(max(dones[i], seen) - starts[i])
    return out


def forger_agent(handshake_address: str, engine_id: str) -> tuple[Any, str]:
    """A bare NIXL agent of a fleet member (it holds the fleet key) linked to P
    rank 0 of ``engine_id`` through its real handshake, and that agent's name:
    what the peer channel's authentication cannot stop, so tests of P's sender
    and per-read checks send forged notifications from it."""
    import asyncio

    from kvsidecar.daemon.peer_auth import load_keys
    from kvsidecar.daemon.peers.client import HandshakeClient
    from kvsidecar.sim.cluster import fleet_keys

    async def fetch() -> Any:
        client = HandshakeClient(timeout_s=10, keys=load_keys(fleet_keys()))
        try:
            return await client.fetch(handshake_address, engine_id, 0)
        finally:
            await client.close()

    info = asyncio.run(fetch())
    agent = bare_agent(f"forger-{engine_id}")
    target = agent.add_remote_agent(info.agent_metadata)
    return agent, target.decode() if isinstance(target, bytes) else str(target)
