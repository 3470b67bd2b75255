"""vLLM's KV-cache description -> kvsidecar layout (pure; no vLLM needed)."""

from __future__ import annotations

import pytest

from kvsidecar.ipc.vllm_layout import (
    AttentionGroupSpec,
    Mamba2GroupSpec,
    TensorPlacement,
    UnsupportedConfig,
    build_layout,
)

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
