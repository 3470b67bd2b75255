"""Byte verification (``--verify-bytes``, ``read(verify=True)``) between real sidecars.

Real ``kvsidecar serve`` processes (real NIXL/UCX, real ZMQ, shared memory),
every received byte checked with the LAYOUT.md oracle. Corruption on the
wire cannot be caused on one host, so one FAKE FAULT stands for it: D
sidecars started with ``KVSIDECAR_FAKE_FAULT_FLIP_LANDED_BYTE=corrupt-``
flip one landed byte of every verified read whose request id starts with
``corrupt-``, before hashing it. The sidecars are shared by the module; D
rank 0's sidecar stages every read (``--staging always``), so the 2->1 reads
verify what was scattered from staging memory; D rank 1's verifies every read
(``--verify-bytes``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvsidecar.daemon import digest
from kvsidecar.daemon.digest import FAKE_FAULT_ENV
from kvsidecar.daemon.peer_auth import load_keys
from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.peers.control import Claim, ControlReply, Digest
from kvsidecar.daemon.verify import MAX_DIGEST_BYTES_IN_FLIGHT
from kvsidecar.ipc import hold_token, protocol, seqpacket
from kvsidecar.ipc.client import AsyncSidecarClient, ReadSpec, SidecarClient, Unavailable
from kvsidecar.ipc.layout import Layout, attention_layout
from kvsidecar.ipc.protocol import Completion, RemoteEngine
from kvsidecar.sim.cluster import SidecarProcess, SimEngine, engines, fleet_keys
from kvsidecar.sim.models import MakeLayout, attn, hybrid, mla
from kvsidecar.sim.oracle import Request

pytestmark = pytest.mark.e2e

FAMILIES: dict[str, MakeLayout] = {"attention": attn(2), "mla": mla, "hybrid": hybrid}
CASES = [pytest.param(f, p, d, id=f"{f}-{p}p{d}d") for f in FAMILIES for p, d in ((1, 2), (2, 1))]
VERIFIED = "kvsidecar_verified_bytes_total"
FAILURES = "kvsidecar_verify_failures_total"


class Sidecars:
    def __init__(self, workdir: Path) -> None:
        fault = {FAKE_FAULT_ENV: "corrupt-"}
        self.p = [SidecarProcess(workdir, f"vp{i}", args=["--metrics-port", "0"])
                  for i in range(2)]
        self.d = [SidecarProcess(workdir, "vd0", env=fault,
                                 args=["--metrics-port", "0", "--staging", "always",
                                       "--staging-bytes", str(16 << 20)]),
                  SidecarProcess(workdir, "vd1", env=fault,
                                 args=["--metrics-port", "0", "--verify-bytes"])]
        self._ids = itertools.count()

    def uid(self, prefix: str) -> str:
        return f"v{prefix}{next(self._ids)}"

    def metric(self, name: str, **labels: str) -> float:
        return sum(d.metric(name, **labels) for d in self.d)


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecars]:
    s = Sidecars(tmp_path_factory.mktemp("verify"))
    try:
        for proc in s.p + s.d:
            proc.start()
        yield s
    finally:
        codes = {proc.name: proc.stop() for proc in s.p + s.d}
        assert all(c == 0 for c in codes.values()), codes


def _one_read(s: Sidecars, family: str, p_tp: int, d_tp: int, rid: str, seed: int,
              skip_blocks: int = 0) -> tuple[SimEngine, SimEngine, dict[int, Completion],
                                             dict[int, Completion], list[list[int]]]:
    """P prefills and holds one request, D reads it verified; both sides' completions."""
    with engines(s.p, s.d, s.uid, FAMILIES[family], p_tp, d_tp) as (P, (D,)):
        sent = P.prefill(rid, Request(seed=seed, prompt_tokens=77))
        rec = D.start_read(sent, skip_blocks=skip_blocks, verify=True)
        got = D.wait_for([rid])[rid]
        held = P.wait_for([rid])[rid]
        problems = D.verify(rid) if {c.kind for c in got.values()} == {"received"} else []
        assert not problems, "; ".join(problems[:3])
        return P, D, got, held, rec.block_ids


@pytest.mark.parametrize(("family", "p_tp", "d_tp"), CASES)
def test_verified_read_is_exact(sidecars: Sidecars, family: str, p_tp: int, d_tp: int) -> None:
    before = sidecars.metric(VERIFIED)
    *_, got, held, _ = _one_read(sidecars, family, p_tp, d_tp, f"ok-{family}-{p_tp}{d_tp}",
                                 seed=10 * p_tp + d_tp)
    assert {c.kind for c in got.values()} == {"received"}, got
    assert {c.kind for c in held.values()} == {"sent"}, held
    # Every byte the read moved was hashed on D and matched P's digest.
    assert sidecars.metric(VERIFIED) - before == sum(c.nbytes for c in got.values()) > 0


@pytest.mark.parametrize(("family", "p_tp", "d_tp"), CASES)
def test_flipped_byte_fails_the_read(sidecars: Sidecars, family: str, p_tp: int,
                                     d_tp: int) -> None:
    before = sidecars.metric(FAILURES, reason="mismatch")
    *_, got, held, blocks = _one_read(sidecars, family, p_tp, d_tp,
                                      f"corrupt-{family}-{p_tp}{d_tp}", seed=7)
    for rank, c in got.items():
        assert c.kind == "failed", (rank, c)
        assert "byte verification failed" in c.reason, c.reason
        assert c.invalid_block_ids == blocks
    # P was never told the read ended well: the readers abandoned, the hold aborted.
    assert {c.kind for c in held.values()} == {"aborted"}, held
    assert sidecars.metric(FAILURES, reason="mismatch") - before == d_tp


def test_verified_prefix_hit_is_exact(sidecars: Sidecars) -> None:
    """D already holds the first block: the digest covers the tail it reads."""
    *_, got, _, _ = _one_read(sidecars, "hybrid", 1, 2, "ok-skip", seed=3, skip_blocks=1)
    assert {c.kind for c in got.values()} == {"received"}, got


def _big(tp: int, nb: int) -> Layout:
    """256 KiB per block over 4 regions: 64 blocks are a 16 MiB read."""
    return attention_layout(model="verify-big", num_layers=4, total_kv_heads=8, head_dim=128,
                            block_tokens=16, tp_size=tp, num_blocks=nb)


@pytest.mark.parametrize("rid", ["ok-big", "corrupt-big"])
def test_large_read_hashed_as_it_lands(sidecars: Sidecars, rid: str) -> None:
    """A read of 16 MiB from one P rank travels in parts that D hashes as each
    lands (reads.pipeline): exact when intact, failed when a byte flipped."""
    p, d = sidecars.p[1:], sidecars.d[1:]  # D without staging: the pipelined path
    with engines(p, d, sidecars.uid, _big, 1, 1, blocks=64) as (P, (D,)):
        sent = P.prefill(rid, Request(seed=11, prompt_tokens=64 * 16))
        before = d[0].metric(VERIFIED)
        rec = D.start_read(sent, verify=True)
        got = D.wait_for([rid])[rid]
        if rid.startswith("ok"):
            assert {c.kind for c in got.values()} == {"received"}, got
            assert got[0].nbytes == 16 << 20
            assert d[0].metric(VERIFIED) - before == 16 << 20
            assert not D.verify(rid)
        else:
            assert got[0].kind == "failed" and "byte verification failed" in got[0].reason
            assert got[0].invalid_block_ids == rec.block_ids


def test_staged_reads_were_verified(sidecars: Sidecars) -> None:
    """The 2->1 reads above landed through D rank 0's staging memory."""
    assert sidecars.d[0].metric("kvsidecar_staged_transfers_total") > 0


def test_the_flag_verifies_every_read(sidecars: Sidecars) -> None:
    """On a sidecar started with --verify-bytes a read that does not ask is verified:
    the fake fault fails it, an intact one is received with its bytes counted."""
    d = sidecars.d[1:]
    with engines(sidecars.p, d, sidecars.uid, FAMILIES["mla"], 1, 1) as (P, (D,)):
        before = d[0].metric(VERIFIED)
        for rid in ("ok-flag", "corrupt-flag"):
            D.start_read(P.prefill(rid, Request(seed=6, prompt_tokens=40)))  # verify=False
        got = D.wait_for(["ok-flag", "corrupt-flag"])
        assert got["ok-flag"][0].kind == "received" and not D.verify("ok-flag")
        assert d[0].metric(VERIFIED) - before == got["ok-flag"][0].nbytes > 0
        assert got["corrupt-flag"][0].kind == "failed"
        assert "byte verification failed" in got["corrupt-flag"][0].reason


def test_read_many_verifies_each_read_that_asks(sidecars: Sidecars) -> None:
    """``read_many`` with ``ReadSpec(verify=True)``: each read of the batch is
    verified on its own (one corrupt, one intact, one unverified)."""
    with engines(sidecars.p, sidecars.d, sidecars.uid, FAMILIES["hybrid"], 1, 1) as (P, (D,)):
        sents = [P.prefill(rid, Request(seed=i, prompt_tokens=50)) for i, rid in
                 enumerate(("ok-many", "corrupt-many", "corrupt-unverified-many"))]
        recs = [D._receive(s, None, 0, False) for s in sents]
        specs = [ReadSpec(r.request_id, r.block_ids, r.sent.remote, r.sent.block_ids,
                          skip_tokens=0, num_tokens=r.sent.req.prompt_tokens,
                          verify=not r.request_id.endswith("unverified-many"),
                          remote_tokens=r.sent.tokens)
                 for r in recs]
        assert D.clients[0].read_many(D.engine_id, specs) == [None, None, None]
        got = D.wait_for([r.request_id for r in recs])
        assert got["ok-many"][0].kind == "received" and not D.verify("ok-many")
        assert got["corrupt-many"][0].kind == "failed"
        assert got["corrupt-many"][0].invalid_block_ids == recs[1].block_ids
        assert got["corrupt-unverified-many"][0].kind == "received"
        assert not D.verify("corrupt-unverified-many")


def test_async_client_asks_for_verification(sidecars: Sidecars) -> None:
    """The asyncio client's ``read(verify=True)`` (the same core as the sync one)."""
    with engines(sidecars.p, sidecars.d, sidecars.uid, FAMILIES["attention"], 1, 1) as (
            P, (D,)):
        sent = P.prefill("corrupt-async", Request(seed=3, prompt_tokens=30))
        rec = D._receive(sent, None, 0, False)

        async def read() -> None:
            client = AsyncSidecarClient(sidecars.d[0].socket)
            try:
                await client.read(D.engine_id, rec.request_id, rec.block_ids, sent.remote,
                                  sent.block_ids, num_tokens=30, skip_tokens=0, verify=True,
                                  remote_tokens=sent.tokens)
            finally:
                await client.close()

        asyncio.run(read())
        got = D.wait_for(["corrupt-async"])["corrupt-async"]
        assert got[0].kind == "failed" and "byte verification failed" in got[0].reason


def test_unverified_read_skips_the_fake_fault(sidecars: Sidecars) -> None:
    """The fault hook lives in the verification step only: an unverified read of a
    ``corrupt-`` id is received exact (the fault flips nothing it is not asked to catch)."""
    with engines(sidecars.p, sidecars.d, sidecars.uid, FAMILIES["attention"], 1, 1) as (P, (D,)):
        rid = "corrupt-unverified"
        D.start_read(P.prefill(rid, Request(seed=5, prompt_tokens=40)))
        got = D.wait_for([rid])[rid]
        assert {c.kind for c in got.values()} == {"received"}, got
        assert not D.verify(rid)


class Asker:
    """Digest (and claim) requests straight to P's sidecar, as a fleet member may send."""

    def __init__(self, p: SidecarProcess, engine: SimEngine) -> None:
        self.p, self.engine = p, engine
        self.client = HandshakeClient(keys=load_keys(fleet_keys()))
        self.agent = ""
        #: the blocks each request's token names (what P's engine handed its reader)
        self.blocks: dict[str, list[list[int]]] = {}

    async def __aenter__(self) -> Asker:
        info = await self.client.fetch(self.p.handshake, self.engine.engine_id, 0)
        self.agent = info.agent_name
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()

    def _ids(self, request_id: str) -> dict[str, object]:
        token = self.engine.issue_tokens(request_id, self.blocks.get(request_id, [[0]]))[0]
        return {"engine_id": self.engine.engine_id, "tp_rank": 0, "agent_name": self.agent,
                "request_id": request_id, "reader_engine": "someone", "reader_rank": 0,
                "reader_tp": 1, "token": token}

    async def claim(self, request_id: str) -> bool:
        answer = await self.client.control(self.p.handshake, Claim(**self._ids(request_id)))
        return answer.reply.granted

    async def digest(self, request_id: str, block: int,
                     pieces: list[tuple[int, int, int]] | None = None,
                     token: str | None = None) -> ControlReply:
        """One page of region 0 (or ``pieces``: region, offset, length); ``token``
        instead of the one P's engine issued."""
        page = self.engine.layout.page_bytes
        a = np.array(pieces or [(0, block * page, page)], dtype=np.int64)
        ranges = digest.pack_ranges(a[:, 0], a[:, 1], a[:, 2])
        ids = self._ids(request_id)
        if token is not None:
            ids["token"] = token
        answer = await self.client.control(self.p.handshake, Digest(
            **ids, ranges=ranges, chunk_bytes=digest.CHUNK_BYTES))
        return answer.reply


def test_digest_refused_outside_the_hold(sidecars: Sidecars) -> None:
    """P hashes only pages a live hold pins: a digest of anything else is refused."""
    with engines(sidecars.p, sidecars.d, sidecars.uid, FAMILIES["attention"], 1, 1) as (P, _):
        sent = P.prefill("held", Request(seed=9, prompt_tokens=8))
        held = sent.block_ids[0][0]
        free = next(b for b in range(P.layout.num_blocks) if b != held)

        async def run() -> list[ControlReply]:
            async with Asker(sidecars.p[0], P) as ask:
                page = P.layout.page_bytes
                again = [(0, held * page, page)] * (P.layout.num_regions + 1)
                return [await ask.digest("held", held), await ask.digest("held", free),
                        await ask.digest("no-such-request", held),
                        await ask.digest("held", held, pieces=again)]

        ok, outside, unheld, repeated = asyncio.run(run())
        assert not repeated.granted and "more bytes than the hold pins" in repeated.reason
        assert ok.granted and len(ok.digest) == 8
        assert not outside.granted and "outside the pages the hold pins" in outside.reason
        assert not outside.digest
        assert not unheld.granted and "no live hold" in unheld.reason
        P.clients[0].release(P.engine_id, "held")


def test_digest_needs_the_holds_token(sidecars: Sidecars) -> None:
    """Only a reader holding the token the hold issued may have P hash its pages,
    as only such a reader may claim it: a digest without it, or with a token of
    another key, is refused before anything is hashed."""
    with engines(sidecars.p, sidecars.d, sidecars.uid, FAMILIES["attention"], 1, 1) as (P, _):
        sent = P.prefill("tokened", Request(seed=6, prompt_tokens=8))
        held = sent.block_ids[0][0]
        forged = hold_token.issue(os.urandom(hold_token.KEY_BYTES), P.engine_id, "tokened",
                                  sent.block_ids, int(time.time()) + 600)

        async def run() -> list[ControlReply]:
            async with Asker(sidecars.p[0], P) as ask:
                ask.blocks["tokened"] = sent.block_ids
                return [await ask.digest("tokened", held, token=""),
                        await ask.digest("tokened", held, token=forged),
                        await ask.digest("tokened", held)]

        none, other_key, issued = asyncio.run(run())
        assert not none.granted and "digest of request 'tokened' carries no hold token" in (
            none.reason)
        assert not other_key.granted and "was not issued for request" in other_key.reason
        assert not none.digest and not other_key.digest
        assert issued.granted and len(issued.digest) == 8
        P.clients[0].release(P.engine_id, "tokened")


def test_digest_before_the_hold_is_refused_for_now(sidecars: Sidecars) -> None:
    """A digest for a request claimed before its hold (asynchronous scheduling)
    is refused at once with ``retry`` (P never waits), granted once it is held."""
    with engines(sidecars.p, sidecars.d, sidecars.uid, FAMILIES["attention"], 1, 1) as (P, _):
        sent = P.prefill("late", Request(seed=4, prompt_tokens=8), hold=False)
        block = sent.block_ids[0][0]

        async def run() -> tuple[ControlReply, ControlReply, ControlReply]:
            async with Asker(sidecars.p[0], P) as ask:
                ask.blocks["late"] = sent.block_ids
                never = await ask.digest("late", block)  # nobody claimed it: no hold at all
                assert await ask.claim("late")  # early: its hold is not placed yet
                early = await ask.digest("late", block)
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: P.clients[0].hold(P.engine_id, "late", sent.block_ids))
                return never, early, await ask.digest("late", block)

        never, early, held = asyncio.run(run())
        assert not never.granted and not never.retry and "no live hold" in never.reason
        assert not early.granted and early.retry and "not placed yet" in early.reason
        assert held.granted and len(held.digest) == 8
        P.clients[0].release(P.engine_id, "late")


def test_verified_read_before_the_hold_is_placed(sidecars: Sidecars) -> None:
    """D reads and compares while P's engine has not placed its hold yet: D asks
    again until it is, and the read is received exact."""
    with engines(sidecars.p[1:], sidecars.d[1:], sidecars.uid, FAMILIES["hybrid"], 1, 1) as (
            P, (D,)):
        sent = P.prefill("ok-late", Request(seed=8, prompt_tokens=77), hold=False)
        D.start_read(sent, verify=True)
        time.sleep(0.2)
        P.clients[0].hold(P.engine_id, "ok-late", sent.block_ids)
        got = D.wait_for(["ok-late"])["ok-late"]
        assert {c.kind for c in got.values()} == {"received"}, got
        assert not D.verify("ok-late")
        assert {c.kind for c in P.wait_for(["ok-late"])["ok-late"].values()} == {"sent"}


def test_digests_in_flight_are_bounded(sidecars: Sidecars) -> None:
    """Past MAX_DIGEST_BYTES_IN_FLIGHT hashing at once (here 32 requests of 64 MiB),
    P refuses more at once (for now: ``retry``) and counts them; those it hashed
    all agree."""
    n = 3 * MAX_DIGEST_BYTES_IN_FLIGHT // (64 << 20)
    with engines(sidecars.p, sidecars.d, sidecars.uid, _big, 1, 1, blocks=256) as (P, _):
        sent = P.prefill("many", Request(seed=2, prompt_tokens=256 * 16), fill=False)
        before = sidecars.p[0].metric("kvsidecar_limit_refusals_total", limit="digests")

        async def run() -> list[ControlReply]:
            async with Asker(sidecars.p[0], P) as ask:
                whole = P.layout.num_blocks * P.layout.page_bytes  # every region, whole
                return list(await asyncio.gather(*(
                    ask.digest("many", 0, pieces=[(r, 0, whole)
                                                  for r in range(P.layout.num_regions)])
                    for _ in range(n))))

        replies = asyncio.run(run())
        refused = [r for r in replies if not r.granted]
        assert refused and all(r.retry and "retry later" in r.reason for r in refused), \
            {r.reason for r in refused}
        assert len({r.digest for r in replies if r.granted}) == 1
        assert len(replies) - len(refused) >= MAX_DIGEST_BYTES_IN_FLIGHT // (64 << 20)
        after = sidecars.p[0].metric("kvsidecar_limit_refusals_total", limit="digests")
        assert after - before == len(refused)
        P.clients[0].release(P.engine_id, sent.request_id)


class OlderSidecar:
    """FAKE (a sidecar of an older release cannot be run from this checkout): the
    engine socket of a sidecar of protocol minor 6, from before ``Read.verify``,
    which decodes a read's ``verify`` as an unknown field and ignores it. It
    answers pings (minor 6) and accepts reads, recording whether each asked."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.reads: list[tuple[str, bool]] = []
        self._sock = seqpacket.new_socket()
        self._sock.bind(path)
        self._sock.listen()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        while data := conn.recv(seqpacket.RECV_BYTES):
            req = protocol.decode_request(data)
            reply: protocol.Reply
            if isinstance(req, protocol.Ping):
                reply = protocol.Pong(id=req.id, version=protocol.PROTOCOL_VERSION, minor=6)
            elif isinstance(req, protocol.Read):
                self.reads.append((req.request_id, req.verify))
                reply = protocol.Ok(id=req.id)
            else:
                reply = protocol.Error(id=req.id, code=protocol.BAD_MESSAGE, message="unknown op")
            conn.send(protocol.encode_reply(reply))

    def close(self) -> None:
        self._sock.close()
        for conn in self._conns:
            conn.close()


def test_a_sidecar_that_would_ignore_verify_is_never_asked(tmp_path: Path) -> None:
    """``read(verify=True)`` (and ``read_many`` with a verified read) against a
    sidecar of protocol minor < 7 raises Unavailable and sends nothing: that
    sidecar would read unverified and report ``received``, so the caller would
    take bytes nobody checked for verified ones. An unverified read still goes."""
    old = OlderSidecar(str(tmp_path / "old.sock"))
    remote = RemoteEngine("p", 1, ["127.0.0.1:1"])
    try:
        client = SidecarClient(old.path)
        with pytest.raises(Unavailable, match="verify"):
            client.read("e", "v1", [[1]], remote, [[1]], verify=True)
        with pytest.raises(Unavailable, match="verify"):
            client.read_many("e", [ReadSpec("v2", [[1]], remote, [[1]], verify=True)])
        client.read("e", "plain", [[1]], remote, [[1]])
        client.close()

        async def run() -> None:
            aclient = AsyncSidecarClient(old.path)
            try:
                with pytest.raises(Unavailable, match="verify"):
                    await aclient.read("e", "v3", [[1]], remote, [[1]], verify=True)
                with pytest.raises(Unavailable, match="verify"):
                    await aclient.read_many("e", [ReadSpec("v4", [[1]], remote, [[1]],
                                                           verify=True)])
            finally:
                await aclient.close()

        asyncio.run(run())
        assert old.reads == [("plain", False)]
    finally:
        old.close()
