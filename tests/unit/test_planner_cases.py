"""Worked values from vLLM's hetero-TP history, and bad input with named errors."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvsidecar.daemon.planner import (
    BlockRangeError,
    DuplicateBlockError,
    GroupCountError,
    PairingError,
    TpError,
    candidate_ranks,
    expected_notifications,
    plan_read,
    segment_pieces,
)
from kvsidecar.ipc.layout import (
    IncompatibleLayout,
    Layout,
    LayoutError,
    attention_layout,
    check_compatible,
    fingerprint,
    mamba2_hybrid_layout,
    nemotron_h_like,
    view_bytes,
    view_offsets,
)


def small_hybrid(tp: int, nb: int = 16, n_groups: int = 8, k: int = 2) -> Layout:
    return mamba2_hybrid_layout(
        model="m", num_layers=2, total_kv_heads=k, head_dim=4, block_tokens=4,
        intermediate_size=32, n_groups=n_groups, d_state=4, conv_kernel=4, mamba_heads=8,
        mamba_head_dim=4, tp_size=tp, num_blocks=nb,
    )


# ---------------------------------------------------------------- worked values


def test_nemotron_kernel_blocks_per_page_261_261_131() -> None:
    """vLLM's Nemotron-3-Nano-30B figures: 261 kernel blocks per page at TP 1 and 2, 131 at 4."""
    subs = [nemotron_h_like(tp, 8).groups[0].sub_blocks for tp in (1, 2, 4)]
    assert subs == [261, 261, 131]


def _mamba_pieces(d_tp: int, d_rank: int, p_tp: int) -> dict[str, tuple[int, int, int, int]]:
    D, P = nemotron_h_like(d_tp, 8), nemotron_h_like(p_tp, 8)
    return {
        pc.segment: (pc.remote_rank, pc.local_offset, pc.remote_offset, pc.nbytes)
        for pc in segment_pieces(D, d_rank, P)
        if pc.group == 1
    }


def test_three_read_xbc_offsets_nemotron_1p2d() -> None:
    # DS conv at tp 1: x = 4096 ch * 3 rows * 2 B = 24576, B = C = 8 groups * 128 * 3 * 2 = 6144.
    # D rank 1 (tp 2) reads the second half of each: x at 12288, B at 24576 + 3072,
    # C at 24576 + 6144 + 3072, and heads 32..63 of the float32 SSM state after the conv.
    got = _mamba_pieces(2, 1, 1)
    assert got["x"] == (0, 0, 12288, 12288)
    assert got["B"] == (0, 12288, 27648, 3072)
    assert got["C"] == (0, 15360, 33792, 3072)
    assert got["ssm"] == (0, 18432, 36864 + 32 * 64 * 128 * 4, 32 * 64 * 128 * 4)


def test_three_read_xbc_offsets_nemotron_2p4d() -> None:
    # D rank 3 reads from P rank 1 (3 // 2) at slice offset 1 (3 % 2).
    got = _mamba_pieces(4, 3, 2)
    xb, bb = 1024 * 3 * 2, 2 * 128 * 3 * 2  # D's per-rank x and B bytes
    assert got["x"] == (1, 0, xb, xb)
    assert got["B"] == (1, xb, 2 * xb + bb, bb)
    assert got["C"] == (1, xb + bb, 2 * xb + 2 * bb + bb, bb)


def test_read_targets_k2_4p1d() -> None:
    """K=2 over P tp 4: heads replicate (P0,P1 hold head 0; P2,P3 head 1), so D reads
    attention from P0 and P2 only and Mamba from all four, and notifies all four."""
    D, P = nemotron_h_like(1, 8), nemotron_h_like(4, 8)
    pieces = segment_pieces(D, 0, P)
    attn = sorted({pc.remote_rank for pc in pieces if pc.group == 0})
    mamba = sorted({pc.remote_rank for pc in pieces if pc.group == 1})
    assert attn == [0, 2]
    assert mamba == [0, 1, 2, 3]
    assert candidate_ranks(1, 0, 4) == (0, 1, 2, 3)
    plan = plan_read(D, 0, P, [[1], [2]], [[3], [4]], skip_tokens=0)
    assert plan.notify == (0, 1, 2, 3)
    assert sorted(r.remote_rank for r in plan.reads) == [0, 1, 2, 3]


def test_replicated_d_reads_head_slice_of_p() -> None:
    """K=2, P tp 1, D tp 4: D ranks 2 and 3 both hold head 1, at P's head-1 offset."""
    P = attention_layout(model="m", num_layers=1, total_kv_heads=2, head_dim=8,
                         block_tokens=4, tp_size=1, num_blocks=4)
    D = attention_layout(model="m", num_layers=1, total_kv_heads=2, head_dim=8,
                         block_tokens=4, tp_size=4, num_blocks=4)
    head = 4 * 8 * 2
    for rank, want_head in [(0, 0), (1, 0), (2, 1), (3, 1)]:
        k = next(p for p in segment_pieces(D, rank, P) if p.segment == "k")
        assert (k.remote_rank, k.remote_offset, k.nbytes) == (0, want_head * head, head)


def test_notification_counts() -> None:
    assert expected_notifications(p_tp=1, d_tp=4) == 4
    assert expected_notifications(p_tp=2, d_tp=4) == 2
    assert expected_notifications(p_tp=4, d_tp=1) == 1
    assert expected_notifications(p_tp=2, d_tp=2) == 1
    # Every P rank is a candidate of exactly expected_notifications D ranks.
    for p_tp in (1, 2, 4, 8):
        for d_tp in (1, 2, 4, 8):
            seen = [0] * p_tp
            for j in range(d_tp):
                for p in candidate_ranks(d_tp, j, p_tp):
                    seen[p] += 1
            assert seen == [expected_notifications(p_tp, d_tp)] * p_tp


def test_different_sub_blocks_pair_by_token() -> None:
    """P page = 9 kernel blocks, D page = 5 (K=2 at tp 1 vs tp 4 at these sizes)."""
    P, D = small_hybrid(1), small_hybrid(4)
    assert (P.groups[0].sub_blocks, D.groups[0].sub_blocks) == (9, 5)
    plan = plan_read(D, 0, P, [[0, 1], [2]], [[5, 6], [7]], skip_tokens=0)
    k = next(r for r in plan.reads if r.remote_rank == 0)
    # Local kernel block 5 (page 1, block 0) pairs with remote kernel block 5 (page 5, block 5).
    starts = {int(lo): int(ro) for lo, ro in zip(k.local_offset, k.remote_offset)}
    kb_p, kb_d = P.groups[0].kernel_block_bytes, D.groups[0].kernel_block_bytes
    assert starts[1 * D.page_bytes] == 5 * P.page_bytes + 5 * kb_p
    assert kb_d <= kb_p


def test_view_offsets_one_convention_for_both_group_kinds() -> None:
    """Block ids name pages; view k of page b starts at b*page + k*view bytes, with
    a kernel block as the attention view and the page as the mamba view; segment
    offsets are relative to the view (ipc/layout.py "Units and offsets"). Checked
    at P and D sides whose sub_blocks differ (9 vs 5), against LAYOUT.md 2's
    token rule: kernel block k of the i-th page holds tokens (i*sub + k)*kbs..."""
    for L in (small_hybrid(1), small_hybrid(4)):
        attn_g, mamba_g = L.groups
        ids = np.array([3, 0, 7], dtype=np.int64)
        views = view_offsets(L, attn_g, ids)
        sub, kb = attn_g.sub_blocks, attn_g.kernel_block_bytes
        assert views.size == 3 * sub
        for pos, b in enumerate(ids):
            for k in range(sub):
                first_token = (pos * sub + k) * attn_g.block_tokens
                assert views[first_token // attn_g.block_tokens] == b * L.page_bytes + k * kb
        assert view_offsets(L, mamba_g, ids).tolist() == [b * L.page_bytes for b in ids]
        assert view_bytes(L, mamba_g) == L.page_bytes and view_bytes(L, attn_g) == kb
        # Every segment lies inside its view, whatever the kind.
        for g in L.groups:
            assert all(s.offset + s.nbytes_local <= view_bytes(L, g) for s in g.segments)


# ---------------------------------------------------------------- bad input


def test_block_id_out_of_range_names_side_group_and_id() -> None:
    L = small_hybrid(1)
    with pytest.raises(BlockRangeError, match=r"local group 0: block id 16 out of range \[0, 16\)"):
        plan_read(L, 0, L, [[16], [1]], [[0], [1]])
    with pytest.raises(BlockRangeError, match="remote group 1: block id -1"):
        plan_read(L, 0, L, [[0], [1]], [[0], [-1]])


def test_group_count_mismatch() -> None:
    L = small_hybrid(1)
    with pytest.raises(GroupCountError, match="name 1 groups, the layout has 2"):
        plan_read(L, 0, L, [[0]], [[0], [1]])


def test_indivisible_tp() -> None:
    with pytest.raises(TpError, match="not multiples"):
        candidate_ranks(3, 0, 2)
    with pytest.raises(TpError, match="rank 2 outside tp size 2"):
        candidate_ranks(2, 2, 1)
    a = attention_layout(model="m", num_layers=1, total_kv_heads=12, head_dim=4,
                         block_tokens=4, tp_size=3, num_blocks=4)
    b = attention_layout(model="m", num_layers=1, total_kv_heads=12, head_dim=4,
                         block_tokens=4, tp_size=2, num_blocks=4)
    with pytest.raises(IncompatibleLayout, match="tp_size"):
        check_compatible(a, b)


def test_incompatible_layouts_name_the_field() -> None:
    with pytest.raises(IncompatibleLayout, match=r"model.n_groups differs \(local 8, remote 1\)"):
        plan_read(small_hybrid(1), 0, small_hybrid(1, n_groups=1), [[0], [1]], [[0], [1]])
    with pytest.raises(IncompatibleLayout, match="family"):
        a = attention_layout(model="m", num_layers=2, total_kv_heads=2, head_dim=4,
                             block_tokens=4, tp_size=1, num_blocks=16)
        plan_read(small_hybrid(1), 0, a, [[0], [1]], [[0]])


def test_duplicate_local_blocks_rejected_across_groups() -> None:
    L = small_hybrid(1)
    with pytest.raises(DuplicateBlockError, match="local block id 3 named twice"):
        plan_read(L, 0, L, [[3], [3]], [[0], [1]])


def test_pairing_errors() -> None:
    P, D = small_hybrid(1), small_hybrid(4)
    with pytest.raises(PairingError, match="never trimmed"):
        plan_read(D, 0, P, [[0], [1, 2]], [[0], [1]], skip_tokens=0)
    with pytest.raises(PairingError, match="state skip_tokens or num_tokens"):
        plan_read(P, 0, D, [[0], [1]], [[2, 3, 4], [5]])
    # Not shorter, but still ambiguous: D's blocks span fewer tokens than P's.
    with pytest.raises(PairingError, match="cannot be inferred from block counts"):
        plan_read(D, 0, P, [[0, 2], [1]], [[3, 4], [5]])
    with pytest.raises(PairingError, match="not a whole number"):
        plan_read(D, 0, P, [[0], [1]], [[2, 3], [4]], skip_tokens=5)
    with pytest.raises(PairingError, match="exceeds"):
        plan_read(D, 0, P, [[0], [1]], [[2], [4]], skip_tokens=12 * 10)


def test_builder_errors_are_specific() -> None:
    with pytest.raises(LayoutError, match="total_kv_heads: 3 cannot be split evenly over tp 2"):
        attention_layout(model="m", num_layers=1, total_kv_heads=3, head_dim=4,
                         block_tokens=4, tp_size=2, num_blocks=4)
    with pytest.raises(LayoutError, match="unknown dtype"):
        attention_layout(model="m", num_layers=1, total_kv_heads=2, head_dim=4,
                         block_tokens=4, tp_size=1, num_blocks=4, dtype="float7")
    with pytest.raises(LayoutError, match="must equal intermediate_size"):
        mamba2_hybrid_layout(model="m", num_layers=1, total_kv_heads=2, head_dim=4,
                             block_tokens=4, intermediate_size=30, n_groups=1, d_state=4,
                             conv_kernel=4, mamba_heads=8, mamba_head_dim=4, tp_size=1,
                             num_blocks=4)
    with pytest.raises(LayoutError, match="num_blocks must be a positive integer"):
        small_hybrid(1, nb=0)
    with pytest.raises(LayoutError, match="tp 4 is not a multiple of 3"):
        attention_layout(model="m", num_layers=1, total_kv_heads=3, head_dim=4,
                         block_tokens=4, tp_size=4, num_blocks=4)
    with pytest.raises(LayoutError, match="exceed the limits"):
        small_hybrid(1, nb=1 << 40)


def test_block_ids_too_large_for_int64_are_bad_input() -> None:
    L = small_hybrid(1)
    with pytest.raises(BlockRangeError, match="not integers"):
        plan_read(L, 0, L, [[2**63], [1]], [[0], [1]])


# ---------------------------------------------------------------- layout model


def test_layout_roundtrips_and_fingerprint_ignores_per_engine_facts() -> None:
    a, b = nemotron_h_like(1, 100), nemotron_h_like(4, 7)
    for codec in (msgspec.msgpack, msgspec.json):
        assert codec.decode(codec.encode(a), type=Layout) == a
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint(small_hybrid(1))
    check_compatible(a, b)


def test_unknown_fields_in_a_layout_are_rejected() -> None:
    raw = msgspec.json.decode(msgspec.json.encode(small_hybrid(1)))
    raw["surprise"] = 1
    with pytest.raises(msgspec.ValidationError, match="surprise"):
        msgspec.json.decode(msgspec.json.encode(raw), type=Layout)


def test_page_holds_the_larger_of_attention_and_mamba() -> None:
    for tp in (1, 2, 4, 8):
        L = nemotron_h_like(tp, 4)
        mamba = sum(s.nbytes_local for s in L.groups[1].segments)
        g = L.groups[0]
        assert L.page_bytes == g.sub_blocks * g.kernel_block_bytes >= mamba
        assert (g.sub_blocks - 1) * g.kernel_block_bytes < mamba
    assert np.int64(nemotron_h_like(1, 4).page_bytes) == 261 * 8192
