"""kvsidecar as a vLLM v1 KV connector (vLLM 0.33): P/D through the sidecars.

::

    --kv-transfer-config '{"kv_connector": "KvSidecarConnector",
                           "kv_connector_module_path": "kvsidecar.integrations.vllm",
                           "kv_role": "kv_producer" | "kv_consumer",
                           "kv_connector_extra_config": {
                               "sidecar_socket": "/run/kvsidecar/cpu{rank}.sock"}}'

The package's modules, by job: :mod:`.connector` (the class vLLM
instantiates), :mod:`.scheduler` and :mod:`.worker` (its two sides, with
:mod:`.transfers` and :mod:`.link`), :mod:`.messages` (what the sides tell
each other), :mod:`.settings` (``kv_connector_extra_config``), :mod:`.specs`
and :mod:`.layout` (vLLM's KV cache -> the kvsidecar layout), :mod:`.pool`
(where vLLM's KV allocation lands).

The names below are imported on first use, so that :mod:`.layout` (pure) and
:mod:`.pool` (torch only) import without vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connector import KvSidecarConnector
    from .layout import UnsupportedConfig
    from .messages import KvSidecarHandshake, KvSidecarMetadata

__all__ = ["KvSidecarConnector", "KvSidecarHandshake", "KvSidecarMetadata", "UnsupportedConfig"]

_HOME = {
    "KvSidecarConnector": ".connector",
    "KvSidecarHandshake": ".messages",
    "KvSidecarMetadata": ".messages",
    "UnsupportedConfig": ".layout",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
