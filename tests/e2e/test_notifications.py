"""End to end: completion notifications count only from the reader's own agent (issue 7 item 7)."""

from __future__ import annotations

import time

import pytest

from kvsidecar.daemon import notifications
from kvsidecar.sim.models import attn
from kvsidecar.sim.oracle import Request
from kvsidecar.sim.raw_nixl import forger_agent

pytestmark = pytest.mark.e2e



def test_a_forged_notification_does_not_release_a_hold(pool) -> None:
    """A real foreign NIXL agent loads P's agent metadata (anyone can fetch it by
    handshake) and sends a well-formed notification naming D's engine and a held
    request. P's sidecar must reject it (NIXL names the sender, which is not the
    agent D declared in its handshake), count it, and keep the hold; D's real
    read then releases it."""
    p_sidecar = pool.p[0]
    with pool.engines(attn(8), 1, 1) as (P, (D,)):
        # D handshakes (declaring its agent) and reads once, so P knows the reader.
        D.start_read(P.prefill("warm", Request(seed=1, prompt_tokens=16)))
        assert D.wait_for(["warm"])["warm"][0].kind == "received"
        assert P.wait_for(["warm"])["warm"][0].kind == "sent"
        sent = P.prefill("victim", Request(seed=2, prompt_tokens=24))
        forger, target = forger_agent(P.registrations[0].handshake_address, P.engine_id)
        forged = notifications.encode(P.engine_id, "victim", D.engine_id, 0, D.tp)
        forger.send_notif(target, forged)
        deadline = time.monotonic() + 60
        rejected = f"rejecting a notification for engine {P.engine_id!r} request 'victim'"
        while rejected not in p_sidecar.read_log():
            assert time.monotonic() < deadline, "P never saw the forged notification"
            forger.get_new_notifs()  # progress the forger's UCX worker
            time.sleep(0.05)
        P.poll()
        assert not [c for c in P.completions[0] if c.request_id == "victim"], P.completions
        # The hold is intact: the real reader still gets the bytes and releases it.
        D.start_read(sent)
        assert D.wait_for(["victim"])["victim"][0].kind == "received"
        assert not D.verify("victim")
        assert P.wait_for(["victim"])["victim"][0].kind == "sent"
