"""The connector's worker side: one tp rank, the only side that talks to a sidecar.

vLLM builds it in every worker (role WORKER), through
:class:`~kvsidecar.ipc.client.SidecarClient`. Nothing NIXL runs inside vLLM:
the rank's sidecar owns the agent, the peer handshakes and the transfers.

Request flow (pull, as vLLM's NixlConnector)::

    P scheduler  request_finished        -> hold job + kv_transfer_params (sidecar addresses)
    P worker     start_load_kv           -> hold(blocks, lease)
                 get_transfer_results    <- poll: sent | expired | aborted  => finished_sending
    D scheduler  get_num_new_matched_tokens / update_state_after_alloc -> read job
    D worker     start_load_kv           -> read(local, remote, skip_tokens, num_tokens)
                 get_transfer_results    <- poll: received => finished_recving
                                                  failed   => finished_recving + invalid blocks
                                                              (one group: vLLM keeps the valid
                                                              prefix), or + failed_recving

Errors never leave a connector call (:mod:`.link`): a refused read is the
same failed completion a failed transfer gives ("finished receiving,
failed"), a refused hold ends the request's send, a sidecar that lost the
rank's registration (it restarted) fails what was in flight and is registered
with again, and a sidecar that does not answer leaves its requests waiting for
its answer. A keepalive thread keeps an idle worker registered
(:mod:`kvsidecar.ipc.keepalive`); D keeps P's holds of the requests it
admitted until it reads them (``Keep``).

Memory: :meth:`WorkerSide.mem_pool_context` makes vLLM's one KV allocation
land where the sidecar can reach it (:mod:`.pool`): a reservation the sidecar
allocates and owns (``memory`` ``memfd``, the CPU default; ``cuda_vmm`` /
``cuda_malloc`` on a GPU, opt-in and not yet run with vLLM on a GPU), or POSIX
shared memory this connector creates (``shm``), and ``register_kv_caches``
registers its layer ranges with the sidecar in attach mode (no copy). A KV
cache vLLM allocated elsewhere is refused at start-up, as is a GPU worker
without a GPU ``memory``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig

from ...ipc.client import Duplicate, SidecarClient, SidecarError, Unavailable
from ...ipc.keepalive import Keepalive
from ...ipc.memory import ENGINE_SHM_PREFIX, ShmRegion
from ...ipc.protocol import RELEASING, MemoryKind
from ...ipc.regions import Region
from .layout import UnsupportedConfig
from .messages import KvSidecarAddresses, KvSidecarHandshake
from .pool import ShmKVPool, SidecarKVPool
from .settings import (
    BATCH_MINOR,
    KEEP_MINOR,
    KEEPALIVE_MINOR,
    NEEDS_MINOR,
    RESERVE_MINOR,
    TESTED_VLLM,
    TOKEN_MINOR,
    Settings,
    memory_for,
    socket_device,
)
from .specs import group_kind, layout_for
from .transfers import Transfers

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

_ONE_RANK = " (one sidecar serves one rank of an engine: give every tp rank its own)"

T = TypeVar("T")

#: how long a worker starting again waits for its sidecar to finish releasing
#: the same engine id's previous registration (its reads end within the
#: sidecar's --read-timeout, 60 s by default, and 15 s more)
RELEASING_WAIT_S = 120.0


def after_release(call: Callable[[], T], what: str, wait_s: float = RELEASING_WAIT_S,
                  pause_s: float = 0.5) -> T:
    """``call()``; made again every ``pause_s`` while the sidecar refuses it
    ``unavailable`` because it is still releasing this engine id's previous
    registration (a worker restarted under the same id, its predecessor's reads
    still ending: they may write into the old memory, so the sidecar takes no
    new registration of the id meanwhile), up to ``wait_s``; then, or on any
    other error, the error."""
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            return call()
        except Unavailable as e:
            if RELEASING not in str(e) or time.monotonic() + pause_s > deadline:
                raise
            if not told:
                log.info("kvsidecar: %s waits for the sidecar to release the previous "
                         "registration of this engine id: %s", what, e)
                told = True
            time.sleep(pause_s)


class WorkerSide(Transfers):
    """One tp rank: registers its KV cache with its sidecar and drives transfers."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 settings: Settings) -> None:
        kt = vllm_config.kv_transfer_config
        assert kt is not None and kt.engine_id is not None
        tp_rank = _tp_rank(vllm_config)
        device = vllm_config.device_config.device_type if vllm_config.device_config else "cpu"
        memory = memory_for(device, settings.memory)
        vl = layout_for(vllm_config, kv_cache_config, settings.kernel_block_size)
        index = torch.cuda.current_device() if device == "cuda" else None
        socket = settings.socket_for(tp_rank, vllm_config.parallel_config.rank,
                                     socket_device(device, index))
        client = SidecarClient(socket, timeout_s=settings.client_timeout_s)
        minor = _sidecar_minor(client, socket, tp_rank, memory)
        super().__init__(client, kt.engine_id, tp_rank, socket, settings, memory, vl,
                         batches=minor >= BATCH_MINOR, keeps=minor >= KEEP_MINOR,
                         one_group=len(kv_cache_config.kv_cache_groups) == 1)
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._pool: ShmKVPool | None = None
        self._keepalive_minor = minor >= KEEPALIVE_MINOR

    def mem_pool_context(self) -> contextlib.AbstractContextManager[Any]:
        sizes = {t.size for t in self.kv_cache_config.kv_cache_tensors}
        if len(sizes) != 1:
            raise UnsupportedConfig(f"expected one KV backing allocation, got sizes {sizes}")
        size = sizes.pop()
        if self.memory == "shm":
            self._pool = ShmKVPool(size, f"{ENGINE_SHM_PREFIX}vllm{self.tp_rank}")
            return self._pool
        # The sidecar allocates (and owns) the memory; vLLM's one KV allocation
        # becomes a view of it (integrations/vllm/pool.py). One reservation per engine id
        # per sidecar: each tp rank needs its own sidecar.
        try:
            region = self.client.reserve(self.engine_id, size, self.memory)
        except (SidecarError, OSError) as e:
            hint = _ONE_RANK if isinstance(e, Duplicate) else ""
            raise UnsupportedConfig(f"the kvsidecar at {self.socket} could not reserve {size} B "
                                    f"of {self.memory!r} for tp rank {self.tp_rank}'s KV cache: "
                                    f"{e}{hint}") from e
        self._kvpool = SidecarKVPool(region, expect_bytes=size)
        return self._kvpool

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        tensors = list(_tensors(kv_caches.values()))
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        base: Region | None = None
        if self._pool is not None:
            base = self._pool.region
        elif self._kvpool is not None and self._kvpool.tensor is not None:
            base = self._kvpool.region
        if base is None or storages != {base.address}:
            raise UnsupportedConfig(
                "vLLM's KV cache is not in kvsidecar shared memory: it must be allocated "
                "inside KvSidecarConnector.get_mem_pool_context() (vLLM >= 0.33 does this "
                f"for connectors; tested: {', '.join(TESTED_VLLM)})"
            )
        kbs = self._kernel_block_size(kv_caches)
        if kbs is not None:
            # The layout follows the attention backend's kernel blocks as vLLM
            # allocated them, so sub_blocks is what the kernels use.
            self.vl = layout_for(self.vllm_config, self.kv_cache_config, kbs)
        if self._kvpool is not None:
            self.regions = self._kvpool.views([(r.offset, r.nbytes) for r in self.vl.regions])
        else:
            assert isinstance(base, ShmRegion)
            self.regions = [ShmRegion.attach(base.name, r.nbytes, offset=r.offset)
                            for r in self.vl.regions]
        try:
            reg = after_release(lambda: self.client.register(
                self.engine_id, self.tp_rank, self.vl.layout, regions=self.regions),
                f"tp rank {self.tp_rank}'s registration")
        except SidecarError as e:
            hint = _ONE_RANK if isinstance(e, Duplicate) else ""
            raise UnsupportedConfig(f"the kvsidecar at {self.socket} refused tp rank "
                                    f"{self.tp_rank}'s KV cache: {e}{hint}") from e
        self.handshake = KvSidecarHandshake(self.engine_id, self.tp_rank,
                                            reg.handshake_address, reg.hold_key)
        self.registrations += 1
        log.info("kvsidecar: engine %s rank %d registered %d regions of %d B at %s "
                 "(handshake %s)", self.engine_id, self.tp_rank, len(self.regions),
                 self.vl.layout.region_bytes, self.socket, reg.handshake_address)
        if self._keepalive_minor:
            self._keepalive = Keepalive(self.socket, [self.engine_id],
                                        timeout_s=self.settings.client_timeout_s).start()
        else:
            log.warning("kvsidecar: the sidecar at %s speaks protocol minor < %d: this idle "
                        "worker is released after its --engine-lease; upgrade the sidecar",
                        self.socket, KEEPALIVE_MINOR)

    def _kernel_block_size(self, kv_caches: dict[str, Any]) -> int | None:
        """Tokens per kernel block of the attention views vLLM registered
        (``[kernel blocks, heads, tokens, K|V]``), checked against the setting."""
        sizes: set[int] = set()
        for g in self.kv_cache_config.transfer_groups:
            if group_kind(g.kv_cache_spec) != "attention":
                continue
            for name in g.layer_names:
                t = kv_caches.get(name)
                if isinstance(t, torch.Tensor) and t.dim() == 4:
                    sizes.add(int(t.shape[2]))  # [kernel blocks, heads, tokens, K|V]
                elif isinstance(t, torch.Tensor) and t.dim() == 3:
                    sizes.add(int(t.shape[1]))  # MLA: [kernel blocks, tokens, latent]
        if not sizes:
            return self.settings.kernel_block_size
        if len(sizes) > 1:
            raise UnsupportedConfig(f"attention layers use different kernel block sizes "
                                    f"{sorted(sizes)}; kvsidecar needs one")
        kbs = sizes.pop()
        if self.settings.kernel_block_size not in (None, kbs):
            raise UnsupportedConfig(
                f"kernel_block_size {self.settings.kernel_block_size} is set, but vLLM's "
                f"attention backend uses kernel blocks of {kbs} tokens; drop the setting")
        return kbs

    def new_address(self) -> KvSidecarAddresses | None:
        """This rank's sidecar address once it changed (registered again), once."""
        if not self._unpublished or self.handshake is None:
            return None
        self._unpublished = False
        return KvSidecarAddresses({self.tp_rank: self.handshake.address},
                                  {self.tp_rank: self.handshake.hold_key})

    def shutdown(self) -> None:
        if self._keepalive is not None:
            self._keepalive.close()
        # A dead sidecar must not stall exit.
        self.client.timeout_s = min(self.client.timeout_s, 2.0)
        with contextlib.suppress(SidecarError):
            # Drain: requests held for decode but not yet read are still served from
            # the sidecar's memory after this process exits, then freed.
            self.client.deregister(self.engine_id, "drain")
        self.client.close()
        for r in self.regions:
            r.close()
        if self._pool is not None and self._pool.region is not None:
            self._pool.region.unlink()
        if self._kvpool is not None:
            self._kvpool.region.close()  # the sidecar keeps (or freed) its own


def _sidecar_minor(client: SidecarClient, socket: str, tp_rank: int, memory: MemoryKind
                   ) -> int:
    """The protocol minor of the sidecar ``client`` reaches, refused (the client
    closed) when none answers or it is too old for this connector."""
    try:
        pong = client.ping()
    except SidecarError as e:
        client.close()
        raise UnsupportedConfig(f"no kvsidecar answers at {socket} (tp rank "
                                f"{tp_rank}): {e}") from e
    too_old = ""
    if pong.minor < NEEDS_MINOR:
        too_old = (f"the kvsidecar at {socket} speaks protocol {pong.version}.{pong.minor}; "
                   f"this connector needs {pong.version}.{NEEDS_MINOR} or later (it reports "
                   "descriptor counts): upgrade the sidecar")
    elif pong.minor < TOKEN_MINOR:
        too_old = (f"the kvsidecar at {socket} speaks protocol {pong.version}.{pong.minor}; "
                   f"this connector needs {pong.version}.{TOKEN_MINOR} or later (hold tokens): "
                   "upgrade the sidecar")
    elif memory != "shm" and pong.minor < RESERVE_MINOR:
        too_old = (f"memory {memory!r} needs a sidecar reservation (protocol "
                   f"{pong.version}.{RESERVE_MINOR}); the kvsidecar at {socket} speaks "
                   f"{pong.version}.{pong.minor}: upgrade it, or use memory 'shm' on CPU")
    if too_old:
        client.close()
        raise UnsupportedConfig(too_old)
    return int(pong.minor)


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        else:
            yield from _tensors(v)


def _tp_rank(vllm_config: VllmConfig) -> int:
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return int(get_tp_group().rank_in_group)
    except (AssertionError, AttributeError, RuntimeError):
        # No distributed state (a unit test, or a single process): the
        # parallel config's rank is this worker's.
        pc = vllm_config.parallel_config
        return int(pc.rank) % int(pc.tensor_parallel_size)
