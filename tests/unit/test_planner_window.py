"""Sliding-window groups: both sides name only the tails of a request's pages.

Checked byte for byte against the LAYOUT.md oracle, without NIXL: P's tail
holds the tokens from its first kept page on, D's tail is shorter or longer
(its own window clip, a local prefix hit), the kernel blocks per page differ
between P and D (a hybrid at different tp), and every D page outside the
pairs stays untouched.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvsidecar.daemon.planner import PairingError, plan_read
from kvsidecar.ipc.layout import (
    Group,
    IncompatibleLayout,
    Layout,
    check_compatible,
    mamba2_hybrid_layout,
)
from kvsidecar.sim.hostcopy import apply_plan
from kvsidecar.sim.oracle import POISON, Request, check_received, fill_shard

KBS = 4  # tokens per kernel block
WINDOW = 10


def windowed(tp: int, nb: int = 24) -> Layout:
    """Attention (group 0) turned sliding-window + Mamba2 (group 1): P at tp 1
    and D at tp 2 have different kernel blocks per page."""
    lay = mamba2_hybrid_layout(
        model="m", num_layers=2, total_kv_heads=1, head_dim=4, block_tokens=KBS,
        intermediate_size=32, n_groups=2, d_state=4, conv_kernel=4, mamba_heads=8,
        mamba_head_dim=4, tp_size=tp, num_blocks=nb)
    g0 = msgspec.structs.replace(lay.groups[0], window_tokens=WINDOW)
    return msgspec.structs.replace(lay, groups=(g0, lay.groups[1]))


def _read(p_tp: int, d_tp: int, tokens: int, p_want: int, d_want: int) -> None:
    P, D = windowed(p_tp), windowed(d_tp)
    req = Request(7, tokens)
    p_page_tok = P.groups[0].sub_blocks * KBS
    d_page_tok = D.groups[0].sub_blocks * KBS
    p_span, d_span = -(-tokens // p_page_tok), -(-tokens // d_page_tok)
    p_pages, d_pages = min(p_want, p_span), min(d_want, d_span)
    p_ids = [list(range(1, 1 + p_pages)), [20]]
    d_ids = [list(range(3, 3 + d_pages)), [21]]
    p_first = (p_span - p_pages) * p_page_tok
    d_first = (d_span - d_pages) * d_page_tok
    srcs = {}
    for p_rank in range(p_tp):
        bufs = [np.zeros(P.region_bytes, np.uint8) for _ in range(P.num_regions)]
        fill_shard(bufs, P, p_rank, p_ids, req, [p_first, 0])
        srcs[p_rank] = bufs
    for d_rank in range(d_tp):
        dst = [np.full(D.region_bytes, POISON, np.uint8) for _ in range(D.num_regions)]
        plan = plan_read(D, d_rank, P, d_ids, p_ids, skip_tokens=0, num_tokens=tokens)
        apply_plan(plan, dst, srcs)
        # D holds the tokens both tails hold, from the later first token on; its
        # pages before that (beyond P's tail) must stay poison
        first = max(p_first, d_first)
        d_skip = -(-(first - d_first) // d_page_tok)  # D's first page read whole
        want = [d_ids[0][d_skip:], d_ids[1]]
        partial = set(d_ids[0][d_skip - 1:d_skip]) if (first - d_first) % d_page_tok else set()
        problems = check_received(dst, D, d_rank, want, req, ignore_blocks=partial,
                                  first_tokens=[d_first + d_skip * d_page_tok, 0])
        assert not problems, problems
        for page in partial:  # P's tail starts inside it: its kernel blocks before stay poison
            start = page * D.page_bytes
            unread = (first - d_first) % d_page_tok // KBS * D.groups[0].kernel_block_bytes
            assert all((r[start:start + unread] == POISON).all() for r in dst)
            assert any((r[start + unread:start + D.page_bytes] != POISON).any() for r in dst)


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (1, 2), (2, 1)])  # 13 vs 7 kernel blocks a page
@pytest.mark.parametrize("tokens", [37, 150])
@pytest.mark.parametrize("p_pages,d_pages", [(1, 1), (2, 1), (1, 3), (3, 3)])
def test_window_tails_pair_by_token(p_tp: int, d_tp: int, tokens: int, p_pages: int,
                                    d_pages: int) -> None:
    """Tails of up to ``p_pages`` / ``d_pages`` pages (as many as the tokens span)."""
    _read(p_tp, d_tp, tokens, p_pages, d_pages)


def test_window_read_needs_num_tokens_and_fitting_tails() -> None:
    P, D = windowed(1), windowed(1)
    with pytest.raises(PairingError, match="needs num_tokens"):
        plan_read(D, 0, P, [[3], [21]], [[1], [20]], skip_tokens=0)
    with pytest.raises(PairingError, match="tokens span only"):
        plan_read(D, 0, P, [[3, 4, 5, 6], [21]], [[1], [20]], num_tokens=5)


def test_window_is_a_model_fact_and_absent_from_the_wire_when_zero() -> None:
    """P and D must agree on the window (check_compatible names it); a group
    without one encodes as before the field existed (older peers accept it)."""
    lay = windowed(1)
    plain = msgspec.structs.replace(lay, groups=(
        msgspec.structs.replace(lay.groups[0], window_tokens=0), lay.groups[1]))
    with pytest.raises(IncompatibleLayout, match=r"group\[0\].window_tokens"):
        check_compatible(lay, plain)
    assert b"window_tokens" not in msgspec.msgpack.encode(plain.groups[0])
    wire = msgspec.msgpack.encode(lay.groups[0])
    assert msgspec.msgpack.decode(wire, type=Group).window_tokens == WINDOW
