"""Which engine rank a reader's control item may act on, and its hold token.

Pure checks shared by claims, abandons and digests: each returns either what
it found or the :class:`~kvsidecar.daemon.peers.control.ControlReply` that
refuses the item, naming what is wrong.
"""

from __future__ import annotations

import time

from kvsidecar.daemon.engines.rank import EngineRank
from kvsidecar.daemon.engines.table import EngineTable
from kvsidecar.daemon.peers.control import Abandon, ControlReply, ControlRequest, Digest
from kvsidecar.ipc import hold_token


def linked_engine(table: EngineTable, msg: ControlRequest | Digest) -> EngineRank | ControlReply:
    """The engine rank a control item names, or the refusal when it is not the
    one the reader linked to: the registered rank or a draining generation, by
    the agent the reader linked to (see daemon/drain.py)."""
    current = table.get(msg.engine_id)
    holder = table.holder(msg.engine_id, msg.request_id)
    # The agent the reader linked to names the memory it reads: the registered
    # rank's or a draining generation's (see daemon/drain.py).
    eng = next((r for r in table.ranks_of(msg.engine_id)
                if r.worker.agent_name == msg.agent_name), None) if msg.agent_name else None
    eng = eng or holder
    # An abandon of a draining generation's hold ends it whatever the reader
    # linked to: the reader has nothing in flight on it (its claim was refused).
    drained_abandon = isinstance(msg, Abandon) and holder is not current
    if drained_abandon:
        eng = holder
    if eng is not None and eng is not holder and holder is not current:
        return ControlReply(granted=False, reason=(
            f"request {msg.request_id[:200]!r} is held by an earlier registration of "
            f"engine {msg.engine_id[:200]!r} (draining), not the one the reader linked to"))
    if eng is not None and eng is not current and (msg.engine_id,
                                                     msg.request_id) not in eng.holds:
        # Linked to what an ended engine left: a new registration of the id (if
        # any) may hold it, so the reader re-links (stale) when there is one.
        return ControlReply(granted=False, stale_link=current is not None, reason=(
            f"engine {msg.engine_id[:200]!r} ended; request {msg.request_id[:200]!r} is "
            "not held by what it left" + ("; it registered again since" if current
                                          else "")))
    if eng is None or eng.tp_rank != msg.tp_rank:
        return ControlReply(granted=False, stale_link=True,
                            reason=f"engine {msg.engine_id[:200]!r} rank {msg.tp_rank} is "
                                   "not registered here")
    unlinked_abandon = isinstance(msg, Abandon) and (not msg.agent_name or drained_abandon)
    if msg.agent_name != eng.worker.agent_name and not unlinked_abandon:
        return ControlReply(granted=False, stale_link=True, reason=(
            f"engine {msg.engine_id[:200]!r} registered again since the reader linked to "
            "it (its memory is not the memory the reader would read)"))
    return eng


def token_digest(eng: EngineRank, msg: ControlRequest | Digest, op: str
                 ) -> hold_token.Issued | ControlReply:
    """The hold token a control item carries, checked under ``eng``'s hold key
    (issued for this engine and request, not expired): the blocks digest it
    names and who issued it, or the refusal naming what is wrong."""
    if not msg.token:
        return ControlReply(granted=False, reason=(
            f"{op} of request {msg.request_id[:200]!r} carries no hold token: reads need "
            "the token the hold issued (Read.remote_tokens; vLLM: kv_transfer_params)"))
    try:
        return hold_token.check_issued_by(eng.hold_key, msg.engine_id, msg.request_id,
                                          msg.token, time.time())
    except hold_token.TokenError as e:
        return ControlReply(granted=False, reason=f"{op} refused: {e}")
