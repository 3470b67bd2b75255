"""End to end (issue #12): the reads of one engine ``read_many`` that D posts to
one P agent travel as a few NIXL transfers, each carrying one notification that
names all its reads, when P advertised batched notifications; every read's
bytes still match the oracle and P ends each hold. A forged or malformed batched
notification ends nothing, and a P that does not advertise them (an older
sidecar, or ``--notif-batch-reads 0``) gets one transfer per read. Real sidecars,
each test its own pair so the counters count this test only."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsidecar.daemon import notifications
from kvsidecar.sim.cluster import SidecarProcess, SimEngine
from kvsidecar.sim.models import attn
from kvsidecar.sim.oracle import Request
from kvsidecar.sim.raw_nixl import forger_agent

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

D_READS = "kvsidecar_transfer_reads"
P_READS = "kvsidecar_notification_reads"


def _pair(tmp_path: Path, p_args: list[str]) -> tuple[SidecarProcess, SidecarProcess]:
    p = SidecarProcess(tmp_path, "mt-p", args=["--metrics-port", "0", *p_args]).start()
    try:
        d = SidecarProcess(tmp_path, "mt-d", args=["--metrics-port", "0"]).start()
    except BaseException:
        p.stop()
        raise
    return p, d


@pytest.fixture(params=[[], ["--notif-batch-reads", "0"]], ids=["batched", "one-per-read"])
def pair(request: pytest.FixtureRequest, tmp_path: Path
         ) -> Iterator[tuple[SidecarProcess, SidecarProcess, bool]]:
    p, d = _pair(tmp_path, request.param)
    try:
        yield p, d, not request.param
    finally:
        codes = {"p": p.stop(), "d": d.stop()}
        assert codes == {"p": 0, "d": 0}, codes


def _counts(s: SidecarProcess, name: str) -> tuple[float, float]:
    return s.metric(f"{name}_count"), s.metric(f"{name}_sum")


def test_sixteen_reads_reach_p_as_few_transfers_with_oracle_exact_bytes(
        pair: tuple[SidecarProcess, SidecarProcess, bool]) -> None:
    p, d, batched = pair
    P = SimEngine("mt-P", attn(8), 1, 160, [p])
    D = SimEngine("mt-D", attn(8), 1, 160, [d])
    try:
        D.start_read(P.prefill("warm", Request(seed=1, prompt_tokens=16)))
        assert D.wait_for(["warm"])["warm"][0].kind == "received"
        D.finish("warm")
        P.wait_for(["warm"])
        d0, p0 = _counts(d, D_READS), _counts(p, P_READS)
        sents = [P.prefill(f"r{i}", Request(seed=10 + i, prompt_tokens=8 + 5 * i))
                 for i in range(16)]
        batched0 = d.metric("kvsidecar_reads_batched_total", engine="mt-D")
        D.start_reads(sents)  # one read_many of 16 reads, all from P rank 0
        rids = [s.request_id for s in sents]
        got = D.wait_for(rids)
        assert {rid: got[rid][0].kind for rid in rids} == dict.fromkeys(rids, "received")
        for rid in rids:
            assert D.verify(rid) == [], rid  # LAYOUT.md section 6 oracle
            assert got[rid][0].nbytes > 0
        sent_back = P.wait_for(rids)  # every hold ended by its notification
        assert {per[0].kind for per in sent_back.values()} == {"sent"}
        (dn, dr), (pn, pr) = _counts(d, D_READS), _counts(p, P_READS)
        assert dr - d0[1] == 16 and pr - p0[1] == 16  # every read, each named once
        # over the link the warm read made, the 16 shared one task (read_batch)
        assert d.metric("kvsidecar_reads_batched_total", engine="mt-D") - batched0 == 16
        if batched:
            # fewer transfers than reads, and as few notifications as transfers
            assert dn - d0[0] < 16 and pn - p0[0] < 16, (dn - d0[0], pn - p0[0])
        else:
            assert dn - d0[0] == 16 and pn - p0[0] == 16
        assert p.metric("kvsidecar_notifications_received_total", outcome="ok") >= 17
    finally:
        D.close()
        P.close()



def test_a_forged_or_malformed_batched_notification_ends_nothing(tmp_path: Path) -> None:
    """A fleet member's foreign NIXL agent sends P batched notifications: one
    naming D's held request (and an unknown one) as if D had read them, one
    undecodable, one naming more reads than allowed. P refuses each forged read
    alone (wrong sender), each malformed batch whole (bad), keeps the hold and
    keeps serving: D's real read still ends it."""
    p, d = _pair(tmp_path, [])
    P = SimEngine("mf-P", attn(8), 1, 64, [p])
    D = SimEngine("mf-D", attn(8), 1, 64, [d])
    try:
        D.start_read(P.prefill("warm", Request(seed=1, prompt_tokens=16)))
        assert D.wait_for(["warm"])["warm"][0].kind == "received"
        assert P.wait_for(["warm"])["warm"][0].kind == "sent"
        sent = P.prefill("victim", Request(seed=2, prompt_tokens=24))
        forger, target = forger_agent(P.registrations[0].handshake_address, P.engine_id)
        wrong0 = p.metric("kvsidecar_notifications_received_total", outcome="wrong_sender")
        bad0 = p.metric("kvsidecar_notifications_received_total", outcome="bad")
        forged = notifications.join([
            notifications.encode(P.engine_id, "victim", D.engine_id, 0, D.tp),
            notifications.encode(P.engine_id, "nobody", D.engine_id, 0, D.tp)])
        too_many = notifications.join(
            [notifications.encode(P.engine_id, "victim", D.engine_id, 0, D.tp)] *
            (notifications.MAX_NOTIF_READS + 1))
        for msg in (forged, b"\x92\x02not msgpack", too_many):
            forger.send_notif(target, msg)
        deadline = time.monotonic() + 60
        while (p.metric("kvsidecar_notifications_received_total", outcome="wrong_sender")
               - wrong0 < 2 or
               p.metric("kvsidecar_notifications_received_total", outcome="bad") - bad0 < 2):
            assert time.monotonic() < deadline, "P never saw the forged notifications"
            forger.get_new_notifs()  # progress the forger's UCX worker
            time.sleep(0.05)
        assert "undecodable batched notification" in p.read_log()
        P.poll()
        assert not [c for c in P.completions[0] if c.request_id == "victim"], P.completions
        D.start_read(sent)
        assert D.wait_for(["victim"])["victim"][0].kind == "received"
        assert not D.verify("victim")
        assert P.wait_for(["victim"])["victim"][0].kind == "sent"
    finally:
        D.close()
        P.close()
        codes = {"p": p.stop(), "d": d.stop()}
        assert codes == {"p": 0, "d": 0}, codes
