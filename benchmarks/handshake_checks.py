"""What a peer's handshake answer costs the event loop, before and after the
vectorised checks (docs/performance.md, "A handshake's checks").

Old code is loaded from git (``--old REV``, default the commit before the
change) into this process, so old and new run alternately on the same data:

* per step (CPU, median): decoding the info, ``validate``, ``check_peer``
  (with ``check_bases``) and the bases array a link keeps;
* per handshake on the loop, through the real ``HandshakeClient`` decode and
  ``PeerLinks`` link (old: the old checks patched in, every step on the
  loop; new: large infos decoded and checked on a thread): the loop
  thread's CPU (``time.thread_time``, without the ticker) and the stall a
  0.2 ms sleep loop (the ticker) sees past its 0.2 ms.

    PYTHONPATH=... python benchmarks/handshake_checks.py [--old REV] [--reps N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast
from unittest import mock

import numpy as np

from kvsidecar.daemon.peers import client as client_module
from kvsidecar.daemon.peers import links as links_module
from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.peers.links import PeerLinks
from kvsidecar.daemon.peers.messages import (
    HandshakeReply,
    check_peer,
    decode_info,
    decode_reply,
    encode,
    make_handshake_info,
)
from kvsidecar.ipc.layout import Layout, attention_layout, fingerprinted, validate

ROOT = Path(__file__).resolve().parents[1]
CASES = [(1, False), (1024, True), (65536, True), (65536, False)]


def old_module(rev: str, path: str, name: str) -> types.ModuleType:
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True,
                         capture_output=True, text=True).stdout
    mod = types.ModuleType(name)
    mod.__dict__["__name__"] = name
    sys.modules[name] = mod
    exec(compile(src, f"{rev}:{path}", "exec"), mod.__dict__)
    return mod


def layout_of(regions: int, named: bool) -> Layout:
    """Attention, K and V in separate regions (every region named by a segment)
    or in one page per region (no segment names its regions)."""
    return attention_layout(model="m", num_layers=regions // 2 if named else regions,
                            total_kv_heads=2, head_dim=8, block_tokens=4, tp_size=1,
                            num_blocks=2, kv_separate=named)


def median_ms(fn: Callable[[], object], reps: int) -> float:
    xs = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs) * 1e3


class _Worker:
    agent_name = "d-agent"
    generation = 0
    running = True

    async def add_remote_at(self, metadata: bytes) -> tuple[str, int]:
        return "p-agent", 0


async def _ticking(stop: asyncio.Event) -> float:
    """The longest gap past 0.2 ms between a ticker's wake-ups, in ms."""
    worst, last = 0.0, time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.0002)
        now = time.perf_counter()
        worst, last = max(worst, now - last - 0.0002), now
    return worst * 1e3


async def on_loop(run: Callable[[], Any], tick: bool) -> tuple[float, float]:
    """(loop thread CPU ms, worst ticker stall ms) of one handshake; the CPU
    without the ticker (its wake-ups would count), the stall with it."""
    stop = asyncio.Event()
    ticker = asyncio.create_task(_ticking(stop)) if tick else None
    await asyncio.sleep(0.002)
    cpu = time.thread_time()
    await run()
    cpu = time.thread_time() - cpu
    await asyncio.sleep(0.002)
    stop.set()
    return cpu * 1e3, (await ticker if ticker is not None else 0.0)


def steps(regions: int, named: bool, old_validate: Callable[[Layout], None],
          old_check_peer: Callable[..., None], reps: int) -> None:
    """One case: per-step medians (old and new alternating), then per handshake."""
    lay = layout_of(regions, named)
    local = fingerprinted(lay)
    rb = lay.region_bytes
    info = make_handshake_info(engine_id="p", tp_rank=0, agent_name="p-agent",
                               agent_metadata=b"m" * 1000, layout=local,
                               bases=[(1 << 30) + r * rb for r in range(regions)],
                               daemon_id="d")
    frame = encode(HandshakeReply(info, req_id=1))
    raw = decode_reply(frame).info
    n = reps if regions > 1024 else reps * 20
    timed: dict[str, list[float]] = {}
    for _ in range(3):  # alternate old and new
        for k, fn in [
            ("decode", lambda: decode_info(raw)),
            ("validate old", lambda: old_validate(info.layout)),
            ("validate new", lambda: validate(info.layout)),
            ("check_peer old", lambda: old_check_peer(info, "p", 1, local)),
            ("check_peer new", lambda: check_peer(info, "p", 1, local)),
            ("bases array (old link)", lambda: np.asarray(info.bases, dtype=np.int64)),
        ]:
            timed.setdefault(k, []).append(median_ms(fn, n))
    print(f"{regions} regions ({'named' if named else 'none named'}), {len(frame)} B: "
          + ", ".join(f"{k} {min(v):.3f}" for k, v in timed.items()))

    def old_accept(info: Any, engine_id: str, tp: int, local: Any, **kw: Any) -> Any:
        old_validate(info.layout)
        old_check_peer(info, engine_id, tp, local)
        return np.asarray(info.bases, dtype=np.int64)

    async def both() -> dict[str, list[tuple[float, float]]]:
        client = HandshakeClient(timeout_s=5)

        async def roundtrip(*_: object) -> object:
            return decode_reply(frame)

        client._roundtrip = roundtrip  # type: ignore[method-assign]

        kept: list[Any] = []  # freed between runs, untimed (see "free" below)

        async def new_path() -> None:  # the real decode and link, large infos on a thread
            links = PeerLinks(cast(Any, _Worker()), local, cast(Any, client))
            client.forget("tcp://p:1")
            kept.append(await links.get("tcp://p:1", "p", 1, 0))

        async def old_path() -> None:  # the same, with the old checks, all on the loop
            with mock.patch.object(links_module, "accept_peer", old_accept), \
                    mock.patch.object(links_module, "OFF_LOOP_NUMBERS", 1 << 62), \
                    mock.patch.object(client_module, "OFF_LOOP_INFO_BYTES", 1 << 62):
                await new_path()

        out: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
        for i in range(2 * max(5, reps)):
            for k, path in (("old", old_path), ("new", new_path)):
                cpu, _ = await on_loop(path, tick=False)
                _, stall = await on_loop(path, tick=True)
                out[k].append((cpu, stall))
                client.forget("tcp://p:1")
                t = time.thread_time()
                kept.clear()  # the last references to the decoded infos
                out.setdefault("free", []).append(((time.thread_time() - t) * 1e3 / 2, 0.0))
            del i
        await client.close()
        return out

    for k, v in asyncio.run(both()).items():
        cpu = statistics.median(c for c, _ in v)
        if k == "free":
            print(f"  freeing one decoded info (a link and its cached answer dropped): "
                  f"{cpu:.3f} ms")
            continue
        stall = statistics.median(s for _, s in v)
        print(f"  {k}: loop CPU {cpu:.3f} ms (median), ticker stall median {stall:.3f} "
              f"max {max(s for _, s in v):.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="5d5e1b1", help="the commit before the change")
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    old_layout = old_module(a.old, "ipc/layout.py", "old_layout")
    old_messages = old_module(a.old, "daemon/peers/messages.py", "old_messages")
    print(f"old {a.old}; load {Path('/proc/loadavg').read_text().split()[:3]}; "
          "ticker: a 0.2 ms sleep loop, its stall past 0.2 ms")
    for regions, named in CASES:
        steps(regions, named, old_layout.validate, old_messages.check_peer, a.reps)


if __name__ == "__main__":
    main()
