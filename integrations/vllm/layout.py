"""vLLM's KV-cache description -> the kvsidecar layout (LAYOUT.md), refusing what we cannot serve.

vLLM 0.33 allocates one backing buffer per worker and places every layer in it
(``KVCacheTensor``: layer ``l`` of block ``b`` at ``offset + l*layer_stride +
b*block_stride``); the groups of the hybrid allocator overlay the same bytes.
kvsidecar needs each region to be ``num_blocks`` consecutive pages, so a layer's
pages must be contiguous ("layer-outermost", what NixlConnector's ``LBHNC``
layout gives): each distinct layer range becomes one region, and every group
views the regions its layers live in.

Inside a page, vLLM's attention view is ``[heads][tokens][K|V]`` per kernel
block: one KV head's bytes are contiguous, so one segment ``kv`` whose unit is a
head serves every tp split (LAYOUT.md section 3 only needs units to be
contiguous; K and V need not be separate segments). A Mamba2 page is the DS
conv state ``[x | B | C][conv_rows]`` followed by the temporal state
``[heads][head_dim][d_state]``.

Pure functions over plain numbers: the connector gathers the numbers from
vLLM's objects (:func:`kvsidecar.integrations.vllm.specs.layout_for`) so that this module
can be tested without vLLM and typed strictly.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from ...ipc.layout import Group, Layout, LayoutError, Segment, validate


class UnsupportedConfig(ValueError):
    """A vLLM KV-cache configuration kvsidecar cannot serve; raised at start-up."""


@dataclass(frozen=True)
class TensorPlacement:
    """One ``KVCacheTensor``: its layers in order and their strides (bytes)."""

    layers: tuple[str, ...]
    offset: int
    layer_stride: int
    block_stride: int
    host_resident: bool = False


@dataclass(frozen=True)
class AttentionGroupSpec:
    """An attention group without quantisation: full attention (vLLM
    ``FullAttentionSpec``), sliding window (``SlidingWindowSpec``: ``window``
    tokens, block lists are tails) or MLA (``MLAAttentionSpec``: ``latent``, one
    latent vector per token that every tp rank holds whole)."""

    layers: tuple[str, ...]
    block_size: int  # vLLM's logical block size (tokens)
    kernel_block_size: int  # tokens per kernel block (the attention backend's)
    num_kv_heads: int  # on this rank
    total_kv_heads: int
    head_size: int
    head_size_v: int
    dtype_bytes: int
    page_bytes: int
    window: int = 0
    latent: bool = False


@dataclass(frozen=True)
class Mamba2GroupSpec:
    """A Mamba2 group (vLLM ``MambaSpec``, DS conv layout)."""

    layers: tuple[str, ...]
    conv_shape: tuple[int, int]  # (conv_dim_local, conv_rows)
    temporal_shape: tuple[int, int, int]  # (heads_local, head_dim, d_state)
    conv_dtype_bytes: int
    ssm_dtype_bytes: int
    n_groups: int  # model total
    num_heads: int  # model total
    page_bytes: int


@dataclass(frozen=True)
class GdnGroupSpec:
    """A gated-delta-net group (vLLM ``MambaSpec`` of type GDN: Qwen3-Next), DS
    conv layout ``Q | K | V`` per channel, temporal state per value head."""

    layers: tuple[str, ...]
    conv_shape: tuple[int, int]  # (conv_dim_local, conv_rows)
    temporal_shape: tuple[int, int, int]  # (v_heads_local, head_v_dim, head_k_dim)
    conv_dtype_bytes: int
    ssm_dtype_bytes: int
    num_k_heads: int  # model total
    num_v_heads: int  # model total
    head_k_dim: int
    head_v_dim: int
    page_bytes: int


@dataclass(frozen=True)
class Mamba1GroupSpec:
    """A Mamba1 group (vLLM ``MambaSpec`` of type MAMBA1: Jamba, Falcon-Mamba):
    conv state ``x`` per channel, temporal state ``[channels][d_state]``."""

    layers: tuple[str, ...]
    conv_shape: tuple[int, int]  # (channels_local, conv_rows)
    temporal_shape: tuple[int, int]  # (channels_local, d_state)
    conv_dtype_bytes: int
    ssm_dtype_bytes: int
    intermediate_size: int  # model total channels
    page_bytes: int


GroupSpec = AttentionGroupSpec | Mamba2GroupSpec | GdnGroupSpec | Mamba1GroupSpec


@dataclass(frozen=True)
class Region:
    """Where one region lives inside vLLM's backing buffer."""

    offset: int
    nbytes: int


@dataclass(frozen=True)
class VllmLayout:
    """The layout to register, and where each of its regions is in vLLM's buffer."""

    layout: Layout
    regions: tuple[Region, ...]
    group_kinds: tuple[str, ...]
    block_sizes: tuple[int, ...]  # vLLM logical block size per group (0: mamba)


def build_layout(*, model: str, tp_size: int, num_blocks: int,
                 tensors: list[TensorPlacement], groups: list[GroupSpec],
                 dtype: str) -> VllmLayout:
    """The kvsidecar layout of one vLLM worker rank; :class:`UnsupportedConfig` if none fits."""
    if not groups:
        raise UnsupportedConfig("the KV-cache config has no transferable groups")
    group_of: dict[str, int] = {}
    for gi, g in enumerate(groups):
        for name in g.layers:
            group_of[name] = gi
    pages = {g.page_bytes for g in groups}
    if len(pages) != 1:
        raise UnsupportedConfig(f"groups have different page sizes {sorted(pages)}; kvsidecar "
                                "needs one page size (vLLM's hybrid allocator unifies them)")
    page = pages.pop()
    starts: dict[int, set[int]] = {}  # region start -> groups viewing it
    for t in tensors:
        if t.host_resident:
            raise UnsupportedConfig(f"layers {list(t.layers)} live in host-resident memory "
                                    "(HiSparse); kvsidecar serves the device pool only")
        for li, name in enumerate(t.layers):
            if name not in group_of:
                continue  # not transferred (e.g. an ephemeral replica)
            if t.block_stride != page:
                raise UnsupportedConfig(
                    f"layer {name}: blocks are {t.block_stride} B apart but a page is {page} B; "
                    "kvsidecar needs each layer's pages contiguous (a layer-outermost KV "
                    "layout such as LBHNC)"
                )
            starts.setdefault(t.offset + li * t.layer_stride, set()).add(group_of[name])
    if not starts:
        raise UnsupportedConfig("no KV-cache tensor holds a transferable layer")
    ordered = sorted(starts)
    nbytes = num_blocks * page
    for a, b in itertools.pairwise(ordered):
        if a + nbytes > b:
            raise UnsupportedConfig(
                f"layer ranges at {a} and {b} overlap ({nbytes} B each): the layout is not "
                "layer-outermost"
            )
    group_regions = [tuple(ri for ri, s in enumerate(ordered) if gi in starts[s])
                     for gi in range(len(groups))]
    built = [_build_group(g, tp_size, group_regions[gi], len(ordered))
             for gi, g in enumerate(groups)]
    facts: dict[str, str | int] = {"name": model, "dtype": dtype}
    for gi, g in enumerate(groups):
        facts[f"group{gi}.layers"] = len(g.layers)
    family = "+".join(sorted({_family(g) for g in groups}))
    try:
        layout = validate(Layout(family, tp_size, len(ordered), num_blocks, page,
                                 tuple(b for b, _ in built), facts))
    except LayoutError as e:
        raise UnsupportedConfig(f"vLLM's KV cache does not fit the kvsidecar layout: {e}") from e
    return VllmLayout(layout, tuple(Region(s, nbytes) for s in ordered),
                      tuple(g.kind for g, _ in built), tuple(bs for _, bs in built))


def _whole(what: str, a: int, b: int) -> int:
    if b <= 0 or a % b:
        raise UnsupportedConfig(f"{what}: {a} is not a multiple of {b}")
    return a // b


def _local(total: int, tp: int, what: str) -> int:
    """Units a rank holds (LAYOUT.md section 3)."""
    if tp <= total:
        return _whole(f"{what} over tp {tp}", total, tp)
    _whole(f"tp {tp} over {what}", tp, total)
    return 1


def _attention(g: AttentionGroupSpec, tp: int, regions: tuple[int, ...],
               num_regions: int) -> tuple[Group, int]:
    kbs = g.kernel_block_size
    sub = _whole(f"block size {g.block_size} over kernel block size {kbs}", g.block_size, kbs)
    if g.latent:
        # MLA: one latent vector per token, the same on every rank: one unit,
        # read whole by every D rank from one P rank.
        if g.num_kv_heads != 1:
            raise UnsupportedConfig(f"an MLA group with {g.num_kv_heads} KV heads per rank "
                                    "(expected one latent)")
        kernel = kbs * (g.head_size + g.head_size_v) * g.dtype_bytes
        if sub * kernel > g.page_bytes:
            raise UnsupportedConfig(f"{sub} kernel blocks of {kernel} B exceed the page")
        seg = Segment("latent", 0, kernel, 1, "replicated",
                      regions=() if len(regions) == num_regions else regions)
        return Group("attention", (seg,), sub, kernel, kbs), g.block_size
    if g.num_kv_heads != _local(g.total_kv_heads, tp, "KV heads"):
        raise UnsupportedConfig(
            f"{g.num_kv_heads} KV heads on this rank do not match {g.total_kv_heads} heads "
            f"over tp {tp}"
        )
    unit = kbs * (g.head_size + g.head_size_v) * g.dtype_bytes
    kernel = g.num_kv_heads * unit
    if sub * kernel > g.page_bytes:
        raise UnsupportedConfig(f"{sub} kernel blocks of {kernel} B exceed the page")
    seg = Segment("kv", 0, kernel, g.total_kv_heads,
                  regions=() if len(regions) == num_regions else regions)
    return Group("attention", (seg,), sub, kernel, kbs, g.window), g.block_size


def _gdn(g: GdnGroupSpec, tp: int, regions: tuple[int, ...],
         num_regions: int) -> tuple[Group, int]:
    conv_dim, rows = g.conv_shape
    heads, vdim, kdim = g.temporal_shape
    if (vdim, kdim) != (g.head_v_dim, g.head_k_dim):
        raise UnsupportedConfig(f"GDN temporal state {g.temporal_shape} does not match head "
                                f"dims v {g.head_v_dim}, k {g.head_k_dim}")
    if heads != _local(g.num_v_heads, tp, "GDN value heads"):
        raise UnsupportedConfig(f"{heads} GDN value heads on this rank do not match "
                                f"{g.num_v_heads} over tp {tp}")
    key_dim, value_dim = g.num_k_heads * g.head_k_dim, g.num_v_heads * g.head_v_dim
    k_local = _local(g.num_k_heads, tp, "GDN key heads") * g.head_k_dim
    v_local = heads * g.head_v_dim
    if conv_dim != 2 * k_local + v_local:
        raise UnsupportedConfig(f"GDN conv state of {conv_dim} channels is not Q|K|V "
                                f"({k_local} + {k_local} + {v_local}) on this rank")
    row = rows * g.conv_dtype_bytes
    only = () if len(regions) == num_regions else regions
    segs = [
        Segment("Q", 0, k_local * row, key_dim, regions=only),
        Segment("K", k_local * row, k_local * row, key_dim, regions=only),
        Segment("V", 2 * k_local * row, v_local * row, value_dim, regions=only),
        Segment("ssm", conv_dim * row, heads * vdim * kdim * g.ssm_dtype_bytes, g.num_v_heads,
                regions=only),
    ]
    if conv_dim * row + heads * vdim * kdim * g.ssm_dtype_bytes > g.page_bytes:
        raise UnsupportedConfig("the GDN state exceeds its page")
    return Group("mamba", tuple(segs)), 0


def _mamba1(g: Mamba1GroupSpec, tp: int, regions: tuple[int, ...],
            num_regions: int) -> tuple[Group, int]:
    channels, rows = g.conv_shape
    if g.temporal_shape[0] != channels or channels != _local(g.intermediate_size, tp,
                                                               "Mamba1 channels"):
        raise UnsupportedConfig(f"Mamba1 state {g.conv_shape}, {g.temporal_shape} does not "
                                f"hold {g.intermediate_size} channels over tp {tp}")
    row, ub = rows * g.conv_dtype_bytes, g.temporal_shape[1] * g.ssm_dtype_bytes
    only = () if len(regions) == num_regions else regions
    segs = (Segment("x", 0, channels * row, g.intermediate_size, regions=only),
            Segment("ssm", channels * row, channels * ub, g.intermediate_size, regions=only))
    if channels * (row + ub) > g.page_bytes:
        raise UnsupportedConfig("the Mamba1 state exceeds its page")
    return Group("mamba", segs), 0


def _mamba2(g: Mamba2GroupSpec, tp: int, regions: tuple[int, ...],
            num_regions: int) -> tuple[Group, int]:
    conv_dim, rows = g.conv_shape
    heads, head_dim, d_state = g.temporal_shape
    x_local = heads * head_dim
    ng_local = _whole("conv channels beyond x over 2*d_state", conv_dim - x_local, 2 * d_state)
    if ng_local != _local(g.n_groups, tp, "n_groups"):
        raise UnsupportedConfig(f"{ng_local} groups on this rank do not match n_groups "
                                f"{g.n_groups} over tp {tp}")
    if heads != _local(g.num_heads, tp, "mamba heads"):
        raise UnsupportedConfig(f"{heads} mamba heads on this rank do not match {g.num_heads} "
                                f"over tp {tp}")
    cb, sb = g.conv_dtype_bytes, g.ssm_dtype_bytes
    row = rows * cb
    only = () if len(regions) == num_regions else regions
    segs = [
        Segment("x", 0, x_local * row, g.num_heads * head_dim, regions=only),
        Segment("B", x_local * row, ng_local * d_state * row, g.n_groups, regions=only),
        Segment("C", (x_local + ng_local * d_state) * row, ng_local * d_state * row,
                g.n_groups, regions=only),
        Segment("ssm", conv_dim * row, heads * head_dim * d_state * sb, g.num_heads,
                regions=only),
    ]
    if conv_dim * row + heads * head_dim * d_state * sb > g.page_bytes:
        raise UnsupportedConfig("the Mamba state exceeds its page")
    return Group("mamba", tuple(segs)), 0


def _build_group(g: GroupSpec, tp: int, regions: tuple[int, ...],
                 num_regions: int) -> tuple[Group, int]:
    build: Any = _BUILDERS[type(g)]
    out: tuple[Group, int] = build(g, tp, regions, num_regions)
    return out


_BUILDERS = {AttentionGroupSpec: _attention, Mamba2GroupSpec: _mamba2, GdnGroupSpec: _gdn,
             Mamba1GroupSpec: _mamba1}


def _family(g: GroupSpec) -> str:
    if isinstance(g, AttentionGroupSpec):
        return "mla" if g.latent else "swa" if g.window else "attention"
    return _STATE_FAMILY[type(g)]


_STATE_FAMILY = {GdnGroupSpec: "gdn", Mamba2GroupSpec: "mamba2", Mamba1GroupSpec: "mamba1"}
