"""Engine CPU per client call (issue #31): ``hold``, ``read`` and ``poll`` of the
blocking client, against one P and one D sidecar, measured as the calling
thread's CPU time (``time.thread_time``) per call; medians over many calls.

Conditions (an engine's calls rarely come back to back):

* ``hold`` right after filling its 16 blocks (256 KiB; cold caches), and without;
* ``read`` back to back (the reads of a round follow each other), and after a
  3 ms sleep;
* ``poll`` returning the round's completions after a 3 ms sleep, and empty,
  back to back;
* the floor of each: a bare ``AF_UNIX SEQPACKET`` round trip to an echo process
  after the same work (``floors.unix_cpu``).

``--fake`` measures the clients alone instead: against a stand-in daemon (a
process that answers each request at once with a fixed reply: ``Ok``,
``Held``, ``Completions`` of four ``received`` items or none), thousands of calls,
back to back, after a 3 ms sleep and after an 8 MiB memset (cold caches):
what the client's code costs without the real daemon's latency and noise.

``--old REV`` also measures the client of git revision ``REV`` (its ``ipc/``
imported as another package) in the same run, rounds interleaved, so load from
others hits both alike. ``--profile`` prints the new client's functions per
call (cProfile) instead.

    PYTHONPATH=<tree>/.typecheck python benchmarks/engine_cpu.py --old main --rounds 500
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import itertools
import os
import pstats
import selectors
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvsidecar.ipc.protocol import (
    Completion,
    Completions,
    Held,
    Hold,
    Ok,
    Poll,
    Read,
    RemoteEngine,
)
from kvsidecar.sim.cluster import SidecarProcess, SimEngine
from kvsidecar.sim.oracle import Request, fill_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
import floors
from suite import small_attention

K, SLOTS = 16, 4  # blocks per call; reads (and holds) per round
FAKE_TOKEN = "t" * 120  # a hold token's size


def old_client(rev: str, root: Path, into: Path) -> Any:
    """``ipc/`` of git revision ``rev`` as package ``ipc_<rev>``; its client class."""
    name = "ipc_" + "".join(c if c.isalnum() else "_" for c in rev)
    dest = into / name
    dest.mkdir(parents=True)
    tar = subprocess.run(["git", "-C", str(root), "archive", rev, "ipc"], check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "--strip-components=1", "-C", str(dest)], input=tar,
                   check=True)
    sys.path.insert(0, str(into))
    return importlib.import_module(f"{name}.client").SidecarClient


class MinimalClient:
    """The client's ``hold``/``read``/``poll`` made by :class:`floors.MinimalCaller`
    (build, encode, send, receive, decode; no checks, timeouts, reconnection):
    the least any Python caller pays, measured alongside."""

    def __init__(self, path: str) -> None:
        self.call = floors.MinimalCaller(path)
        self.ids = itertools.count(1 << 40)
        self.acks: dict[str, tuple[str, int | None]] = {}

    def hold(self, engine_id: str, rid: str, block_ids: list[list[int]], *,
             readers: int) -> Held:
        return floors.expect(self.call(Hold(engine_id, rid, block_ids, readers, None,
                                            id=next(self.ids))), Held)

    def read(self, engine_id: str, rid: str, local: list[list[int]], remote: RemoteEngine,
             remote_ids: list[list[int]], *, remote_request_id: str,
             remote_tokens: list[str]) -> None:
        floors.expect(self.call(Read(engine_id, rid, local, remote, remote_ids,
                                     remote_request_id, None, None,
                                     remote_tokens=remote_tokens, id=next(self.ids))), Ok)

    def poll(self, engine_id: str) -> list[Completion]:
        epoch, ack = self.acks.get(engine_id, ("", None))
        got = floors.expect(self.call(Poll(engine_id, ack, epoch, 0.0, id=next(self.ids))),
                            Completions)
        self.acks[engine_id] = (got.epoch, got.last)
        return got.items

    def close(self) -> None:
        self.call.close()


class BareCaller:
    """The same calls as pre-encoded bytes, sent, and the reply received into a
    buffer, undecoded: no Python object built, encoded or decoded. Against the
    stand-in daemon (``--fake``) only: the floor of a call of that size."""

    def __init__(self, path: str) -> None:
        from kvsidecar.ipc.seqpacket import RECV_BYTES, new_socket

        self.sock = new_socket()
        self.sock.connect(path)
        self.buf = bytearray(RECV_BYTES)
        remote = RemoteEngine("fake-P", 1, ["127.0.0.1:40000/" + "k" * 43])
        ids = [list(range(K))]
        enc = msgspec.msgpack.encode
        self.wire = {
            "read": enc(Read("fake-D", "r1", ids, remote, ids, "r1", None, None,
                             remote_tokens=[FAKE_TOKEN], id=1)),
            "hold": enc(Hold("fake-P", "h1", ids, 1, None, id=1)),
            "fake-full": enc(Poll("fake-full", 1, "e" * 32, 0.0, id=1)),
            "fake-D": enc(Poll("fake-D", 1, "e" * 32, 0.0, id=1)),
        }

    def _call(self, data: bytes) -> None:
        self.sock.send(data)
        self.sock.recv_into(self.buf)

    def read(self, *args: Any, **kwargs: Any) -> None:
        self._call(self.wire["read"])

    def hold(self, *args: Any, **kwargs: Any) -> None:
        self._call(self.wire["hold"])

    def poll(self, engine_id: str) -> None:
        self._call(self.wire[engine_id])

    def close(self) -> None:
        self.sock.close()


class Variant:
    """One client (class) with its own P and D engines on the shared sidecars, so
    its polls and acknowledgements are its own."""

    def __init__(self, name: str, cls: Any, p0: SidecarProcess, d0: SidecarProcess) -> None:
        self.name = name
        self.P = SimEngine(f"cpu-{name}-P", small_attention, 1, K * SLOTS, [p0])
        self.D = SimEngine(f"cpu-{name}-D", small_attention, 1, K * SLOTS, [d0])
        self.pc, self.dc = cls(p0.socket), cls(d0.socket)
        self.remote = self.P.remote
        self.cpu: dict[str, list[float]] = {}
        self.items: list[int] = []
        #: wall seconds per read call (how late the daemon answers one)
        self.wall: list[float] = []
        self.n = 0

    def add(self, what: str, dt: float) -> None:
        self.cpu.setdefault(what, []).append(dt)

    def round(self, fill: bool, sleep_reads: bool) -> None:
        """``SLOTS`` holds (each after its fill, or not), as many reads (back to
        back, or each after a 3 ms sleep), a 3 ms sleep, polls until all are read."""
        P, D, pc, dc, t = self.P, self.D, self.pc, self.dc, time.thread_time
        self.n += 1
        rids = [f"{self.name}{self.n}-{j}" for j in range(SLOTS)]
        tokens = []
        for j, rid in enumerate(rids):
            ids = list(range(j * K, (j + 1) * K))
            if fill:
                fill_shard(P.buffers[0], P.layout, 0, [ids], Request(seed=j, prompt_tokens=8 * K))
            c0 = t()
            held = pc.hold(P.engine_id, rid, [ids], readers=1)
            self.add("hold after fill" if fill else "hold b2b", t() - c0)
            tokens.append(held.token)
        for j, rid in enumerate(rids):
            ids = list(range(j * K, (j + 1) * K))
            if sleep_reads:
                time.sleep(0.003)
            c0, w0 = t(), time.perf_counter()
            dc.read(D.engine_id, rid, [ids], self.remote, [ids], remote_request_id=rid,
                    remote_tokens=[tokens[j]])
            self.add("read after sleep" if sleep_reads else "read b2b", t() - c0)
            self.wall.append(time.perf_counter() - w0)
        time.sleep(0.003)
        want = set(rids)
        first = True
        while want:
            c0 = t()
            items = dc.poll(D.engine_id)
            dt = t() - c0
            if items and first:
                self.add("poll with completions after sleep", dt)
                self.items.append(len(items))
                first = False
            for c in items:
                if c.kind != "received":
                    raise RuntimeError(f"read {c.request_id}: {c.kind} ({c.reason})")
                want.discard(c.request_id)
            if want:
                time.sleep(0.0005)
        P.wait_for(rids, timeout_s=60)
        for _ in range(4):
            c0 = t()
            dc.poll(D.engine_id)
            self.add("poll empty b2b", t() - c0)

    def close(self) -> None:
        self.pc.close()
        self.dc.close()
        self.D.close()
        self.P.close()


def _fake_daemon(path: str, ready: Any) -> None:
    """Answer every request at once: Ok, Held, or Completions (four ``received``
    items, with a transfer report each, to an engine named ``*full``)."""
    from kvsidecar.ipc.protocol import TransferReport, decode_request, encode_reply
    from kvsidecar.ipc.seqpacket import new_socket

    listener = new_socket()
    listener.bind(path)
    listener.listen()
    ready.set()
    done = [Completion(f"req-{i}", "received", nbytes=K * 16384, descriptors=1,
                       transfers=[TransferReport(0, K * 16384, 1, 2.1e-5, 1.9e-4)])
            for i in range(4)]
    n = 0
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is listener:
                sel.register(listener.accept()[0], selectors.EVENT_READ)
                continue
            conn: Any = key.fileobj
            data = conn.recv(1 << 16)
            if not data:
                sel.unregister(conn)
                conn.close()
                continue
            req = decode_request(data)
            reply: Any
            if isinstance(req, Hold):
                reply = Held(30.0, 120.0, FAKE_TOKEN)
            elif isinstance(req, Poll):
                n += 1
                reply = Completions(done if req.engine_id.endswith("full") else [], n, "e" * 32)
            else:
                reply = Ok()
            reply.id = req.id
            conn.send(encode_reply(reply))


def fake(classes: dict[str, Any], work: Path, calls: int) -> None:
    """Each client's calls against :func:`_fake_daemon`, interleaved in batches."""
    import multiprocessing as mp

    path = str(work / "fake.sock")
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_fake_daemon, args=(path, ready), daemon=True)
    proc.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the stand-in daemon did not start")
        remote = RemoteEngine("fake-P", 1, ["127.0.0.1:40000/" + "k" * 43])
        junk = np.zeros(8 << 20, np.uint8)
        conds: dict[str, Callable[[], object] | None] = {
            "b2b": None, "after sleep": lambda: time.sleep(0.003),
            "after 8 MiB memset": lambda: junk.fill(1)}
        clients = {name: cls(path) for name, cls in classes.items()}
        calls_of: dict[str, Callable[[Any, int], object]] = {
            "read": lambda c, i: c.read("fake-D", f"r{i}", [list(range(K))], remote,
                                        [list(range(K, 2 * K))], remote_request_id=f"r{i}",
                                        remote_tokens=[FAKE_TOKEN]),
            "hold": lambda c, i: c.hold("fake-P", f"h{i}", [list(range(K))], readers=1),
            "poll, 4 completions": lambda c, i: c.poll("fake-full"),
            "poll, empty": lambda c, i: c.poll("fake-D"),
        }
        cpu: dict[tuple[str, str, str], list[float]] = {}
        t = time.thread_time
        batch = 50
        for r in range(max(1, calls // batch)):
            for cond, between in conds.items():
                if cond == "after sleep" and r % 4:
                    continue  # a quarter as many: the sleeps take the time
                for what, call in calls_of.items():
                    for name in (list(clients) if r % 2 else list(clients)[::-1]):
                        c = clients[name]
                        out = cpu.setdefault((what, cond, name), [])
                        for i in range(batch):
                            if between is not None:
                                between()
                            c0 = t()
                            call(c, i)
                            out.append(t() - c0)
        for c in clients.values():
            c.close()
    finally:
        proc.kill()
        proc.join(10)
    load = os.getloadavg()
    print(f"client CPU per call against a stand-in daemon (thread_time, median; "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f})")
    print("| call | condition | " + " | ".join(classes) + " |")
    print("|" + " --- |" * (len(classes) + 2))
    for what in calls_of:
        for cond in conds:
            cells = [f"{statistics.median(cpu[(what, cond, n)]) * 1e6:.1f} µs"
                     for n in classes]
            print(f"| {what} | {cond} | " + " | ".join(cells) + " |")


def profile(v: Variant, rounds: int) -> None:
    prof = cProfile.Profile()
    for _ in range(3):
        v.round(fill=False, sleep_reads=False)
    prof.enable()
    for _ in range(rounds):
        v.round(fill=False, sleep_reads=False)
    prof.disable()
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(r"ipc|msgspec|socket|\{")
    print(out.getvalue()[:12000])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="also measure the client of this git revision (same run)")
    ap.add_argument("--rounds", type=int, default=300, help="rounds per variant and condition")
    ap.add_argument("--floor", type=int, default=1000, help="bare round trips per condition")
    ap.add_argument("--no-minimal", action="store_true",
                    help="leave out the minimal caller (floors.MinimalCaller)")
    ap.add_argument("--fake", type=int, metavar="CALLS",
                    help="measure the clients alone, CALLS calls each, against a stand-in daemon")
    ap.add_argument("--profile", action="store_true", help="cProfile the new client instead")
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    work = Path(tempfile.mkdtemp(prefix="kvs-engine-cpu-"))
    from kvsidecar.ipc.client import SidecarClient

    classes: dict[str, Any] = {"new": SidecarClient, "minimal": MinimalClient}
    if args.no_minimal:
        del classes["minimal"]
    if args.old:
        classes = {"old": old_client(args.old, root, work / "old"), **classes}
    if args.fake:
        try:
            fake({**classes, "bare": BareCaller}, work, args.fake)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    sidecar_args = ["--metrics-port", "0", "--engine-lease", "600"]
    p0 = SidecarProcess(work, "p0", args=sidecar_args).start()
    d0 = SidecarProcess(work, "d0", args=sidecar_args).start()
    variants: list[Variant] = []
    try:
        variants = [Variant(n, c, p0, d0) for n, c in classes.items()]
        if args.profile:
            profile(next(v for v in variants if v.name == "new"), args.rounds)
            return
        for v in variants:  # warm: links, plans, first imports
            for _ in range(5):
                v.round(fill=False, sleep_reads=False)
            v.cpu.clear()
            v.items.clear()
            v.wall.clear()
        for r in range(args.rounds):
            for v in (variants if r % 2 else variants[::-1]):
                v.round(fill=True, sleep_reads=False)
                v.round(fill=False, sleep_reads=True)
        scratch = variants[0].P
        floor: dict[str, float] = {}
        for what, between in (("b2b", None),
                              ("after fill", lambda: fill_shard(
                                  scratch.buffers[0], scratch.layout, 0, [list(range(K))],
                                  Request(seed=0, prompt_tokens=8 * K))),
                              ("after sleep", lambda: time.sleep(0.003))):
            floor[what] = _floor_median(args.floor, between)
        late = statistics.median(variants[0].wall)
        floor[f"b2b, answered as late as a read ({late * 1e6:.0f} µs)"] = _floor_median(
            args.floor, None, late)
    finally:
        for v in variants:
            v.close()
        d0.stop()
        p0.stop()
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    print(f"engine CPU per call (thread_time, median of {args.rounds} rounds; "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f})")
    names = list(variants[0].cpu)
    head = "| call | " + " | ".join(v.name for v in variants) + " |"
    print(head)
    print("|" + " --- |" * (len(variants) + 1))
    for what in names:
        cells = [f"{statistics.median(v.cpu[what]) * 1e6:.1f} µs (p90 "
                 f"{np.percentile(v.cpu[what], 90) * 1e6:.0f})" for v in variants]
        print(f"| {what} | " + " | ".join(cells) + " |")
    for v in variants:
        print(f"{v.name}: {statistics.fmean(v.items):.1f} completions per poll with completions")
    print("floor, a bare AF_UNIX SEQPACKET round trip (thread CPU, median): " +
          ", ".join(f"{k} {x * 1e6:.1f} µs" for k, x in floor.items()))


def _floor_median(n: int, between: Callable[[], object] | None, delay_s: float = 0.0) -> float:
    """Median thread CPU of a bare round trip to an echo process that answers after
    ``delay_s`` (spinning), each after ``between``."""
    out: list[float] = []
    t = time.thread_time

    def timed_between() -> None:
        if between is not None:
            between()

    with floors._unix_echo_peer(n + 20, delay_s) as sock:
        for i in range(n + 20):
            timed_between()
            c0 = t()
            sock.send(b"x" * 64)
            sock.recv(65536)
            if i >= 20:
                out.append(t() - c0)
    return statistics.median(out)


if __name__ == "__main__":
    main()
