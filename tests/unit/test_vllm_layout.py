"""vLLM's KV-cache description -> kvsidecar layout (pure; no vLLM needed)."""

from __future__ import annotations

import pytest

from kvsidecar.integrations.vllm.layout import (
    AttentionGroupSpec,
    GdnGroupSpec,
    Mamba1GroupSpec,
    Mamba2GroupSpec,
    TensorPlacement,
    UnsupportedConfig,
    build_layout,
)
from kvsidecar.ipc.layout import unit_range

NB, PAGE = 8, 2 * 16 * 32 * 2  # 2 heads x 16 tokens x (K|V of 16 bf16)


def attn(tp: int = 1, layers: tuple[str, ...] = ("a0", "a1"), block: int = 16,
         kernel: int = 16) -> AttentionGroupSpec:
    heads = 2 // tp
    return AttentionGroupSpec(layers, block, kernel, heads, 2, 16, 16, 2,
                              heads * block * 64)


def test_layer_outermost_layers_become_regions() -> None:
    t = TensorPlacement(("a0", "a1"), 0, NB * PAGE, PAGE)
    vl = build_layout(model="m", tp_size=1, num_blocks=NB, tensors=[t], groups=[attn()],
                      dtype="bfloat16")
    assert [(r.offset, r.nbytes) for r in vl.regions] == [(0, NB * PAGE), (NB * PAGE, NB * PAGE)]
    (g,) = vl.layout.groups
    assert g.sub_blocks == 1 and g.segments[0].units_total == 2


def test_block_outermost_layout_is_refused() -> None:
    t = TensorPlacement(("a0", "a1"), 0, PAGE, 2 * PAGE)
    with pytest.raises(UnsupportedConfig, match="layer-outermost"):
        build_layout(model="m", tp_size=1, num_blocks=NB, tensors=[t], groups=[attn()],
                     dtype="bfloat16")


def test_host_resident_pool_is_refused() -> None:
    t = TensorPlacement(("a0", "a1"), 0, NB * PAGE, PAGE, host_resident=True)
    with pytest.raises(UnsupportedConfig, match="host-resident"):
        build_layout(model="m", tp_size=1, num_blocks=NB, tensors=[t], groups=[attn()],
                     dtype="bfloat16")


def test_kernel_blocks_split_a_large_block() -> None:
    g = attn(block=64, kernel=16)
    t = TensorPlacement(("a0", "a1"), 0, NB * g.page_bytes, g.page_bytes)
    vl = build_layout(model="m", tp_size=1, num_blocks=NB, tensors=[t], groups=[g],
                      dtype="bfloat16")
    assert vl.layout.groups[0].sub_blocks == 4 and vl.layout.groups[0].block_tokens == 16


def test_hybrid_groups_overlay_the_same_regions() -> None:
    a = attn(layers=("a0",))
    m = Mamba2GroupSpec(("m0", "m1"), (4 * 8 + 2 * 2 * 8, 3), (4, 8, 8), 2, 4, 2, 4,
                        a.page_bytes)
    ts = [TensorPlacement(("a0",), 0, NB * PAGE, PAGE),
          TensorPlacement(("m0", "m1"), 0, NB * PAGE, PAGE)]
    vl = build_layout(model="m", tp_size=1, num_blocks=NB, tensors=ts, groups=[a, m],
                      dtype="bfloat16")
    assert vl.layout.num_regions == 2 and vl.group_kinds == ("attention", "mamba")
    # attention lives in region 0 only; Mamba in both
    assert vl.layout.groups[0].segments[0].regions == (0,)
    assert [s.name for s in vl.layout.groups[1].segments] == ["x", "B", "C", "ssm"]


def test_heads_that_do_not_match_tp_are_refused() -> None:
    g = AttentionGroupSpec(("a0",), 16, 16, 2, 2, 16, 16, 2, PAGE)  # 2 heads at tp 2?
    t = TensorPlacement(("a0",), 0, NB * PAGE, PAGE)
    with pytest.raises(UnsupportedConfig, match="KV heads"):
        build_layout(model="m", tp_size=2, num_blocks=NB, tensors=[t], groups=[g],
                     dtype="bfloat16")


def test_mla_is_one_replicated_latent_every_tp_rank_holds_whole() -> None:
    """DeepSeek-V2-Lite: one 576-wide latent per token (head_size_v 0), the same on
    every rank: one unit, replicated, so a D rank reads it whole from one P rank."""
    page = 16 * 576 * 2
    g = AttentionGroupSpec(("a0",), 16, 16, 1, 1, 576, 0, 2, page, latent=True)
    t = TensorPlacement(("a0",), 0, NB * page, page)
    for tp in (1, 2, 4):
        vl = build_layout(model="m", tp_size=tp, num_blocks=NB, tensors=[t], groups=[g],
                          dtype="bfloat16")
        (seg,) = vl.layout.groups[0].segments
        assert (seg.name, seg.sharding, seg.units_total, seg.nbytes_local) == (
            "latent", "replicated", 1, page)
        assert {unit_range(seg, tp, r) for r in range(tp)} == {(0, 1)}
        assert vl.layout.family == "mla"


def test_sliding_window_group_carries_its_window() -> None:
    g = AttentionGroupSpec(("a0",), 16, 16, 2, 2, 16, 16, 2, PAGE, window=128)
    t = TensorPlacement(("a0", "a1"), 0, NB * PAGE, PAGE)
    vl = build_layout(model="m", tp_size=1, num_blocks=NB, tensors=[t],
                      groups=[g, attn(layers=("a1",))], dtype="bfloat16")
    assert [x.window_tokens for x in vl.layout.groups] == [128, 0]
    assert vl.layout.family == "attention+swa"


def test_gdn_state_is_q_k_v_channels_and_value_heads() -> None:
    """Qwen3-Next at tp 2: 16 key / 32 value heads of 128, conv kernel 4 (3 rows)."""
    conv = (2 * 8 * 128 + 16 * 128, 3)
    temporal = (16, 128, 128)
    state = conv[0] * 3 * 2 + 16 * 128 * 128 * 4
    g = GdnGroupSpec(("l0",), conv, temporal, 2, 4, 16, 32, 128, 128, state)
    t = TensorPlacement(("l0",), 0, NB * state, state)
    vl = build_layout(model="m", tp_size=2, num_blocks=NB, tensors=[t], groups=[g],
                      dtype="bfloat16")
    segs = {s.name: (s.offset, s.nbytes_local, s.units_total)
            for s in vl.layout.groups[0].segments}
    row = 3 * 2
    assert segs == {"Q": (0, 1024 * row, 2048), "K": (1024 * row, 1024 * row, 2048),
                    "V": (2048 * row, 2048 * row, 4096),
                    "ssm": (4096 * row, 16 * 128 * 128 * 4, 32)}
    assert vl.layout.family == "gdn"
    bad = GdnGroupSpec(("l0",), (conv[0] - 128, 3), temporal, 2, 4, 16, 32, 128, 128, state)
    with pytest.raises(UnsupportedConfig, match=r"is not Q\|K\|V"):
        build_layout(model="m", tp_size=2, num_blocks=NB, tensors=[t], groups=[bad],
                     dtype="bfloat16")


def test_mamba1_state_is_channels_of_conv_and_temporal_state() -> None:
    """Jamba at tp 2: 8192 channels, conv kernel 4 (3 rows, bf16), d_state 16 (fp32)."""
    state = 4096 * 3 * 2 + 4096 * 16 * 4
    g = Mamba1GroupSpec(("m0",), (4096, 3), (4096, 16), 2, 4, 8192, state)
    t = TensorPlacement(("m0",), 0, NB * state, state)
    vl = build_layout(model="m", tp_size=2, num_blocks=NB, tensors=[t], groups=[g],
                      dtype="bfloat16")
    segs = {s.name: (s.offset, s.nbytes_local, s.units_total)
            for s in vl.layout.groups[0].segments}
    assert segs == {"x": (0, 4096 * 6, 8192), "ssm": (4096 * 6, 4096 * 64, 8192)}
    assert vl.layout.family == "mamba1"
    with pytest.raises(UnsupportedConfig, match="does not hold 8192 channels over tp 4"):
        build_layout(model="m", tp_size=4, num_blocks=NB, tensors=[t], groups=[g],
                     dtype="bfloat16")
