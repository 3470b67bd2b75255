"""vLLM's KV-cache objects -> the kvsidecar layout of a rank; refuses at start-up.

:func:`layout_for` reads the numbers out of vLLM's ``VllmConfig`` and
``KVCacheConfig`` (group specs, tensors, model config) and hands them to the
pure :func:`~.layout.build_layout`. :func:`group_kind` classifies a group
spec (``attention`` or ``mamba``) by exact type; every other spec, and every
configuration kvsidecar cannot serve, is an :class:`~.layout.UnsupportedConfig`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from .layout import (
    AttentionGroupSpec,
    GdnGroupSpec,
    GroupSpec,
    Mamba1GroupSpec,
    Mamba2GroupSpec,
    TensorPlacement,
    UnsupportedConfig,
    VllmLayout,
    build_layout,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def group_kind(spec: object, model: str = "") -> str:
    """``attention`` or ``mamba``; :class:`UnsupportedConfig` naming the model
    and the spec for any other KV-cache spec (by exact type: a subclass such as
    ``SlidingWindowMLASpec`` or ``RSWASpec`` has its own page semantics)."""
    kind = _SPEC_KINDS.get(type(spec))
    if kind is None:
        of = f" of model {model}" if model else ""
        raise UnsupportedConfig(
            f"KV-cache group spec {type(spec).__name__}{of} is not supported by kvsidecar "
            f"(supported: {', '.join(t.__name__ for t in _SPEC_KINDS)}; see the README, "
            "'Model families')"
        )
    return kind


_SPEC_KINDS: dict[type, str] = {FullAttentionSpec: "attention", MLAAttentionSpec: "attention",
                                SlidingWindowSpec: "attention", MambaSpec: "mamba"}


def window_blocks(spec: object) -> int:
    """Blocks a sliding-window group transfers: ``cdiv(window, block_size) + 1``
    (the window need not start on a block boundary), as NixlConnector; 0 for
    every other group."""
    if not (isinstance(spec, SlidingWindowSpec) and type(spec) is SlidingWindowSpec):
        return 0  # (a subclass, e.g. SlidingWindowMLASpec, is refused by group_kind)
    return -(-int(spec.sliding_window) // int(spec.block_size)) + 1


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float8_e4m3fn: "fp8", torch.int8: "int8", torch.uint8: "uint8"}


def _hf_int(cfg: object, names: Sequence[str]) -> int | None:
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int):
            return v
    return None


def layout_for(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
               kernel_block_size: int | None = None) -> VllmLayout:
    """The kvsidecar layout of this rank, from vLLM's objects; refuses at start-up."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    model_config = vllm_config.model_config
    assert model_config is not None
    hf = model_config.hf_text_config
    model = str(model_config.model)
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise UnsupportedConfig(
            f"model {model}: pipeline_parallel_size "
            f"{vllm_config.parallel_config.pipeline_parallel_size} is not supported by "
            "kvsidecar (one sidecar per tp rank of a single pipeline stage); use tp only, "
            "as NixlConnector's pull mode requires for hybrid models")
    groups: list[GroupSpec] = []
    for g in kv_cache_config.transfer_groups:
        spec = g.kv_cache_spec
        kind = group_kind(spec, model)
        layers = tuple(g.layer_names)
        if kind == "attention":
            groups.append(_attention_group(spec, layers, model_config, model,
                                           kernel_block_size))
        else:
            groups.append(_state_group(spec, layers, hf, tp))
    tensors = [TensorPlacement(tuple(t.layers), t.offset, t.layer_stride, t.block_stride,
                               t.host_resident) for t in kv_cache_config.kv_cache_tensors]
    dtype = _DTYPE_NAMES.get(model_config.dtype, str(model_config.dtype))
    return build_layout(model=str(model_config.model), tp_size=tp,
                        num_blocks=kv_cache_config.num_blocks, tensors=tensors, groups=groups,
                        dtype=dtype)


def _attention_group(spec: Any, layers: tuple[str, ...], model_config: Any, model: str,
                     kernel_block_size: int | None) -> AttentionGroupSpec:
    """Full attention, MLA (one latent per token, replicated over tp) or
    sliding window; refuses quantised, packed or sparse (DeepSeek-V3.2/V4) pages."""
    if getattr(spec, "kv_quant_mode", 0) or spec.num_head_slots is not None \
            or spec.state_content_bytes is not None or spec.tokens_per_state != 1:
        raise UnsupportedConfig(f"model {model}: quantised, packed or compressed attention KV "
                                f"pages ({type(spec).__name__}) are not supported by kvsidecar")
    latent = type(spec) is MLAAttentionSpec
    if latent and (spec.model_version is not None or spec.topk_buffer_width is not None):
        raise UnsupportedConfig(f"model {model}: sparse MLA ({spec.model_version or 'top-k'}) "
                                "is not supported by kvsidecar; dense MLA is")
    window = int(spec.sliding_window) if type(spec) is SlidingWindowSpec else 0
    total = 1 if latent else model_config.get_total_num_kv_heads()
    return AttentionGroupSpec(layers, spec.block_size, kernel_block_size or spec.block_size,
                              spec.num_kv_heads, total, spec.head_size, spec.head_size_v,
                              spec.dtype.itemsize, spec.page_size_bytes, window, latent)


def _state_group(spec: Any, layers: tuple[str, ...], hf: object, tp: int) -> GroupSpec:
    """A recurrent-state group by its Mamba type: Mamba2, GDN or Mamba1."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as T

    builders: dict[Any, Callable[..., GroupSpec]] = {
        T.MAMBA2: _mamba_group, T.GDN_ATTN: _gdn_group, T.MAMBA1: _mamba1_group}
    build = builders.get(spec.mamba_type)
    if build is None:
        raise UnsupportedConfig(f"Mamba type {spec.mamba_type} is not supported by kvsidecar "
                                "(Mamba1, Mamba2 and GDN are)")
    group: GroupSpec = build(spec, layers, hf, tp)
    return group


def _mamba1_group(spec: Any, layers: tuple[str, ...], hf: object, tp: int
                  ) -> Mamba1GroupSpec:
    conv, temporal = _state_shapes(spec, "Mamba1", temporal_dims=2)
    total = _hf_int(hf, ("intermediate_size_mamba",))
    if total is None:
        expand, hidden = _hf_int(hf, ("mamba_expand", "expand")), _hf_int(hf, ("hidden_size",))
        total = expand * hidden if expand and hidden else conv[0] * tp
    return Mamba1GroupSpec(layers, (conv[0], conv[1]), (temporal[0], temporal[1]),
                           spec.dtypes[0].itemsize, spec.dtypes[1].itemsize, total,
                           spec.page_size_bytes)


def _state_shapes(spec: Any, what: str, temporal_dims: int = 3
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv, temporal) shapes of a recurrent state in the DS conv layout."""
    from vllm import envs

    if envs.VLLM_SSM_CONV_STATE_LAYOUT != "DS":
        raise UnsupportedConfig("kvsidecar needs the DS conv-state layout: set "
                                "VLLM_SSM_CONV_STATE_LAYOUT=DS on P and D")
    if len(spec.shapes) != 2:
        raise UnsupportedConfig(f"{what} state with {len(spec.shapes)} arrays (expected conv "
                                "and temporal)")
    conv, temporal = (tuple(int(d) for d in s) for s in spec.shapes)
    if len(conv) != 2 or len(temporal) != temporal_dims:
        raise UnsupportedConfig(f"{what} state shapes {spec.shapes} are not (conv_dim, rows), "
                                f"and a {temporal_dims}-d temporal state")
    return conv, temporal


def _gdn_group(spec: Any, layers: tuple[str, ...], hf: object, tp: int) -> GdnGroupSpec:
    conv, temporal = _state_shapes(spec, "GDN")
    names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim")
    vals = [_hf_int(hf, (n,)) for n in names]
    if any(v is None for v in vals):
        raise UnsupportedConfig(f"GDN layers, but the model config lacks {list(names)}")
    nk, nv, hk, hv = (int(v) for v in vals if v is not None)
    return GdnGroupSpec(layers, (conv[0], conv[1]), (temporal[0], temporal[1], temporal[2]),
                        spec.dtypes[0].itemsize, spec.dtypes[1].itemsize, nk, nv, hk, hv,
                        spec.page_size_bytes)


def _mamba_group(spec: Any, layers: tuple[str, ...], hf: object, tp: int) -> Mamba2GroupSpec:
    conv, temporal = _state_shapes(spec, "Mamba2")
    heads, head_dim, d_state = temporal
    n_groups = _hf_int(hf, ("n_groups", "mamba_n_groups"))
    num_heads = _hf_int(hf, ("mamba_num_heads", "mamba_n_heads"))
    if n_groups is None:
        n_groups = (conv[0] - heads * head_dim) // (2 * d_state) * tp
    if num_heads is None:
        num_heads = heads * tp
    return Mamba2GroupSpec(layers, (conv[0], conv[1]), (heads, head_dim, d_state),
                           spec.dtypes[0].itemsize, spec.dtypes[1].itemsize, n_groups,
                           num_heads, spec.page_size_bytes)
