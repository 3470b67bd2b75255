"""kvsidecar as a vLLM v1 KV connector: P/D through the sidecars with one config change.

::

    --kv-transfer-config '{"kv_connector": "KvSidecarConnector",
                           "kv_connector_module_path": "kvsidecar.integrations.vllm",
                           "kv_role": "kv_producer" | "kv_consumer",
                           "kv_connector_extra_config": {
                               "sidecar_socket": "/run/kvsidecar/cpu{rank}.sock"}}'

vLLM builds the connector twice: in the scheduler process (role SCHEDULER,
:class:`~.scheduler.SchedulerSide`, pure bookkeeping, no I/O) and in every
worker (role WORKER, one per tp rank, :class:`~.worker.WorkerSide`, the only
side that talks to a sidecar). :class:`KvSidecarConnector` is vLLM's entry
point and only hands each call to its side.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .layout import UnsupportedConfig
from .messages import KvSidecarMetadata
from .scheduler import SchedulerSide
from .settings import Settings
from .specs import layout_for
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["KvSidecarConnector"]


class KvSidecarConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by the rank's kvsidecar (pull: D reads from P)."""

    #: the prefix-cache hits it delivers come from a peer engine, as NixlConnector's
    #: (vLLM labels them ``p2p`` in its connector prefix-cache metrics)
    _cache_hit_source = CacheHitSource.P2P

    @property
    def requires_kv_delivery(self) -> bool:
        return bool(self._kv_transfer_config.is_kv_producer)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kt = vllm_config.kv_transfer_config
        assert kt is not None
        if kt.engine_id is None:
            raise UnsupportedConfig("kv_transfer_config.engine_id is unset")
        self.settings = Settings.from_extra(dict(kt.kv_connector_extra_config or {}))
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(vllm_config, kv_cache_config, self.settings)
            # Refuse unsupported layouts in the scheduler process too: start-up, not
            # the first request.
            layout_for(vllm_config, kv_cache_config, self.settings.kernel_block_size)
        else:
            self.worker = WorkerSide(vllm_config, kv_cache_config, self.settings)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBHNC"  # layer-outermost, heads before tokens (LAYOUT.md: HND)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False

    # ------------------------------------------------------------ scheduler side

    def _sched(self) -> SchedulerSide:
        if self.scheduler is None:
            raise RuntimeError("scheduler-side method called on a worker connector")
        return self.scheduler

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(self._kv_cache_config.transfer_group_ids)

    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_meta(scheduler_output.preempted_req_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        sched = self._sched()
        sched.update_addresses(connector_output.kv_connector_worker_meta)
        sched.update_connector_output(connector_output.finished_recving)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        self._sched().set_handshakes(metadata)

    # ------------------------------------------------------------ worker side

    def _work(self) -> WorkerSide:
        if self.worker is None:
            raise RuntimeError("worker-side method called on a scheduler connector")
        return self.worker

    def get_mem_pool_context(self) -> contextlib.AbstractContextManager[Any]:
        return self._work().mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._work().handshake

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KvSidecarMetadata)
        self._work().preempted(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvSidecarMetadata)
        self._work().start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Reads complete between steps (asynchronous loads), never within a layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing to save: D pulls from P's blocks, which P holds."""

    def wait_for_save(self) -> None:
        """Nothing to save (pull)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self._work().results()
        return r.finished_sending, r.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._work().results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().load_errors()

    def get_kv_connector_stats(self) -> NixlKVConnectorStats | None:
        return self.worker.take_stats() if self.worker is not None else None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.new_address() if self.worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> NixlKVConnectorStats | None:
        return NixlKVConnectorStats(data=data) if data is not None else NixlKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: Any,
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> Any:
        return NixlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
