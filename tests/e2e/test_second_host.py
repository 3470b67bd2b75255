"""A real second host: P and D sidecars in two network namespaces joined by a
veth pair, UCX over TCP on that link, every byte checked by the oracle; then
the link is cut (veth down) while the sidecars are linked, and the reads
that follow fail (their lease claims go unanswered) while P's holds expire.
Second test: the link is cut while a 384 MiB read is on the wire; D reports
exactly that read failed, no byte lands after the report (not even once the
link is back), P's hold ends at its lease bound, and D reads oracle-exact
bytes from the same P once the link is back.

Needs root (ip netns); skipped with the reason otherwise. Names are unique per
run and everything is removed afterwards; the only addresses used are the two
ends of the veth pair (a private /30 picked per run).
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvsidecar.sim.cluster import Sent, SidecarProcess, SimEngine, engines
from kvsidecar.sim.models import hybrid
from kvsidecar.sim.models import stall as stall_layout
from kvsidecar.sim.oracle import POISON, Request

pytestmark = pytest.mark.e2e

READ_TIMEOUT_S = 10


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Link:
    ns_p: str
    ns_d: str
    dev_p: str
    dev_d: str
    addr_p: str
    addr_d: str

    def cut(self) -> None:
        _ip("-n", self.ns_p, "link", "set", self.dev_p, "down")

    def restore(self) -> None:
        _ip("-n", self.ns_p, "link", "set", self.dev_p, "up")


@pytest.fixture
def link() -> Iterator[Link]:
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (ip netns)")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 (ip)")
    tag = secrets.token_hex(3)
    octet = secrets.randbelow(60) * 4
    third = secrets.randbelow(250)
    ln = Link(f"kvsP{tag}", f"kvsD{tag}", f"vp{tag}", f"vd{tag}",
              f"10.231.{third}.{octet + 1}", f"10.231.{third}.{octet + 2}")
    made: list[str] = []
    try:
        for ns in (ln.ns_p, ln.ns_d):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", ln.dev_p, "type", "veth", "peer", "name", ln.dev_d)
        for ns, dev, addr in ((ln.ns_p, ln.dev_p, ln.addr_p), (ln.ns_d, ln.dev_d, ln.addr_d)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield ln
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", ln.dev_p], capture_output=True, timeout=30)


def _sidecar(tmp: Path, name: str, ns: str, dev: str, addr: str, *extra: str) -> SidecarProcess:
    return SidecarProcess(
        tmp, name, launcher=["ip", "netns", "exec", ns],
        args=["--handshake-host", addr, "--transport-check", "off",
              "--read-timeout", str(READ_TIMEOUT_S), *extra],
        env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev},
    )


def test_every_byte_crosses_the_link_then_a_cut_fails_the_reads(link: Link,
                                                                 tmp_path: Path) -> None:
    p = _sidecar(tmp_path, "p", link.ns_p, link.dev_p, link.addr_p, "--hold-timeout", "20")
    d = _sidecar(tmp_path, "d", link.ns_d, link.dev_d, link.addr_d)
    p.start(timeout_s=240)
    d.start(timeout_s=240)
    ids = itertools.count()
    try:
        assert p.handshake.startswith(link.addr_p + ":")
        with engines([p], [d], lambda pre: f"{pre}{next(ids)}", hybrid, 1, 1,
                     blocks=256) as (P, (D,)):
            rids = [f"ok-{i}" for i in range(4)]
            for i, rid in enumerate(rids):
                D.start_read(P.prefill(rid, Request(seed=i, prompt_tokens=300)))
            got = D.wait_for(rids, timeout_s=180)
            for rid in rids:
                assert {c.kind for c in got[rid].values()} == {"received"}, got[rid]
                assert not D.verify(rid), D.verify(rid)[:3]
            assert {c.kind for c in P.wait_for(rids)[rid].values()} == {"sent"}

            # Cut the link while the two sidecars are linked (UCX endpoints up),
            # then read: the reads cannot reach P and must fail within the read
            # timeout, and P's holds must be released.
            cut = [f"cut-{i}" for i in range(4)]
            sents = [P.prefill(rid, Request(seed=100 + i, prompt_tokens=600))
                     for i, rid in enumerate(cut)]
            link.cut()
            t_cut = time.monotonic()
            for sent in sents:
                D.start_read(sent)
            got = D.wait_for(cut, timeout_s=READ_TIMEOUT_S + 120)
            waited = time.monotonic() - t_cut
            kinds = {rid: {c.kind for c in got[rid].values()} for rid in cut}
            assert all(k == {"failed"} for k in kinds.values()), kinds
            print(f"\nlink cut: {len(cut)}/{len(cut)} reads failed, the last {waited:.1f} s "
                  f"after the cut (read timeout {READ_TIMEOUT_S} s)")
            # P's holds of the failed reads are released, never sent: `expired` at
            # their deadline, since nothing D sends (claim, abandon) crosses the cut.
            p_got = P.wait_for(cut, timeout_s=120)
            for rid in cut:
                assert {c.kind for c in p_got[rid].values()} == {"expired"}, p_got[rid]
        assert p.alive() and d.alive()
    finally:
        p.stop()
        d.stop()


SENTINEL = 0x5A
FILL = 0x3C  # P's bytes of the big read: neither POISON (D's free blocks) nor SENTINEL
assert len({SENTINEL, FILL, POISON}) == 3
CUT_READ_TIMEOUT_S = 3
HANDSHAKE_TIMEOUT_S = 5  # the default
HOLD_LEASE_S = 10  # the default
BIG_HOLD_TIMEOUT_S = 5  # shorter than the lease: what keeps P's hold is D's claim


# Run inside D's namespace (its HTTP server listens on D's loopback).
# _WAIT_SAMPLE returns once one engine's sample on D's real /metrics reaches a value.
_WAIT_SAMPLE = """
import sys, time, urllib.request
from prometheus_client.parser import text_string_to_metric_families
port, sample, engine, target = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
deadline = time.monotonic() + 180
def value():
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == sample and s.labels.get("engine") == engine)
while value() < target:
    if time.monotonic() > deadline:
        sys.exit(f"{sample} of {engine} never reached {target}: {value()}")
    time.sleep(0.005)
"""
# _READYZ prints D's /readyz status and body.
_READYZ = """
import sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/readyz", timeout=10) as r:
        print(r.status, r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode())
"""


def _in_ns(ns: str, code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", code, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _done(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    return out


def _pages(eng: SimEngine, ids: list[list[int]]) -> list[np.ndarray]:
    page = eng.layout.page_bytes
    return [buf[b * page:(b + 1) * page] for buf in eng.buffers[0] for g in ids for b in g]


@pytest.mark.timeout(900)
def test_a_cut_mid_transfer_fails_that_read_and_nothing_lands_after(link: Link,
                                                                    tmp_path: Path) -> None:
    """Issue #8, second host, cut while bytes are on the wire (a 384 MiB READ over
    UCX/TCP on the veth pair). D reports ``failed`` for exactly that read's blocks
    (read timeout + agent reset); the engine writes a sentinel into them; P's hold
    ends ``expired`` at its lease bound (D's abandon cannot reach P while the link
    is down, so the lease is what releases it, as the lifecycle design says); the
    link comes back and P's stalled sends go out: the sentinel stays intact; and D
    reads oracle-exact bytes from the same P afterwards."""
    p = _sidecar(tmp_path, "p", link.ns_p, link.dev_p, link.addr_p)
    d = _sidecar(tmp_path, "d", link.ns_d, link.dev_d, link.addr_d,
                 "--metrics-port", "0", "--read-timeout", str(CUT_READ_TIMEOUT_S))  # last wins
    p.start(timeout_s=240)
    d.start(timeout_s=240)
    tag = secrets.token_hex(2)
    P = SimEngine(f"cutP{tag}", stall_layout, 1, 100, [p], timeout_s=60)
    D = SimEngine(f"cutD{tag}", stall_layout, 1, 100, [d], timeout_s=60)
    try:
        D.start_read(P.prefill("warm", Request(seed=1, prompt_tokens=64 * 2)))
        assert D.wait_for(["warm"], timeout_s=180)["warm"][0].kind == "received"
        assert not D.verify("warm")
        D.finish("warm")

        # The big read: P's blocks hold FILL (the oracle's fill of 384 MiB is
        # minutes of hashing on 2 cores; FILL shows where bytes landed).
        big = Request(seed=2, prompt_tokens=64 * 96)
        ids = P.blocks_for(big.prompt_tokens)
        for page in _pages(P, ids):
            page[:] = FILL
        sent = Sent("big", P.remote, ids, big)
        sent.tokens.append(P.clients[0].hold(P.engine_id, "big", ids, readers=1,
                                             timeout_s=BIG_HOLD_TIMEOUT_S).token)
        posted = _in_ns(link.ns_d, _WAIT_SAMPLE, str(d.metrics_port),
                        "kvsidecar_read_queue_seconds_count", D.engine_id, "2")  # warm + this
        rec = D.start_read(sent)
        _done(posted)
        # Posted; cut once its first bytes are landing in D's blocks.
        heads = [page[:64] for page in _pages(D, rec.block_ids)]
        deadline = time.monotonic() + 120
        while not any(bool((h == FILL).any()) for h in heads):
            assert time.monotonic() < deadline, "no byte of the read ever landed"
            time.sleep(0.001)
        link.cut()
        t_cut = time.monotonic()

        got = D.wait_for(["big"], timeout_s=CUT_READ_TIMEOUT_S + HANDSHAKE_TIMEOUT_S + 120)
        c = got["big"][0]
        t_failed = time.monotonic() - t_cut
        assert c.kind == "failed", c
        assert "timed out" in c.reason, c.reason
        assert c.invalid_block_ids == rec.block_ids
        pages = _pages(D, c.invalid_block_ids)
        total = sum(page.size for page in pages)
        before = sum(int(np.count_nonzero(page == FILL)) for page in pages)
        assert 0 < before < total, f"{before} of {total} B: the cut was not mid-transfer"
        for page in pages:  # the engine reuses the blocks at once
            page[:] = SENTINEL

        # P cannot be told while the link is down: its hold ends at its lease bound.
        p_got = P.wait_for(["big"], timeout_s=HOLD_LEASE_S + 120)["big"][0]
        t_expired = time.monotonic() - t_cut
        assert p_got.kind == "expired", p_got
        log = d.log_path.read_text()
        assert "could not tell P rank 0" in log
        # UCX finds no usable device while the link is down: the reset could not
        # create D's agent again, so D is not ready (and retries) until it can.
        assert "could not be created again after a reset; retrying" in log
        code, body = _done(_in_ns(link.ns_d, _READYZ, str(d.metrics_port))).split(" ", 1)
        ready = json.loads(body)
        assert code == "503" and ready["failed"] == ["nixl_agents"], ready
        assert D.engine_id in ready["checks"]["nixl_agents"]["detail"], ready

        link.restore()
        time.sleep(8)  # P's stalled sends go out now, to an agent that no longer exists
        landed = sum(int(np.count_nonzero(page != SENTINEL)) for page in pages)
        assert landed == 0, f"{landed} bytes landed in blocks reported failed"
        D.finish("big")
        # The link is back: D's agent is created again (one reset, counted once).
        _done(_in_ns(link.ns_d, _WAIT_SAMPLE, str(d.metrics_port),
                     "kvsidecar_agent_resets_total", D.engine_id, "1"))
        code, body = _done(_in_ns(link.ns_d, _READYZ, str(d.metrics_port))).split(" ", 1)
        assert code == "200", body

        # D (fresh agent, fresh links) reads oracle-exact bytes from the same P.
        D.start_read(P.prefill("after", Request(seed=3, prompt_tokens=64 * 2)))
        after = D.wait_for(["after"], timeout_s=180)["after"][0]
        assert after.kind == "received", after
        assert not D.verify("after")
        assert {c.kind for c in P.wait_for(["after"])["after"].values()} == {"sent"}
        print(f"\ncut mid-transfer: {before / 2**20:.0f} of {total / 2**20:.0f} MiB had landed; "
              f"D reported failed {t_failed:.1f} s after the cut (read timeout "
              f"{CUT_READ_TIMEOUT_S} s); P's hold expired {t_expired:.1f} s after the cut "
              f"(lease {HOLD_LEASE_S} s); 0 B landed after the failure; "
              f"load average {os.getloadavg()}")
        assert p.alive() and d.alive()
    finally:
        D.close()
        P.close()
        assert d.stop() == 0, d.read_log()
        p.stop()


_ADVERTISED = """
import argparse, sys
from kvsidecar.daemon import settings
p = argparse.ArgumentParser()
settings.add_arguments(p)
print(settings.from_args(p.parse_args(["--handshake-host", sys.argv[1]])).advertised)
"""


def test_a_wildcard_bind_advertises_this_hosts_own_address(link: Link) -> None:
    """On a host whose only network is the veth (no default route, no DNS name that
    resolves): a wildcard bind advertises the veth's address, the one a peer can
    dial, not ``gethostname()``; for IPv6 the global address, in brackets."""
    v6 = str(ipaddress.IPv6Address(f"fd00:6b76:{secrets.token_hex(2)}::2"))  # canonical
    _ip("-n", link.ns_d, "addr", "add", f"{v6}/64", "dev", link.dev_d, "nodad")
    got = {host: _done(_in_ns(link.ns_d, _ADVERTISED, host)).strip()
           for host in ("0.0.0.0", "::")}
    assert got == {"0.0.0.0": link.addr_d, "::": f"[{v6}]"}, got
