"""How much CPU an idle NixlWorker burns, and how much the event loop feels a big read.

Two workers in one process, wired to each other (metadata exchanged, one read
done so UCX endpoints exist), then left alone. CPU is read per thread from
/proc/self/task/<tid>/stat (10 ms ticks), so the figure is the worker thread's
own, not the interpreter's. For comparison the same is measured with blocks
held (``set_hot``: the wait escalates from 1 ms to its cap), with a reader's lease
running (``expect_reads``: 1 ms polls), and for the whole process.

Then a 64 MiB read runs on one worker while a loop ticker records the largest
lag of a 1 ms ``asyncio.sleep`` on the event loop: the copy happens on the
worker thread with the GIL released, so the loop should barely notice.

Run: ``.venv/bin/python benchmarks/nixl_worker_idle.py [--seconds 2] [--asyncio]``
(uvloop by default, as in the daemon).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import mmap
import os
import resource
import time

import numpy as np

from kvsidecar.daemon.transport.worker import NixlWorker, transport_note

_TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def process_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def buf(nbytes: int) -> tuple[mmap.mmap, int]:
    mm = mmap.mmap(-1, nbytes)
    mm[:] = b"\x01" * nbytes
    return mm, ctypes.addressof(ctypes.c_char.from_buffer(mm))


async def measure(workers: list[NixlWorker], seconds: float) -> tuple[list[float], float]:
    tids = [w.native_thread_id for w in workers]
    assert all(t is not None for t in tids)
    before = [thread_cpu_s(t) for t in tids if t is not None]
    p0, t0 = process_cpu_s(), time.perf_counter()
    await asyncio.sleep(seconds)
    wall = time.perf_counter() - t0
    after = [thread_cpu_s(t) for t in tids if t is not None]
    per_thread = [100 * (b - a) / wall for a, b in zip(before, after)]
    return per_thread, 100 * (process_cpu_s() - p0) / wall


async def loop_lag_during(coro_factory: object, ticks_s: float = 0.001) -> tuple[float, float]:
    lags: list[float] = []
    stop = False

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not stop:
            t = loop.time()
            await asyncio.sleep(ticks_s)
            lags.append(loop.time() - t - ticks_s)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    await coro_factory()  # type: ignore[operator]
    dur = time.perf_counter() - t0
    stop = True
    await task
    return max(lags) * 1e3, dur * 1e3


async def main(seconds: float) -> None:
    print(f"transport: {transport_note()}")
    size = 64 << 20
    am, aa = buf(size)
    bm, ba = buf(size)
    a, b = NixlWorker("idle-a"), NixlWorker("idle-b")
    await a.start()
    await b.start()
    await a.register([(aa, size)])
    await b.register([(ba, size)])
    bname = await a.add_remote(await b.metadata())
    await b.add_remote(await a.metadata())
    one = np.ones(1, dtype=np.int64)
    await a.read(bname, one * aa, one * ba, one * 4096, notif=b"warm")
    await b.notify(a.agent_name, b"warm")
    await asyncio.sleep(0.2)

    idle, proc_idle = await measure([a, b], seconds)
    print(f"idle   ({seconds:.0f} s): worker threads {idle[0]:.2f} % and {idle[1]:.2f} % of a core;"
          f" whole process {proc_idle:.2f} %")
    a.set_hot(True)  # blocks held, no reader yet: the wait escalates to hot_max_s
    hot, proc_hot = await measure([a], seconds)
    print(f"held   ({seconds:.0f} s): worker thread {hot[0]:.2f} % of a core;"
          f" whole process {proc_hot:.2f} %")
    a.expect_reads(seconds + 5)  # a reader claimed a lease: hot_poll_s while it runs
    tight, proc_tight = await measure([a], seconds)
    a.set_hot(False)
    print(f"leased ({seconds:.0f} s): worker thread {tight[0]:.2f} % of a core;"
          f" whole process {proc_tight:.2f} %")

    lag_ms, dur_ms = await loop_lag_during(
        lambda: a.read(bname, one * aa, one * ba, one * size, notif=b"big")
    )
    base_ms, _ = await loop_lag_during(lambda: asyncio.sleep(dur_ms / 1e3))
    print(f"64 MiB read on the worker: {dur_ms:.1f} ms; max lag of a 1 ms loop tick {lag_ms:.2f} ms"
          f" (same tick with nothing running: {base_ms:.2f} ms)")
    await a.stop()
    await b.stop()
    del am, bm


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--asyncio", action="store_true", help="plain asyncio instead of uvloop")
    args = ap.parse_args()
    if args.asyncio:
        asyncio.run(main(args.seconds))
    else:
        import uvloop

        uvloop.run(main(args.seconds))
