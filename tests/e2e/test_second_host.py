"""A real second host: P and D sidecars in two network namespaces joined by a
veth pair, UCX over TCP on that link, every byte checked by the oracle; then
the link is cut (veth down) while the sidecars are linked, and the reads
that follow fail within the read timeout while P's holds are released.
(Not yet: a cut while bytes are on the wire, and the no-write-after-failed
check across namespaces.)

Needs root (ip netns); skipped with the reason otherwise. Names are unique per
run and everything is removed afterwards; the only addresses used are the two
ends of the veth pair (a private /30 picked per run).
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvsidecar.sim.cluster import SidecarProcess, engines
from kvsidecar.sim.models import hybrid
from kvsidecar.sim.oracle import Request

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
            # P's holds of the failed reads are released (expired), never sent.
            p_got = P.wait_for(cut, timeout_s=120)
            for rid in cut:
                assert {c.kind for c in p_got[rid].values()} <= {"expired", "aborted"}, p_got[rid]
        assert p.alive() and d.alive()
    finally:
        p.stop()
        d.stop()
