"""A hold is a capability: a read moves bytes only with the token P's hold issued.

Real processes: a victim's P sidecar (root's engine, KV all 0x5a, nothing held
for anyone), and a D sidecar shared with the group ``nogroup``
(``--allow-gid``). The thief is a process running as ``nobody:nogroup`` that
registers its own engine on the shared D sidecar and reads the victim's
engine by naming its engine id and handshake address. Before hold tokens the
claim for a request P held nothing for was granted and D posted: the thief's
memory came back full of the victim's bytes (``received``). Now the read is
refused before anything is posted, whatever the thief presents (no token, a
forged one, the token of a hold it was given for other blocks or another
request), and the victim's own reader, with the token, still reads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsidecar.ipc.client import SidecarClient, SidecarError
from kvsidecar.ipc.protocol import RemoteEngine
from kvsidecar.sim.cluster import SidecarProcess
from kvsidecar.sim.models import attn

from .test_security import NOBODY, _as_nobody

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

VICTIM = "victim-P"
BLOCKS = [list(range(4))]
MARK = 0x5A


def _steal(d_sock: str, p_addr: str, request_id: str, block_ids_json: str,
           tokens_json: str) -> dict[str, Any]:
    """The thief (run as nobody): its own engine on the shared D sidecar reads
    the victim's blocks; what came of it, and how many of the victim's bytes
    landed in its memory."""
    layout = attn(2)(1, 16)
    c = SidecarClient(d_sock, timeout_s=30)
    reg = c.register("thief", 0, layout, allocate=True, memory="memfd")
    ids = json.loads(block_ids_json)
    tokens = json.loads(tokens_json)
    out: dict[str, Any] = {}
    try:
        extra = {} if tokens is None else {"remote_tokens": tokens}
        c.read("thief", "steal", ids, RemoteEngine(VICTIM, 1, [p_addr]), ids,
               remote_request_id=request_id, **extra)
    except SidecarError as e:
        out["refused"] = f"{type(e).__name__}: {e.message}"
    else:
        deadline = time.monotonic() + 60
        while "kind" not in out and time.monotonic() < deadline:
            for done in c.poll("thief"):
                out["kind"], out["reason"] = done.kind, done.reason
            time.sleep(0.05)
    out["stolen"] = int(sum(np.count_nonzero(r.numpy() == MARK) for r in reg.regions))
    for r in reg.regions:
        r.close()
    c.deregister("thief")
    c.close()
    return out


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[SidecarProcess, SidecarProcess, SidecarClient]]:
    """P (the victim's engine registered, all 0x5a) and the shared D sidecar."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the thief runs as another user (nobody)")
    workdir = Path(tempfile.mkdtemp(prefix="kvs-cap-", dir="/tmp"))
    os.chmod(workdir, 0o755)
    p = SidecarProcess(workdir, "p")
    d = SidecarProcess(workdir, "d", args=["--allow-gid", str(NOBODY)])
    d.socket = str(workdir / "run" / "d.sock")
    victim = None
    try:
        p.start()
        d.start()
        victim = SidecarClient(p.socket, timeout_s=30)
        reg = victim.register(VICTIM, 0, attn(2)(1, 16), allocate=True)
        for r in reg.regions:
            r.numpy()[:] = MARK
        yield p, d, victim
    finally:
        if victim is not None:
            victim.close()
        d.stop()
        p.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _p_address(p: SidecarProcess) -> str:
    return getattr(p, "handshake_address", "") or p.handshake


def test_a_read_without_the_holds_token_moves_nothing(
        fleet: tuple[SidecarProcess, SidecarProcess, SidecarClient]) -> None:
    p, d, _ = fleet
    got = _as_nobody(_steal, d.socket, _p_address(p), "nothing-held", json.dumps(BLOCKS),
                     json.dumps(None))
    assert got["stolen"] == 0, got
    assert got.get("refused", "").startswith("BadRequest: read 'steal' carries 0 hold tokens "
                                             "for 1 remote ranks"), got


def test_only_the_token_of_a_live_hold_for_those_blocks_moves_bytes(
        fleet: tuple[SidecarProcess, SidecarProcess, SidecarClient]) -> None:
    p, d, victim = fleet
    addr = _p_address(p)
    # The thief was legitimately given one hold: block 0 of request "given".
    given = victim.hold(VICTIM, "given", [[0]], timeout_s=60).token
    other = victim.hold(VICTIM, "private", BLOCKS, timeout_s=60).token
    forged = f"1.{int(time.time()) + 600}.{'00' * 16}.{'11' * 16}.{'22' * 16}"
    cases = {
        "forged": ("private", BLOCKS, [forged], "was not issued for request 'private'"),
        "more blocks than given": ("given", BLOCKS, [given],
                                   "the read names other blocks than the hold token pins"),
        "another request's blocks": ("private", BLOCKS, [given], "was not issued for request "
                                                                 "'private'"),
        "malformed": ("private", BLOCKS, ["x"], "malformed hold token"),
    }
    for case, (rid, ids, tokens, why) in cases.items():
        got = _as_nobody(_steal, d.socket, addr, rid, json.dumps(ids), json.dumps(tokens))
        assert got.get("kind") == "failed" and why in got["reason"], (case, got)
        assert "remote rank 0" in got["reason"], (case, got)
        assert got["stolen"] == 0, (case, got)
    # Positive control: the reader the hold was issued for reads it, bytes and all,
    # through the same shared sidecar.
    honest = SidecarClient(d.socket, timeout_s=30)
    try:
        reg = honest.register("honest", 0, attn(2)(1, 16), allocate=True)
        honest.read("honest", "mine", BLOCKS, RemoteEngine(VICTIM, 1, [addr]), BLOCKS,
                    remote_request_id="private", remote_tokens=[other])
        kinds: list[str] = []
        deadline = time.monotonic() + 60
        while not kinds and time.monotonic() < deadline:
            kinds = [c.kind + c.reason for c in honest.poll("honest")]
            time.sleep(0.05)
        assert kinds == ["received"]
        # Every byte of the 4 blocks (of 16) in every region, and nothing else.
        landed = sum(np.count_nonzero(r.numpy() == MARK) for r in reg.regions)
        assert landed == sum(r.numpy().size for r in reg.regions) * 4 // 16
        for r in reg.regions:
            r.close()
        honest.deregister("honest")
    finally:
        honest.close()
    sent = []
    deadline = time.monotonic() + 60
    while not sent and time.monotonic() < deadline:
        sent = [c.kind for c in victim.poll(VICTIM) if c.request_id == "private"]
        time.sleep(0.05)
    assert sent == ["sent"]
    victim.release(VICTIM, "given")
