"""Small layouts of every family for end-to-end tests, and the demo's realistic one.

Sizes are kept small where only the shape matters (tests); the hybrid one is
chosen so that P and D pages at tp 1, 2 and 4 hold different numbers of kernel
blocks (9, 10, 5), the case that corrupts data when the wrong ratio is used.
"""

from __future__ import annotations

from collections.abc import Callable

from kvsidecar.ipc.layout import Layout, attention_layout, mamba2_hybrid_layout, mla_layout

MakeLayout = Callable[[int, int], Layout]  # (tp_size, num_blocks) -> layout


def attn(k: int) -> MakeLayout:
    return lambda tp, nb: attention_layout(model="e2e-attn", num_layers=3, total_kv_heads=k,
                                           head_dim=16, block_tokens=8, tp_size=tp,
                                           num_blocks=nb)


def hybrid(tp: int, nb: int) -> Layout:
    # n_groups 1 < tp replicates B and C, so P and D pages hold different sub_blocks.
    return mamba2_hybrid_layout(
        model="e2e-hybrid", num_layers=3, total_kv_heads=2, head_dim=16, block_tokens=8,
        intermediate_size=64, n_groups=1, d_state=32, conv_kernel=4, mamba_heads=8,
        mamba_head_dim=8, tp_size=tp, num_blocks=nb,
    )


def stall(tp: int, nb: int) -> Layout:
    """16 layers x 256 KiB per block (over the P ranks): a 96-block read moves
    384 MiB, seconds over UCX/TCP, long enough to stop or cut a peer in the
    middle of it (the fault tests of staging, lanes, recovery, second host)."""
    return attention_layout(model="stall", num_layers=16, total_kv_heads=8, head_dim=128,
                            block_tokens=64, tp_size=tp, num_blocks=nb)


def mla(tp: int, nb: int) -> Layout:
    return mla_layout(model="e2e-mla", num_layers=3, latent_dim=36, block_tokens=8,
                      tp_size=tp, num_blocks=nb)


def nemotron_like(layers: int) -> MakeLayout:
    """Nemotron-3-Nano-30B shapes (fp8 KV, 2 KV heads, Mamba2 with 8 groups, float32
    SSM state), ``layers`` regions: about 2 MiB per page per region at tp 1."""
    return lambda tp, nb: mamba2_hybrid_layout(
        model="nemotron-3-nano-like", num_layers=layers, total_kv_heads=2, head_dim=128,
        block_tokens=16, intermediate_size=4096, n_groups=8, d_state=128, conv_kernel=4,
        mamba_heads=64, mamba_head_dim=64, tp_size=tp, num_blocks=nb, kv_dtype="fp8",
        conv_dtype="bfloat16", ssm_dtype="float32",
    )
