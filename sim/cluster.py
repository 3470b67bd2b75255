"""Real sidecar processes and simulated engines, for the demo and end-to-end tests.

A :class:`SidecarProcess` is ``python -m kvsidecar serve`` in its own process
(real ZMQ, real NIXL). A :class:`SimEngine` plays one engine with ``tp``
ranks, each rank a client of its own sidecar, its KV cache in shared memory
(allocated by the sidecar, or by the engine and attached). P engines fill
their pages with the oracle's logical state and hold them; D engines poison
their pages, read, and verify with the oracle. Nothing here shortcuts the
daemon: every byte moves through NIXL between processes.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.daemon.engines.memory import remove_stale_segments, shm_prefix_for
from kvsidecar.daemon.peer_auth import generate_keys
from kvsidecar.ipc import hold_token
from kvsidecar.ipc.client import (
    AsyncSidecarClient,
    HoldSpec,
    ReadSpec,
    Registration,
    SidecarClient,
)
from kvsidecar.ipc.memory import ENGINE_SHM_PREFIX, ShmRegion, allocate_for_layout
from kvsidecar.ipc.protocol import Completion, MemoryKind, RemoteEngine
from kvsidecar.ipc.regions import Region, RegionView
from kvsidecar.sim.models import MakeLayout
from kvsidecar.sim.oracle import POISON, Request, check_received, fill_shard

_fleet_keys: str | None = None
_fleet_keys_lock = threading.Lock()


def fleet_keys() -> str:
    """One CURVE key directory for every sidecar this process starts (so they
    can talk to each other), created on first use, removed at exit.

    Locked: sidecars are often started from several threads at once, and two
    threads that both created a directory gave their sidecars different keys
    (every handshake between them then failed CURVE, as a "protocol" error)."""
    global _fleet_keys
    with _fleet_keys_lock:
        if _fleet_keys is None:
            d = tempfile.mkdtemp(prefix="kvs-fleet-keys-")
            atexit.register(shutil.rmtree, d, True)
            generate_keys(d)
            _fleet_keys = d
        return _fleet_keys


def member_keys(parent: Path, names: Sequence[str]) -> dict[str, str]:
    """A key directory per member (each its own CURVE keypair), every one
    admitting all of the members' public keys: a fleet with member identity.
    Pass each as ``--peer-keys``."""
    dirs = {n: parent / f"keys-{n}" for n in names}
    for d in dirs.values():
        generate_keys(d)
    for d in dirs.values():
        for n, other in dirs.items():
            shutil.copy(other / "sidecar.key", d / "authorized" / f"{n}.key")
    return {n: str(d) for n, d in dirs.items()}


class SidecarProcess:
    """One ``kvsidecar serve`` child process; logs go to ``<workdir>/<name>.log``."""

    def __init__(self, workdir: Path, name: str, *, args: Sequence[str] = (),
                 env: dict[str, str] | None = None, launcher: Sequence[str] = ()) -> None:
        """``launcher`` prefixes the command, e.g. ``["prlimit", "--nofile=1024", "--"]``."""
        self.name = name
        self.launcher = list(launcher)
        self.socket = str(workdir / f"{name}.sock")
        self.log_path = workdir / f"{name}.log"
        self.args = list(args)
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        #: ``host:port`` of the handshake port (what a raw ZMQ client connects to)
        self.handshake = ""
        #: the address the sidecar advertises: ``host:port/<its CURVE key>``
        self.handshake_address = ""
        self.metrics_port = -1
        #: the READY line's fields (version, socket, handshake, ...) of the last start
        self.ready: dict[str, Any] = {}
        self._log: IO[str] | None = None
        self._terminated = False

    def start(self, timeout_s: float = 60.0) -> SidecarProcess:
        self._log = open(self.log_path, "a")  # noqa: SIM115 - closed in stop()
        self._terminated = False  # a restart: the new process gets its own SIGTERM
        env = {**os.environ, **(self.env or {})}
        env.setdefault("PYTHONUNBUFFERED", "1")
        # Many sidecars start at once in tests: skip the start-up loopback READ
        # (a child process importing NIXL each) unless a test asks for it.
        env.setdefault("KVSIDECAR_TRANSPORT_CHECK", "off")
        keys: list[str] = []
        if not ({"--peer-keys", "--insecure-peers"} & set(self.args)
                or "KVSIDECAR_PEER_KEYS" in env):
            keys = ["--peer-keys", fleet_keys()]  # authenticated, like production
        self.proc = subprocess.Popen(
            [*self.launcher, sys.executable, "-m", "kvsidecar", "serve", "--socket", self.socket,
             "--handshake-host", "127.0.0.1", "--handshake-port", "0", *keys, *self.args],
            stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
        )
        ready: dict[str, Any] = {}
        got = threading.Event()

        def pump(out: IO[str]) -> None:
            for line in out:
                if line.startswith("KVSIDECAR READY ") and not got.is_set():
                    ready.update(json.loads(line[len("KVSIDECAR READY "):]))
                    got.set()

        assert self.proc.stdout is not None
        threading.Thread(target=pump, args=(self.proc.stdout,), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not got.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"sidecar {self.name} did not start; log:\n{self.read_log()}")
        self.handshake_address = str(ready["handshake"])
        self.handshake = self.handshake_address.split("/", 1)[0]
        self.metrics_port = int(ready["metrics_port"])
        self.ready = ready
        return self

    def read_log(self) -> str:
        try:
            return self.log_path.read_text()[-8000:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def metric(self, sample: str, **labels: str) -> float:
        """The sum of one sample over the series matching ``labels``, scraped from
        the sidecar's real /metrics: tests watch the daemon from outside, as an
        operator's Prometheus does, rather than reaching into its objects."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))

    def terminate(self) -> None:
        """Send SIGTERM once: a second one could land after the event loop (and its
        handler) is gone and kill the process mid-cleanup."""
        if self.proc is not None and self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None:
            return 0
        self.terminate()
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        if self._log:
            self._log.close()
        self._remove_segments()
        return rc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._remove_segments()

    def _remove_segments(self) -> None:
        """Unlink what a sidecar that died (killed, or aborted in UCX) left in
        /dev/shm, as its next start on this socket would: tests that kill
        sidecars otherwise leak hundreds of MiB of tmpfs (RAM) per suite run."""
        if self.proc is not None and self.proc.poll() is not None:
            remove_stale_segments(shm_prefix_for(self.socket))


@dataclass
class Sent:
    """What P hands D for one request (vLLM's kv_transfer_params)."""

    request_id: str
    remote: RemoteEngine
    block_ids: list[list[int]]
    req: Request
    #: each P rank's hold token (``Held.token``), filled when the request is held
    tokens: list[str] = field(default_factory=list)


@dataclass
class Receiving:
    request_id: str
    sent: Sent
    block_ids: list[list[int]]
    skip_tokens: int
    done: dict[int, Completion] = field(default_factory=dict)


def _spec(rec: Receiving) -> ReadSpec:
    """The read of ``rec`` as :meth:`SimEngine.start_reads` and the other ways of
    starting several send it: ids, skip and length explicit."""
    return ReadSpec(rec.request_id, rec.block_ids, rec.sent.remote, rec.sent.block_ids,
                    remote_request_id=rec.sent.request_id, skip_tokens=rec.skip_tokens,
                    num_tokens=rec.sent.req.prompt_tokens, remote_tokens=rec.sent.tokens)


class SimEngine:
    """One engine of ``tp`` ranks, each served by its own sidecar."""

    def __init__(self, engine_id: str, make: MakeLayout, tp: int, num_blocks: int,
                 sidecars: Sequence[SidecarProcess | str], *, attach: bool = False,
                 timeout_s: float = 30.0, memory: MemoryKind = "memfd",
                 reserve: bool = False) -> None:
        if len(sidecars) != tp:
            raise ValueError(f"engine {engine_id}: {tp} ranks need {tp} sidecars")
        self.engine_id = engine_id
        self.tp = tp
        self.layout = make(tp, num_blocks)
        self.clients = [SidecarClient(s if isinstance(s, str) else s.socket, timeout_s=timeout_s)
                        for s in sidecars]
        self.registrations: list[Registration] = []
        self._own: list[list[ShmRegion]] = []
        self._reserved: list[Region] = []
        for rank, client in enumerate(self.clients):
            if reserve:
                # The vLLM path (integrations/vllm/pool.py): one reservation, the KV buffer carved
                # from it, the layout's regions registered as views at gapped offsets.
                stride = self.layout.region_bytes + 4096
                res = client.reserve(engine_id, stride * self.layout.num_regions + 4096,
                                     memory)
                self._reserved.append(res)
                views = [RegionView(res, 4096 + i * stride, self.layout.region_bytes)
                         for i in range(self.layout.num_regions)]
                self.registrations.append(client.register(engine_id, rank, self.layout,
                                                          regions=views))
            elif attach:
                mine = allocate_for_layout(self.layout, f"{ENGINE_SHM_PREFIX}{engine_id}-{rank}")
                self._own.append(mine)
                self.registrations.append(client.register(engine_id, rank, self.layout,
                                                          regions=mine))
            else:
                self.registrations.append(client.register(engine_id, rank, self.layout,
                                                          allocate=True, memory=memory))
        # Host memory is checked in place; GPU memory through host mirrors that
        # prefill pushes to the GPU and verify pulls back (the oracle is numpy).
        self.buffers = [[r.numpy() if r.mem_type == "DRAM" else np.empty(r.nbytes, np.uint8)
                         for r in reg.regions] for reg in self.registrations]
        for rank, bufs in enumerate(self.buffers):
            for b in bufs:
                b[:] = POISON
            self._push(rank)
        self._free = list(range(num_blocks))
        self.receiving: dict[str, Receiving] = {}
        self.completions: dict[int, list[Completion]] = {r: [] for r in range(tp)}

    # ------------------------------------------------------------ both roles

    @property
    def remote(self) -> RemoteEngine:
        return RemoteEngine(self.engine_id, self.tp,
                            [r.handshake_address for r in self.registrations])

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"engine {self.engine_id}: out of blocks ({n} > {len(self._free)})")
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, ids: list[list[int]]) -> None:
        """Poison the blocks and give them back; in GPU regions too, not only in
        their host mirrors: verify pulls whole regions and wants poison in every
        block a request does not name (other blocks' bytes are left alone)."""
        pb = self.layout.page_bytes
        for group in ids:
            for b in group:
                for bufs in self.buffers:
                    for buf in bufs:
                        buf[b * pb:(b + 1) * pb] = POISON
        gpu = [r for reg in self.registrations for r in reg.regions if r.mem_type == "VRAM"]
        if gpu:
            import torch

            for r in gpu:
                t = r.torch()  # type: ignore[attr-defined]
                for group in ids:
                    for b in group:
                        t[b * pb:(b + 1) * pb].fill_(POISON)
            # synchronize() alone waits for the current device only
            for index in sorted({r.device.index for r in gpu}):
                torch.cuda.synchronize(index)
        self.release_blocks(ids)

    def blocks_for(self, tokens: int, mamba_pages: int = 1) -> list[list[int]]:
        ids = []
        for g in self.layout.groups:
            if g.kind == "attention":
                per = g.sub_blocks * g.block_tokens
                ids.append(self.alloc(-(-tokens // per) if tokens > 0 else 0))
            else:
                ids.append(self.alloc(mamba_pages if tokens > 0 else 0))
        return ids

    def poll(self) -> None:
        for rank, c in enumerate(self.clients):
            self.completions[rank].extend(c.poll(self.engine_id))

    def wait_for(self, request_ids: Sequence[str], timeout_s: float = 60.0
                 ) -> dict[str, dict[int, Completion]]:
        """Poll every rank until each request has a completion on every rank."""
        want = set(request_ids)
        got: dict[str, dict[int, Completion]] = {r: {} for r in want}
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            for rank, items in self.completions.items():
                keep = []
                for c in items:
                    if c.request_id in want:
                        got[c.request_id][rank] = c
                    else:
                        keep.append(c)
                self.completions[rank] = keep
            if all(len(v) == self.tp for v in got.values()):
                return got
            if time.monotonic() > deadline:
                missing = {r: sorted(set(range(self.tp)) - set(v)) for r, v in got.items()
                           if len(v) < self.tp}
                raise TimeoutError(f"engine {self.engine_id}: no completion for {missing}")
            time.sleep(0.002)

    def close(self) -> None:
        for c in self.clients:
            with contextlib.suppress(Exception):
                c.deregister(self.engine_id)
            c.close()
        for reg in self.registrations:
            for r in reg.regions:
                r.close()
        for mine in self._own:
            for r in mine:
                r.close()
                r.unlink()
        for res in self._reserved:
            res.close()

    def register_again(self, rank: int) -> None:
        """Deregister ``rank`` and register it again with fresh memory (a new
        agent, new regions), as an engine rank that restarted does: links
        readers made to it before are stale from now on."""
        c = self.clients[rank]
        c.deregister(self.engine_id)
        for r in self.registrations[rank].regions:
            r.close()
        reg = c.register(self.engine_id, rank, self.layout, allocate=True)
        self.registrations[rank] = reg
        self.buffers[rank] = [r.numpy() for r in reg.regions]

    # ------------------------------------------------------------ P role

    def prefill(self, request_id: str, req: Request, *, readers: int = 1,
                timeout_s: float | None = None, hold: bool = True,
                fill: bool = True) -> Sent:
        """Fill the request's blocks with the oracle's bytes on every rank and hold
        them. ``fill=False`` holds the blocks as they are (POISON): for the
        mid-transfer fault tests, where hashing 384 MiB would take minutes on two
        cores and only what lands after a failure matters."""
        ids = self.blocks_for(req.prompt_tokens)
        sent = Sent(request_id, self.remote, ids, req)
        for rank in range(self.tp):
            if fill:
                fill_shard(self.buffers[rank], self.layout, rank, ids, req)
                self._push(rank)
            if hold:
                sent.tokens.append(self.clients[rank].hold(
                    self.engine_id, request_id, ids, readers=readers, timeout_s=timeout_s).token)
        if not hold:
            # Held later (or never): the engine issues the tokens itself with each
            # rank's hold key, as vLLM's scheduler does before its workers hold.
            sent.tokens.extend(self.issue_tokens(request_id, ids))
        return sent

    def issue_tokens(self, request_id: str, block_ids: list[list[int]],
                     life_s: float = 600.0) -> list[str]:
        """Every rank's hold token for ``request_id``'s ``block_ids``, issued here."""
        expires = math.ceil(time.time() + life_s)
        return hold_token.issue_all([reg.hold_key for reg in self.registrations],
                                    self.engine_id, request_id, block_ids, expires)

    def hold_many(self, sents: Sequence[Sent], *, readers: int = 1, wait: bool = True) -> None:
        """Hold several prefilled requests (``prefill(..., hold=False)``) in one
        message per rank (``hold_many``), as a scheduler step would.
        ``wait=False``: ``hold_many_nowait``, the tokens the engine's own (as
        ``prefill`` issued them); a refusal comes from :meth:`poll`."""
        specs = [HoldSpec(x.request_id, x.block_ids, readers=readers) for x in sents]
        if not wait:
            for rank in range(self.tp):
                self.clients[rank].hold_many_nowait(self.engine_id, specs)
            return
        for x in sents:
            x.tokens.clear()
        for rank in range(self.tp):
            out = self.clients[rank].hold_many(self.engine_id, specs)
            refused = [e for e in out if isinstance(e, Exception)]
            if refused:
                raise refused[0]
            for x, held in zip(sents, out):
                assert not isinstance(held, Exception)
                x.tokens.append(held.token)

    def hold_nowait(self, sents: Sequence[Sent], *, readers: int = 1) -> None:
        """Hold prefilled requests (``prefill(..., hold=False)``: their tokens
        are the engine's own), one ``hold`` message each, none waiting for its
        answer (``hold_nowait``). A refusal comes from :meth:`poll` as a
        ``failed`` completion of the hold's request id."""
        for rank in range(self.tp):
            for x in sents:
                self.clients[rank].hold_nowait(self.engine_id, x.request_id, x.block_ids,
                                               readers=readers)

    # ------------------------------------------------------------ D role

    def start_read(self, sent: Sent, *, request_id: str | None = None, skip_blocks: int = 0,
                   full_hit: bool = False, explicit_skip: bool = True,
                   trim: bool = True, verify: bool = False) -> Receiving:
        rec = self._receive(sent, request_id, skip_blocks, full_hit)
        for rank in range(self.tp):
            self.clients[rank].read(self.engine_id, rec.request_id, rec.block_ids, sent.remote,
                                    sent.block_ids, remote_request_id=sent.request_id,
                                    skip_tokens=rec.skip_tokens if explicit_skip else None,
                                    num_tokens=sent.req.prompt_tokens if trim else None,
                                    verify=verify, remote_tokens=sent.tokens)
        return rec

    def start_reads(self, sents: Sequence[Sent], *, wait: bool = True) -> list[Receiving]:
        """Start several reads in one message per rank (``read_many``;
        ``wait=False``: ``read_many_nowait``, a refusal from :meth:`poll`)."""
        recs = [self._receive(sent, None, 0, False) for sent in sents]
        specs = [_spec(rec) for rec in recs]
        if not wait:
            for rank in range(self.tp):
                self.clients[rank].read_many_nowait(self.engine_id, specs)
            return recs
        for rank in range(self.tp):
            refused = [e for e in self.clients[rank].read_many(self.engine_id, specs) if e]
            if refused:
                raise refused[0]
        return recs

    def start_reads_nowait(self, sents: Sequence[Sent]) -> list[Receiving]:
        """Start several reads, one ``read`` message each, none waiting for its
        answer (``read_nowait``): what a blocking engine issuing a step's reads
        one by one does without a round trip each. A refusal comes from
        :meth:`poll` as a ``failed`` completion."""
        recs = [self._receive(sent, None, 0, False) for sent in sents]
        specs = [_spec(rec) for rec in recs]
        for rank in range(self.tp):
            for spec in specs:
                # a ReadSpec's fields are read_nowait()'s arguments after the engine id
                self.clients[rank].read_nowait(self.engine_id, **vars(spec))
        return recs

    async def start_reads_at_once(self, clients: Sequence[AsyncSidecarClient],
                                  sents: Sequence[Sent]) -> list[Receiving]:
        """Start several reads, one ``read`` message each, all sent before any
        reply is awaited (``clients``: an async client per rank, to this engine's
        sidecars): what an asyncio engine issuing a step's reads concurrently
        does. The first refusal is raised once every read was answered."""
        if len(clients) != self.tp:
            raise ValueError(f"engine {self.engine_id}: {self.tp} ranks need {self.tp} clients")
        recs = [self._receive(sent, None, 0, False) for sent in sents]
        specs = [_spec(rec) for rec in recs]
        # a ReadSpec's fields are read()'s arguments after the engine id, by name
        calls = [client.read(self.engine_id, **vars(spec)) for client in clients for spec in specs]
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome
        return recs

    def _receive(self, sent: Sent, request_id: str | None, skip_blocks: int,
                 full_hit: bool) -> Receiving:
        """Blocks for one request to land in (remembered for verify)."""
        rid = request_id or sent.request_id
        skip = 0
        ids: list[list[int]] = []
        for g in self.layout.groups:
            if full_hit:
                ids.append([])
            elif g.kind == "attention":
                per = g.sub_blocks * g.block_tokens
                skip = skip_blocks * per
                ids.append(self.alloc(-(-(sent.req.prompt_tokens - skip) // per)))
            else:
                ids.append(self.alloc(1))
        rec = Receiving(rid, sent, ids, skip)
        self.receiving[rid] = rec
        return rec

    def read_exactly(self, src: SimEngine, prefix: str, seed: int,
                     tokens: Sequence[int] = (5, 77, 200)) -> list[str]:
        """Read a prefill of ``src`` per prompt length in ``tokens`` (request ids
        ``{prefix}-{i}``, seeds ``seed + i``), wait for all of them and check each
        was received with the oracle's bytes (AssertionError naming the first
        problems otherwise); returns the request ids."""
        rids = []
        for i, n in enumerate(tokens):
            rid = f"{prefix}-{i}"
            self.start_read(src.prefill(rid, Request(seed=seed + i, prompt_tokens=n)))
            rids.append(rid)
        got = self.wait_for(rids)
        for rid in rids:
            assert {c.kind for c in got[rid].values()} == {"received"}, got[rid]
            problems = self.verify(rid)
            assert not problems, f"{rid}: " + "; ".join(problems[:3])
        return rids

    def verify(self, rid: str) -> list[str]:
        """The oracle's verdict on every rank's pages for one received request."""
        rec = self.receiving[rid]
        others = {b for r, o in self.receiving.items() if r != rid
                  for g in o.block_ids for b in g}
        problems = []
        for rank in range(self.tp):
            self._pull(rank)
            problems += [f"rank {rank}: {p}" for p in check_received(
                self.buffers[rank], self.layout, rank, rec.block_ids, rec.sent.req,
                rec.skip_tokens, ignore_blocks=others)]
        return problems

    def _push(self, rank: int) -> None:
        """Copy GPU regions' host mirrors to the GPU (host regions are the memory)."""
        for r, b in zip(self.registrations[rank].regions, self.buffers[rank]):
            if r.mem_type == "VRAM":
                import torch

                r.torch().copy_(torch.from_numpy(b))  # type: ignore[attr-defined]
                torch.cuda.synchronize(r.device.index)  # the region's GPU, not the current

    def _pull(self, rank: int) -> None:
        for r, b in zip(self.registrations[rank].regions, self.buffers[rank]):
            if r.mem_type == "VRAM":
                b[:] = r.torch().cpu().numpy()  # type: ignore[attr-defined]

    def finish(self, rid: str) -> None:
        rec = self.receiving.pop(rid)
        self.free(rec.block_ids)

    def release_blocks(self, ids: list[list[int]]) -> None:
        """Give blocks back without poisoning them (:meth:`free` does): for a
        benchmark whose timed window should hold the sidecars' work, not the
        engine's memset of every received block."""
        for group in ids:
            self._free.extend(group)


@contextlib.contextmanager
def engine_pair(tmp_path: Path, name: str, layout: MakeLayout, args: Sequence[str] = (),
                num_blocks: int = 200) -> Iterator[tuple[SimEngine, SimEngine, SidecarProcess]]:
    """A P and a D engine (tp 1, ``{name}-P`` and ``{name}-D``), each on a sidecar
    of its own started with ``args``; yields P, D and D's sidecar. At the end
    both engines close and both sidecars must stop cleanly (exit code 0)."""
    p = SidecarProcess(tmp_path, f"{name}-p", args=list(args)).start()
    d = None
    P = D = None
    try:
        d = SidecarProcess(tmp_path, f"{name}-d", args=list(args)).start()
        P = SimEngine(f"{name}-P", layout, 1, num_blocks, [p])
        D = SimEngine(f"{name}-D", layout, 1, num_blocks, [d])
        yield P, D, d
    finally:
        for e in (D, P):
            if e is not None:
                e.close()
        codes = {"p": p.stop(), "d": d.stop() if d is not None else 0}
        assert codes == {"p": 0, "d": 0}, codes


def stop_once_posted(d: SidecarProcess, p: SidecarProcess, engine_id: str, posted: int,
                     timeout_s: float = 60.0, *, after_s: float = 0.05) -> None:
    """SIGSTOP ``p`` once ``d`` (started with ``--metrics-port``) has posted the
    ``posted``-th read of ``engine_id`` (its lease claim answered), plus
    ``after_s``: 50 ms by default, so a stop lands in the middle of a big
    transfer, after its first bytes; 0 where the transfer must still be
    pending when P stops (see :func:`stop_mid_read`)."""
    assert p.proc is not None
    deadline = time.monotonic() + timeout_s
    while d.metric("kvsidecar_read_queue_seconds_count", engine=engine_id) < posted:
        if time.monotonic() > deadline:
            raise AssertionError(f"read {posted} of {engine_id} was never posted")
        time.sleep(0.005)
    time.sleep(after_s)
    os.kill(p.proc.pid, signal.SIGSTOP)


def stop_mid_read(d: SidecarProcess, p: SidecarProcess, reader: SimEngine, posted: int,
                  rids: Sequence[str], lapses: int, timeout_s: float = 60.0) -> bool:
    """Stop ``p`` once ``d`` posted the ``posted``-th read of ``reader`` and keep
    it stopped until D's log counts ``lapses`` lease lapses (True), or until one
    of ``rids`` completed at D (False): its transfer ended before the stop
    landed, so no lease could run out mid-read. P is resumed before this
    returns. Why both: 384 MiB over loopback TCP end ~0.2 s after the post
    (load 0.8), which a loaded host's scheduling of the test can outlast, and
    nothing outside D says a transfer is still pending when P stops; a caller
    tries again on False rather than waiting for a lapse that cannot come."""
    assert p.proc is not None
    stop_once_posted(d, p, reader.engine_id, posted, timeout_s, after_s=0.0)
    deadline = time.monotonic() + timeout_s
    try:
        while d.log_path.read_text().count("lease lapsed") < lapses:
            reader.poll()
            if any(c.request_id in rids for got in reader.completions.values() for c in got):
                return False
            if time.monotonic() > deadline:
                raise AssertionError("D never noticed its lease ran out")
            time.sleep(0.05)
        return True
    finally:
        os.kill(p.proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def all_running(groups: dict[str, list[SidecarProcess]]
                ) -> Iterator[dict[str, list[SidecarProcess]]]:
    """Start every sidecar of ``groups`` and yield them; stop them all after,
    and fail (AssertionError naming them) if any did not exit with status 0."""
    every = [s for group in groups.values() for s in group]
    try:
        for s in every:
            s.start()
        yield groups
    finally:
        codes = {s.name: s.stop() for s in every}
        assert not {k: v for k, v in codes.items() if v != 0}, codes


@contextlib.contextmanager
def engines(p_sidecars: Sequence[SidecarProcess], d_sidecars: Sequence[SidecarProcess],
            uid: Callable[[str], str], make: MakeLayout, p_tp: int, d_tp: int, *,
            n_d: int = 1, attach: bool = False, blocks: int = 96,
            memory: MemoryKind = "memfd", d_memory: MemoryKind | None = None,
            reserve: bool = False) -> Iterator[tuple[SimEngine, list[SimEngine]]]:
    """A P engine of ``p_tp`` ranks and ``n_d`` D engines of ``d_tp`` ranks, closed after."""
    made: list[SimEngine] = []
    try:
        P = SimEngine(uid("P"), make, p_tp, blocks, p_sidecars[:p_tp], attach=attach,
                      memory=memory, reserve=reserve)
        made.append(P)
        ds = []
        for _ in range(n_d):
            D = SimEngine(uid("D"), make, d_tp, blocks, d_sidecars[:d_tp], attach=attach,
                          memory=memory if d_memory is None else d_memory, reserve=reserve)
            made.append(D)
            ds.append(D)
        yield P, ds
    finally:
        for e in made:
            e.close()
